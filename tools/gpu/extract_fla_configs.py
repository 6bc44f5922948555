#!/usr/bin/env python3
"""Tune fla-core's chunked gated-delta kernels at the Qwen3.6-27B prefill shapes on this GPU and write the
chosen launch configurations in fla's file format, for shipping under src/flashtree/assets/fla-configs/:

    python3 tools/gpu/extract_fla_configs.py --out $OUT/fla-configs     (about a minute on a fresh H200)

It prefills the random 27B echo model (the same shapes and types as a real Q4_K_M file) at the default
512-token chunks and at 2048-token chunks, with prompts whose last chunks have other lengths, so fla tunes
every key a prefill meets; fla's own config lookup is off for the run, so it tunes rather than reads.
Then copy `<out>/<GPU>/` to src/flashtree/assets/fla-configs/<GPU>/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["FLA_CACHE_MODE"] = "disabled"  # before anything imports fla: tune, do not read
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from flashtree.engine.config import GenerationConfig  # noqa: E402
from flashtree.engine.generate import Engine  # noqa: E402
from flashtree.engine.loader import random_target  # noqa: E402
from flashtree.kernels import fla_configs  # noqa: E402

PROMPT_LENGTHS = (1024, 2048 + 700, 4096 + 77)  # whole chunks, and last chunks of other lengths
CHUNKS = (512, 2048)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    engine = Engine(random_target("qwen3.6-27b", scheme="q4_k_m", device="cuda", echo=True))
    vocab = engine.target.config.vocab_size
    for length in PROMPT_LENGTHS:
        ids = torch.randint(0, vocab - 1, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        for chunk in CHUNKS:
            cache = engine.runner.new_cache(length, GenerationConfig(max_new_tokens=8))
            engine.runner.prefill(cache, ids, chunk)
            torch.cuda.synchronize()
            print(f"prefilled {length} tokens in chunks of {chunk} ({time.perf_counter() - started:.0f} s)", flush=True)
    directory = args.out / fla_configs.gpu_directory_name(torch.cuda.get_device_name())
    written = fla_configs.write_tuned(directory)
    print(f"wrote {len(written)} kernel files to {directory}: {', '.join(p.stem for p in written)}")
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
