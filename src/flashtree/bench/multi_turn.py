"""`flashtree bench --multi-turn`: time to first token per turn of a chat session with a long system
prompt, with and without the prefix cache (docs/PREFIX_CACHE.md).

Both runs use the same weights and the same greedy settings; each turn resends the whole
conversation, as chat clients do. `--sessions N` runs the chat N times per setting, alternating which
setting goes first and emptying the cache before each cached session (so turn 1 is a miss every time),
and reports each turn's median: one session cannot resolve a few percent, whose TTFT without the cache
varied by 1.6x between turns of equal length on the H200 (2026-12-01). One untimed session per setting
runs first, so that no timed turn compiles kernels or captures graphs. TTFT is the time from the request to the logits of the first
token (prefill, including restoring a cached prefix). Per turn the report also gives, for both runs,
the time in the prompt chunks' forwards and their count (the JSON: each cached-run chunk's tokens), and for the
cached run the cache's own
costs: restoring the prefix, taking the snapshots (during prefill and at the end of the turn, where
copies past the device budget also move to host RAM) and the bytes those copies moved. Every timer
waits for the device, so on a GPU the times are device times (the waits add a little to both runs).
"""

from __future__ import annotations

import statistics
import time

from flashtree.bench.report import save_report
from flashtree.bench.steps import clock
from flashtree.engine.generate import Engine
from flashtree.engine.prefix_cache import PrefixCache
from flashtree.engine.runner import ModelRunner
from flashtree.formats.chat_template import template_or_chatml

