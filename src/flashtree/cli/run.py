"""`flashtree run "prompt"`: one-shot generation, streamed to stdout (or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import sys

from flashtree.cli.main import add_model_args, add_parse_special_arg, add_sampling_args, int_range, sampling_from_args
from flashtree.engine.loader import load_engine


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate a completion for one prompt")
    p.add_argument("prompt", help="the prompt text (use - to read it from stdin)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("-n", "--max-tokens", type=int_range(0), default=256, help="maximum new tokens (default 256)")
    p.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    p.add_argument("--system", help="system prompt for the chat template")
    p.add_argument("--think", action="store_true", help="let the model think first (enable_thinking)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--json", action="store_true", help="print token ids, text and stats as one JSON object")
    add_parse_special_arg(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = sampling_from_args(args)  # validated before the model loads
    from flashtree.cli.main import cache_args, memory_args, placement_args

    engine = load_engine(args.model, args.draft, args.device, spec=args.spec, budget=args.budget, topk=args.topk,
                         progress=not args.json, **cache_args(args), **placement_args(args), **memory_args(args))
    engine.prefill_progress = not args.json
    engine.parse_special = args.parse_special
    prompt_ids = engine.encode_prompt(prompt, raw=args.raw, system=args.system, enable_thinking=args.think)
    config = engine.config_for(max_new_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                               ctx=args.ctx, sampling=sampling)
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
        print(f"\n\n[{config.mode}] {s.new_tokens} token{'s' if s.new_tokens != 1 else ''}, {s.tokens_per_s:.1f} "
              f"tok/s, {accepted}, finish: {result.finish_reason}", file=sys.stderr)
    return 0


def _print_piece(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
