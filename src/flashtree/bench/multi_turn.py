"""`flashtree bench --multi-turn`: time to first token per turn of a chat session with a long system
prompt, with and without the prefix cache (docs/PREFIX_CACHE.md).

Both runs use the same weights and the same greedy settings; each turn resends the whole
conversation, as chat clients do. TTFT is the time from the request to the logits of the first
token (prefill, including restoring a cached prefix). "forwards on" is the part of the cached TTFT spent
in the prompt chunks' forwards (timed with a device sync around each); the rest is the cache's own cost
(lookup, restore, snapshots).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from flashtree.bench.report import save_report
from flashtree.bench.steps import clock
from flashtree.engine.generate import Engine
from flashtree.engine.prefix_cache import PrefixCache
from flashtree.engine.runner import ModelRunner
from flashtree.formats.chat_template import template_or_chatml

QUESTIONS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Now make it ignore punctuation and case.",
    "Add a docstring and two doctests.",
    "Explain its time complexity.",
    "Rewrite it without slicing.",
    "Write a unit test module for it with pytest.",
    "Summarise what we did in one sentence.",
    "Thanks. Anything else worth adding?",
)

FILLER = ("You are a careful senior engineer. Follow the style guide: type hints everywhere, short functions, "
          "docstrings in the imperative mood, no global state, tests for every public function. ")


class _ForwardTimer:
    """Stands in for `engine.runner.prefill` (the chunk forwards both prefill paths call) and adds up their time."""

    def __init__(self, runner: ModelRunner):
        self.inner, self.device, self.clock, self.seconds = runner.prefill, runner.target.model.device, clock, 0.0

    def __call__(self, *args, **kwargs):
        start = self.clock(self.device)
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += self.clock(self.device) - start


def system_prompt(engine, tokens: int) -> str:
    """Filler text of about `tokens` tokens (rule numbers keep it from being one repeated sentence)."""
    parts, count, rule = [], 0, 0
    while count < tokens:
        rule += 1
        piece = f"Rule {rule}: {FILLER}"
        parts.append(piece)
        count += len(engine.tokenizer.encode(piece))
    return "".join(parts)


def run_multi_turn(args, engine: Engine, model_name: str, device: str) -> int:
    mode = args.modes[0] if args.modes else ("ddtree" if engine.draft is not None else "ar")
    template = template_or_chatml(engine.target.chat_template)  # as the server
    system = system_prompt(engine, args.system_tokens)
    base = engine.config_for(max_new_tokens=args.max_tokens, mode=mode, ignore_eos=True)
    plain = Engine(engine.target, engine.draft, base)
    cached = Engine(engine.target, engine.draft, base, prefix_cache=PrefixCache(interval=args.prefix_cache_interval))
    cached.runner.prefill = forwards = _ForwardTimer(cached.runner)
    first = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
    # warm-up at full size (allocator, kernels for every chunk shape), so turn 1 is timed like the rest
    warm_ids = engine.tokenizer.encode(template.render(first, add_generation_prompt=True))
    plain.generate(warm_ids, replace(base, max_new_tokens=4))
    runs = {}
    for name, eng in (("off", plain), ("on", cached)):
        messages = [{"role": "system", "content": system}]
        turns = []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            ids = engine.tokenizer.encode(template.render(messages, add_generation_prompt=True))
            hit_before = eng.prefix_cache.stats.hit_tokens if eng.prefix_cache else 0
            forwards.seconds = 0.0
            result = eng.generate(ids, base)
            if engine.target.model.device.type == "cuda":
                torch.cuda.synchronize()
            hit = (eng.prefix_cache.stats.hit_tokens - hit_before) if eng.prefix_cache else 0
            turns.append({"prompt_tokens": len(ids), "cached_tokens": hit, "ttft_s": result.stats.prefill_s,
                          "total_s": result.stats.total_s, "token_ids": result.token_ids,
                          "forwards_s": forwards.seconds})
            messages.append({"role": "assistant", "content": result.text})
        runs[name] = turns
    rows = []
    for turn, (off, on) in enumerate(zip(runs["off"], runs["on"]), start=1):
        rows.append({"turn": turn, "prompt_tokens": on["prompt_tokens"], "cached_tokens": on["cached_tokens"],
                     "ttft_off_s": round(off["ttft_s"], 4), "ttft_on_s": round(on["ttft_s"], 4),
                     "forwards_on_s": round(on["forwards_s"], 4),
                     "speedup": round(off["ttft_s"] / on["ttft_s"], 2) if on["ttft_s"] else None,
                     "identical": off["token_ids"] == on["token_ids"]})
    report = {"date": time.strftime("%Y-%m-%d"), "device": device, "model": model_name, "mode": mode,
              "system_tokens": args.system_tokens, "turns": args.turns, "max_tokens": args.max_tokens,
              "prefix_cache_entries": len(cached.prefix_cache.entries),
              "prefix_cache_bytes": cached.prefix_cache.nbytes, "rows": rows}
    save_report(report, args.out)
    print(f"device: {device}   model: {model_name}   mode: {mode}   system prompt ~{args.system_tokens} tokens, "
          f"{args.max_tokens} new tokens per turn")
    print(f"{'turn':>4}{'prompt':>8}{'cached':>8}{'TTFT off (s)':>14}{'TTFT on (s)':>13}{'forwards on':>13}"
          f"{'speedup':>9}  identical")
    for r in rows:
        print(f"{r['turn']:>4}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}{r['ttft_off_s']:>14.3f}"
              f"{r['ttft_on_s']:>13.3f}{r['forwards_on_s']:>13.3f}{(r['speedup'] or 0):>8.1f}x  "
              f"{'yes' if r['identical'] else 'NO'}")
    return 0 if all(r["identical"] for r in rows) else 1