MIB = 1 << 20
GIB = 1 << 30

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
    """Stands in for `runner.prefill_chunk` (one prompt chunk's forward) and adds up their time and count, and
    keeps each chunk's token count (what decides the step a short chunk replays, `runner.chain_rows`)."""

    def __init__(self, runner: ModelRunner):
        self.inner, self.device = runner.prefill_chunk, runner.target.model.device
        self.reset()
        runner.prefill_chunk = self

    def __call__(self, cache, token_ids, *args, **kwargs):
        start = clock(self.device)
        try:
            return self.inner(cache, token_ids, *args, **kwargs)
        finally:
            self.seconds += clock(self.device) - start
            self.tokens.append(len(token_ids))

    @property
    def chunks(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.seconds, self.tokens = 0.0, []


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
    model_device = engine.target.model.device
    cache = PrefixCache(interval=args.prefix_cache_interval, device_bytes=int(args.prefix_cache_device_gib * GIB),
                        clock=lambda: clock(model_device))
    engines = {"off": Engine(engine.target, engine.draft, base), "on": Engine(engine.target, engine.draft, base,
                                                                             prefix_cache=cache)}
    # warm-up: one whole session per setting, untimed (allocator, kernels and CUDA graphs of every chunk and step
    # shape the sessions meet; the first timed session paid them before: 11.4 s for one turn, 2026-12-01)
    for name in ("off", "on"):
        cache.clear()
        _session(engines[name], template, system, args.turns, base)
    runs: dict[str, list[list[dict]]] = {"off": [], "on": []}
    for session in range(args.sessions):
        for name in ("off", "on") if session % 2 == 0 else ("on", "off"):  # neither always second
            if name == "on":
                cache.clear()  # every cached session starts cold: its turn 1 is a miss
            runs[name].append(_session(engines[name], template, system, args.turns, base))
    rows = [_row(turn, [s[turn - 1] for s in runs["off"]], [s[turn - 1] for s in runs["on"]])
            for turn in range(1, args.turns + 1)]
    report = {"date": time.strftime("%Y-%m-%d"), "device": device, "model": model_name, "mode": mode,
              "sessions": args.sessions, "system_tokens": args.system_tokens, "turns": args.turns,
              "max_tokens": args.max_tokens,
              "prefill_chunk": base.prefill_chunk, "prefix_cache_entries": len(cache.entries),
              "prefix_cache_bytes": cache.nbytes, "prefix_cache_device_bytes": cache.device_nbytes, "rows": rows}
    save_report(report, args.out)
    _print_table(report)
    return 0 if all(r["identical"] for r in rows) else 1


def _session(engine: Engine, template, system: str, turns: int, config) -> list[dict]:
    """One chat of `turns` turns; per turn what it cost and what it produced."""
    forwards = _ForwardTimer(engine.runner)
    messages = [{"role": "system", "content": system}]
    out = []
    try:
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            ids = engine.tokenizer.encode(template.render(messages, add_generation_prompt=True))
            forwards.reset()
            result = engine.generate(ids, config)
            clock(engine.target.model.device)  # the turn's last copies done before the next turn's timers start
            out.append({"prompt_tokens": len(ids), "ttft_s": result.stats.prefill_s, "forwards_s": forwards.seconds,
                        "chunks": forwards.chunks, "chunk_tokens": forwards.tokens, "token_ids": result.token_ids,
                        "cache": engine.prefix_cache.last_request if engine.prefix_cache is not None else None})
            messages.append({"role": "assistant", "content": result.text})
    finally:  # the next session's timer wraps the runner's own method, not this one
        engine.runner.prefill_chunk = forwards.inner
    return out


def _row(turn: int, offs: list[dict], ons: list[dict]) -> dict:
    """One turn over the sessions: medians of the times (and each session's TTFTs), the counts and bytes of
    the first session (the same in every session: greedy, same prompts), identical if every session was."""
    off, on, cache = offs[0], ons[0], ons[0]["cache"]
    ttft_off, ttft_on = _median(offs, "ttft_s"), _median(ons, "ttft_s")
    return {"turn": turn, "prompt_tokens": on["prompt_tokens"], "cached_tokens": cache.restored_tokens,
            "cached_tokens_sessions": [r["cache"].restored_tokens for r in ons],
            "ttft_off_s": round(ttft_off, 4), "ttft_on_s": round(ttft_on, 4),
            "ttft_off_sessions_s": [round(r["ttft_s"], 4) for r in offs],
            "ttft_on_sessions_s": [round(r["ttft_s"], 4) for r in ons],
            "forwards_off_s": round(_median(offs, "forwards_s"), 4), "forwards_on_s": round(_median(ons, "forwards_s"), 4),
            "chunks_off": off["chunks"], "chunks_on": on["chunks"], "chunk_tokens_on": on["chunk_tokens"],
            "restore_s": round(statistics.median(r["cache"].restore_s for r in ons), 4),
            "snapshot_s": round(statistics.median(r["cache"].snapshot_s for r in ons), 4),
            "snapshots": cache.snapshots, "restored_bytes": cache.restored_bytes,
            "snapshot_bytes": cache.snapshot_bytes, "spilled_bytes": cache.spilled_bytes,
            "copied_bytes": cache.copied_bytes,
            "speedup": round(ttft_off / ttft_on, 2) if ttft_on else None,
            "identical": all(a["token_ids"] == b["token_ids"] for a in offs for b in ons)}


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _print_table(report: dict) -> None:
    print(f"device: {report['device']}   model: {report['model']}   mode: {report['mode']}   system prompt "
          f"~{report['system_tokens']} tokens, {report['max_tokens']} new tokens per turn, prefill chunk "
          f"{report['prefill_chunk']}, {report['sessions']} session(s) per setting")
    print("TTFT and forwards in s, off / on (medians over the sessions); restore and snapshot (during prefill and "
          "at the turn's end) in s; copied: MiB restored + snapshotted + spilled to host")
    print(f"{'turn':>4}{'prompt':>8}{'cached':>8}{'TTFT off':>10}{'TTFT on':>9}{'fwd off':>9}{'fwd on':>8}"
          f"{'chunks':>8}{'restore':>9}{'snapshot':>10}{'copied':>9}{'speedup':>9}  identical")
    for r in report["rows"]:
        print(f"{r['turn']:>4}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}{r['ttft_off_s']:>10.3f}"
              f"{r['ttft_on_s']:>9.3f}{r['forwards_off_s']:>9.3f}{r['forwards_on_s']:>8.3f}"
              f"{r['chunks_off']:>4}/{r['chunks_on']:<3}{r['restore_s']:>9.4f}{r['snapshot_s']:>10.4f}"
              f"{r['copied_bytes'] / MIB:>9.1f}{(r['speedup'] or 0):>8.1f}x  {'yes' if r['identical'] else 'NO'}")
    print(f"prefix cache at the end: {report['prefix_cache_entries']} entries, "
          f"{report['prefix_cache_bytes'] / MIB:.1f} MiB, of which {report['prefix_cache_device_bytes'] / MIB:.1f} "
          "MiB in device memory")
