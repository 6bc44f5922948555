"""`flashtree bench`: decode speed and acceptance per mode on a prompt set; prints a table, writes JSON.

Reports tok/s, ms per target step and the bytes of weights a step reads divided by its time
(achieved GB/s), the number to hold against the device's measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from flashtree.engine.generate import MODES
from flashtree.engine.loader import load_engine

PROMPTS = (
    "def fibonacci(n):",
    "Write a Python function that checks whether a string is a palindrome.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"",
    "Explain what a binary search does, then implement it in Python.",
    "class LRUCache:\n    def __init__(self, capacity: int):",
    "Write a function that returns the prime factors of an integer.",
    "def parse_csv_line(line):",
    "Implement quicksort in Python with a short docstring.",
)

SYNTHETIC = {
    "tiny": dict(),
    "qwen3.5-0.8b": dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_layers=24, num_heads=8,
                         num_kv_heads=2, head_dim=256, rope_dim=64, gdn_head_dim=128, gdn_qk_heads=16,
                         gdn_v_heads=16, context_length=262144),
}


def add_parser(sub) -> None:
    from flashtree.cli.main import add_model_args, add_sampling_args

    p = sub.add_parser("bench", help="benchmark decoding modes (table + JSON)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="random-weight model of this shape instead of --model")
    p.add_argument("--scheme", default="q8_0", help="quant scheme of the synthetic model (default q8_0)")
    p.add_argument("--modes", default=None, help="comma-separated modes (default: ar plus the spec modes a draft allows)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"number of prompts (max {len(PROMPTS)})")
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--out", default="bench.json", help="JSON output path")
    p.add_argument("--multi-turn", action="store_true",
                   help="time to first token per turn of a chat with a long system prompt, prefix cache off vs on")
    p.add_argument("--turns", type=int, default=5, help="--multi-turn: chat turns (default 5)")
    p.add_argument("--system-tokens", type=int, default=8192, help="--multi-turn: system prompt size (default 8192)")
    p.add_argument("--prefix-cache-interval", type=int, default=1024,
                   help="--multi-turn: snapshot interval inside long prompts (default 1024)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from flashtree.cli.main import cache_args, placement_args

    model = _synthetic_model(args) if args.synthetic else args.model
    engine = load_engine(model, args.draft, args.device, spec=args.spec, budget=args.budget, topk=args.topk,
                         **cache_args(args), **placement_args(args))
    if args.multi_turn:
        from flashtree.bench.multi_turn import run_multi_turn

        return run_multi_turn(args, engine, str(model), _device_name(engine))
    modes = args.modes.split(",") if args.modes else ["ar"] + (["chain", "ddtree"] if engine.draft is not None else [])
    prompts = [engine.encode_prompt(p) for p in PROMPTS[: args.prompts]]
    from flashtree.cli.main import sampling_from_args

    sampling = sampling_from_args(args)
    base = engine.config_for(max_new_tokens=args.max_tokens, ignore_eos=True, sampling=sampling)
    engine.generate(prompts[0], replace(base, mode=modes[0], max_new_tokens=8))  # warm-up: allocator, kernels
    rows = [_bench_mode(engine, prompts, replace(base, mode=mode)) for mode in modes if mode in MODES]
    report = {"date": time.strftime("%Y-%m-%d"), "device": _device_name(engine), "model": str(engine.target.path),
              "draft": str(args.draft) if args.draft else None, "weights_bytes_per_step": _weight_bytes(engine),
              "max_tokens": args.max_tokens, "prompts": len(prompts), "sampling": vars(sampling), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2))
    _print_table(report)
    return 0


def _bench_mode(engine, prompts, config) -> dict:
    tokens = steps = committed = 0
    decode_s = 0.0
    for ids in prompts:
        result = engine.generate(ids, config)
        if engine.target.model.device.type == "cuda":
            torch.cuda.synchronize()
        tokens += result.stats.new_tokens
        steps += result.stats.steps
        committed += sum(k * v for k, v in result.stats.accepted.items())
        decode_s += result.stats.decode_s
    return {"mode": config.mode, "budget": config.budget if config.mode != "ar" else None, "new_tokens": tokens,
            "steps": steps, "acceptance_length": round(committed / steps, 3) if steps else 0.0,
            "tokens_per_s": round(tokens / decode_s, 2), "ms_per_step": round(1000 * decode_s / max(steps, 1), 3)}


def _print_table(report: dict) -> None:
    ar = next((r for r in report["rows"] if r["mode"] == "ar"), None)
    gbytes = report["weights_bytes_per_step"] / 1e9
    print(f"device: {report['device']}   model: {report['model']}   {report['prompts']} prompts x {report['max_tokens']} tokens")
    print(f"{'mode':<8}{'budget':>7}{'AL':>7}{'tok/s':>10}{'ms/step':>10}{'GB/s':>9}{'speedup':>9}")
    for r in report["rows"]:
        speedup = r["tokens_per_s"] / ar["tokens_per_s"] if ar else float("nan")
        gbs = gbytes / (r["ms_per_step"] / 1000) if r["ms_per_step"] else 0.0
        print(f"{r['mode']:<8}{str(r['budget'] or '-'):>7}{r['acceptance_length']:>7.2f}{r['tokens_per_s']:>10.1f}"
              f"{r['ms_per_step']:>10.2f}{gbs:>9.1f}{speedup:>8.2f}x")


def _weight_bytes(engine) -> int:
    """Bytes of matrix weights one target step reads (the embedding lookup excluded)."""
    model = engine.target.model
    total = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    for layer in model.layers:
        for obj in (layer.mixer, layer.mlp):
            for value in vars(obj).values():
                weight = getattr(value, "weight", None)
                if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                    total += weight.numel() * weight.element_size()
    return total


def _device_name(engine) -> str:
    dev = engine.target.model.device
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"


def _synthetic_model(args) -> Path:
    from flashtree.models.synthetic import tiny_config, write_synthetic_gguf

    path = Path(tempfile.mkdtemp()) / f"{args.synthetic}.gguf"
    print(f"writing synthetic {args.synthetic} model to {path} ...")
    shape = dict(SYNTHETIC[args.synthetic], name=args.synthetic)
    if getattr(args, "multi_turn", False):  # room for the long system prompt and the turns
        shape["context_length"] = max(shape.get("context_length", 0), 2 * args.system_tokens + 8192)
    return write_synthetic_gguf(path, tiny_config(**shape), scheme=args.scheme)
