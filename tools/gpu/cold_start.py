#!/usr/bin/env python3
"""Time to first token at the Qwen3.6-27B shape after the weights are in memory (issue #17's cold start):

    rm -rf ~/.triton/cache && python3 tools/gpu/cold_start.py     # a fresh machine: every kernel compiles
    python3 tools/gpu/cold_start.py                                # the second start: Triton's disk cache

It builds the random 27B echo model in device memory (the weights' load is not timed: a file's read depends
on the disk), then times what a user waits for after it: the load-time compiles (`engine_from_target`: the
tensor-core instances, in parallel processes) and one generation of one token over a 1024-token prompt
(prefill, with fla's chunked kernels reading the shipped launch configurations, and the first sample).
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def main() -> int:
    # imported here, as the `flashtree` command defers them: the load-time compile's spawned processes import
    # this file again, and must start without torch
    import torch

    from flashtree.engine.config import GenerationConfig
    from flashtree.engine.loader import EngineArgs, engine_from_target, random_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--shape", default="qwen3.6-27b", help="a random-weight shape (tiny: a CPU smoke check)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write the first token's Python profile here (cProfile; where a cold start's time goes)")
    args = parser.parse_args()
    target = random_target(args.shape, scheme="q4_k_m", device=args.device, echo=True)
    sync = torch.cuda.synchronize if target.model.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    engine = engine_from_target(target, EngineArgs(device=args.device, progress=True))
    ready = time.perf_counter()
    ids = torch.randint(0, target.config.vocab_size - 1, (args.prompt_tokens,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    profile = cProfile.Profile() if args.profile else None
    if profile:
        profile.enable()
    engine.generate(ids, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    sync()
    done = time.perf_counter()
    if profile:
        profile.disable()
        profile.dump_stats(args.profile)
    print(f"load-time compiles {ready - started:.1f} s, first token of a {args.prompt_tokens}-token prompt "
          f"{done - ready:.1f} s: {done - started:.1f} s after the weights are in memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
