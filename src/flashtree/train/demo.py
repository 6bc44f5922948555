"""Train the embedded demo pair (target GGUF + DFlash draft) in one run under a wall-clock deadline.

    python -m flashtree.train.demo --out DIR --device cuda --deadline 480

writes DIR/target.gguf, DIR/draft/{config.json,model.safetensors} and DIR/demo-train.json.
`--quick` shrinks everything to a tiny model for a CPU smoke test.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

from flashtree.cli.args import int_range
from flashtree.train.corpus import build_corpus
from flashtree.train.draft import DraftTrainConfig, train_draft
from flashtree.train.target import TINY_SHAPE, TargetShape, TrainConfig, train_target


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashtree.train.demo")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--deadline", type=float, default=480, help="seconds for the whole run")
    p.add_argument("--target-budget", type=float, default=210, help="seconds of target training")
    p.add_argument("--max-chars", type=int_range(1), default=48_000_000)
    p.add_argument("--prompts", type=int_range(1), default=8192)
    p.add_argument("--max-new-tokens", type=int_range(1), default=160)
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    args = p.parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.deadline
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    if args.quick:
        shape, train = TINY_SHAPE, TrainConfig(steps=6, batch_size=4, seq_len=64, log_every=2)
        dcfg = DraftTrainConfig(num_layers=1, head_dim=16, num_prompts=8, max_new_tokens=24, gen_batch_size=4,
                                steps=10, batch_size=2, anchors=4, log_every=5)
        max_chars = 300_000
    else:
        shape = TargetShape()
        train = TrainConfig(steps=1_000_000, time_budget_s=args.target_budget, batch_size=32, seq_len=512, lr=2e-3,
                            log_every=50)
        # 2026-11-29 run 1 used 1536 prompts (157K response tokens) with engine features: the draft
        # memorised them (train chain acceptance 14, fresh prompts ~1.1). More prompts, batched features.
        dcfg = DraftTrainConfig(num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, gen_batch_size=512,
                                feature_source="hf", feature_batch_size=64, steps=1_000_000, time_budget_s=None,
                                batch_size=16, anchors=32, lr=1e-3, log_every=100)
        max_chars = args.max_chars

    corpus = build_corpus(max_chars=max_chars, seed=0)
    result = train_target(out, shape, train, args.device, corpus=corpus, log=log)
    target_path = result["path"]
    target_summary = result["summary"]
    del result
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    # Prompts for the draft: the last instruction pairs (a different slice from the start of the list).
    prompts = [pair.prompt for pair in corpus.pairs[::-1][: dcfg.num_prompts * 2]]
    draft = train_draft(target_path, out / "draft", dcfg, args.device, prompts=prompts, log=log,
                        deadline=deadline - 20)
    summary = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "host": platform.node(),
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
               "torch": torch.__version__, "seconds": round(time.perf_counter() - start, 1),
               "target": target_summary, "draft": draft["summary"]}
    (out / "demo-train.json").write_text(json.dumps(summary, indent=2))
    log(f"done in {summary['seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
