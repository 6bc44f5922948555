"""`flashtree run "prompt"`: one-shot generation, streamed to stdout (or one JSON object with --json).
Without a prompt it opens the chat, as `ollama run` does.

torch and the engine are imported inside the functions that run the command: `flashtree --help` builds
every subcommand's parser and must not wait for them."""

from __future__ import annotations

import argparse
import json
import sys

from flashtree.cli.args import (add_model_args, add_parse_special_arg, add_sampling_args, add_thinking_arg,
                                engine_args, int_range, sampling_from_args, thinking_kwargs)
from flashtree.errors import FlashtreeError

RUN_MAX_TOKENS = 256


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate a completion for one prompt (no prompt: open the chat)")
    p.add_argument("prompt", nargs="?",
                   help="the prompt text (- reads it from stdin; none: stdin when piped, else the chat opens)")
    p.add_argument("-p", "--prompt", dest="prompt_option", metavar="TEXT", help="the prompt, as llama.cpp takes it")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("-n", "--max-tokens", "--n-predict", type=int_range(0), default=None,
                   help=f"maximum new tokens (default {RUN_MAX_TOKENS}; in the chat, the chat's)")
    p.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    p.add_argument("--system", help="system prompt for the chat template")
    add_thinking_arg(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--special", action="store_true",
                   help="keep special tokens such as <|im_end|> in the printed text (ids are the same either way)")
    p.add_argument("--json", action="store_true", help="print token ids, text and stats as one JSON object")
    add_parse_special_arg(p)
    p.set_defaults(handler=run)


def prompt_text(args: argparse.Namespace) -> str | None:
    """The prompt from the positional argument or -p (not both); `-`, or none with stdin piped in, reads
    stdin (as `echo hi | ollama run`); None: no prompt, at a terminal."""
    if args.prompt is not None and args.prompt_option is not None:
        raise FlashtreeError("give the prompt once: as an argument or with -p, not both")
    prompt = args.prompt if args.prompt is not None else args.prompt_option
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    return prompt


def run(args: argparse.Namespace) -> int:
    prompt = prompt_text(args)
    if prompt is None:
        from flashtree.cli.chat import run_chat

        return run_chat(args)
    sampling = sampling_from_args(args)  # validated before the model loads
    from flashtree.engine.loader import load_engine  # deferred: torch loads only once a command runs

    engine = load_engine(engine_args(args, progress=not args.json, prefill_progress=not args.json,
                                     parse_special=args.parse_special))
    prompt_ids = engine.encode_prompt(prompt, raw=args.raw, system=args.system, **thinking_kwargs(args.think))
    max_tokens = RUN_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    config = engine.config_for(max_new_tokens=max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                               ctx=args.ctx, sampling=sampling, skip_special_tokens=not args.special)
    stream = None if args.json else _print_piece
    result = engine.generate(prompt_ids, config, on_text=stream)
    if args.json:
        print(json.dumps({"mode": config.mode, "prompt_tokens": len(prompt_ids), "token_ids": result.token_ids,
                          "text": result.text, "finish_reason": result.finish_reason, "stats": result.stats.as_dict()},
                         ensure_ascii=False))
    else:
        s = result.stats
        # no target step after the prefill (one token): no acceptance length to report
        accepted = f"acceptance length {s.acceptance_length:.2f}" if s.steps else "no decode steps"
        if s.ar_fallback_steps:  # the adaptive policy found speculation not paying for a while
            accepted += f" ({s.ar_fallback_steps} AR steps, {len(s.budget_switches)} budget changes)"
        print(f"\n\n[{config.mode}] {s.new_tokens} token{'s' if s.new_tokens != 1 else ''}, {s.tokens_per_s:.1f} "
              f"tok/s, {accepted}, finish: {result.finish_reason}", file=sys.stderr)
    return 0


def _print_piece(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
