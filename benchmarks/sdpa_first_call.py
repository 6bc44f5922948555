#!/usr/bin/env python3
"""What the 27B target's first square causal prefill attention costs through each SDPA backend, each in a
fresh process (issue #17's cold start: the 2026-12-02 cold-start profile gave PyTorch's SDPA 1.2 s of the
first token, the chunk whose queries are all its keys, which `CausalBias` sends to the dispatcher, and the
dispatcher to cuDNN), and what each costs after it (a CUDA graph, K/V rotated past the L2).

    python3 benchmarks/sdpa_first_call.py [--out sdpa_first_call.json]

24 query heads of 256 over 4 KV heads (grouped, `enable_gqa`), bf16. Each backend's first call and its first
call at a second length are timed with the device synchronised; the error is against the math backend in
float32 (max |error| / max |reference|). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256
BACKENDS = ("default", "cudnn", "flash")


def child(backend: str, lengths: list[int]) -> dict:
    """One backend's figures in this (fresh) process."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtree.bench.kernels import rotation, time_graph

    chosen = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION]}.get(backend)
    scale = HEAD_DIM**-0.5

    def attend(q, k, v):
        if chosen is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def operands(t):
        return (torch.randn(1, HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                torch.randn(1, KV_HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                torch.randn(1, KV_HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16))

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    result = {"backend": backend, "first_call_s": [], "us": {}, "max_rel_error": {}}
    for t in lengths:  # the first call at each length: one-time initialisation, then any per-shape plan
        q, k, v = operands(t)
        torch.cuda.synchronize()
        started = time.perf_counter()
        attend(q, k, v)
        torch.cuda.synchronize()
        result["first_call_s"].append(round(time.perf_counter() - started, 4))
    for t in lengths:
        q, k, v = operands(t)
        with sdpa_kernel([SDPBackend.MATH]):
            reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale,
                                                       enable_gqa=True)
        result["max_rel_error"][t] = float((attend(q, k, v).float() - reference).abs().max()
                                           / reference.abs().max())
        copies = [operands(t) for _ in range(rotation(3 * q.numel() * 2))]
        result["us"][t] = round(time_graph([lambda c=c: attend(*c) for c in copies]) * 1e6, 1)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sdpa_first_call.json")
    parser.add_argument("--lengths", default="512,1024,2048")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(t) for t in args.lengths.split(",")]
    if args.child:
        print(json.dumps(child(args.child, lengths)))
        return 0
    rows = []
    print(f"{'backend':>8} {'first call s':>13} {'next length s':>14} " + " ".join(f"{f'T={t} us':>11}" for t in lengths)
          + "   max rel error")
    for backend in BACKENDS:
        done = subprocess.run([sys.executable, __file__, "--child", backend, "--lengths", args.lengths],
                              capture_output=True, text=True)
        if done.returncode:
            print(f"{backend:>8} failed: {done.stderr.strip().splitlines()[-1:]}")
            rows.append({"backend": backend, "error": done.stderr[-2000:]})
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        first = row["first_call_s"]
        print(f"{backend:>8} {first[0]:>13.3f} {max(first[1:], default=0):>14.3f} "
              + " ".join(f"{row['us'][str(t)]:>11.1f}" for t in lengths)
              + "   " + ", ".join(f"{e:.0e}" for e in row["max_rel_error"].values()))
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
