#!/usr/bin/env python3
"""The DFlash draft's block attention at the 27B draft's shape (40 query heads of 128 folded onto 10 KV
heads: 64 queries per KV head, over a bucket of context rows plus the 16-row block, an additive mask) on the
GPU, through each SDPA backend PyTorch offers for it and as two plain matmuls around a softmax.

    python3 benchmarks/sweep_draft_attention.py [--out draft_attention.json]

The 2026-12-01 H200 profile of one draft step gave the cuDNN kernel 38 us a layer (0.19 of 1.69 ms). Each
point runs under a CUDA graph with K/V rotated past the L2 (`flashtree bench --kernels` timing) and is
checked against the math backend in float32 (max |error| / max |reference|). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashtree.bench.kernels import rotation, time_graph  # noqa: E402

KV_HEADS, QUERIES, HEAD_DIM, BLOCK = 10, 64, 128, 16


def plain(q, k, v, mask, scale):
    """softmax(q k^T * scale + mask) v as two batched matmuls (float32 scores)."""
    scores = torch.baddbmm(mask.float()[None].expand(q.shape[1], -1, -1), q[0].float(), k[0].float().transpose(1, 2),
                           alpha=scale)
    return torch.bmm(scores.softmax(-1).to(v.dtype), v[0])[None]


def variants():
    def backend(b):
        def run(q, k, v, mask, scale):
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return run

    def default(q, k, v, mask, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    return {"sdpa default": default, "sdpa cudnn": backend(SDPBackend.CUDNN_ATTENTION),
            "sdpa efficient": backend(SDPBackend.EFFICIENT_ATTENTION), "sdpa math": backend(SDPBackend.MATH),
            "two matmuls": plain}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="draft_attention.json")
    parser.add_argument("--contexts", default="256,1024,4096")
    args = parser.parse_args()
    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5
    results = []
    print(f"{'context':>8} " + " ".join(f"{name:>15}" for name in variants()) + "   (us; max rel error)")
    for context in (int(c) for c in args.contexts.split(",")):
        keys = context + BLOCK
        q = torch.randn(1, KV_HEADS, QUERIES, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        kv_bytes = 2 * KV_HEADS * keys * HEAD_DIM * 2
        kvs = [(torch.randn(1, KV_HEADS, keys, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                torch.randn(1, KV_HEADS, keys, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
               for _ in range(rotation(kv_bytes))]
        mask = torch.zeros(QUERIES, -(-keys // 16) * 16, device="cuda", dtype=torch.bfloat16)[:, :keys]
        mask[:, context - 7 : context] = float("-inf")  # unfilled slots of the bucket
        with sdpa_kernel(SDPBackend.MATH):
            reference = F.scaled_dot_product_attention(q.float(), kvs[0][0].float(), kvs[0][1].float(),
                                                       attn_mask=mask.float(), scale=scale)
        cells = []
        for name, fn in variants().items():
            try:
                error = float((fn(q, *kvs[0], mask, scale).float() - reference).abs().max() / reference.abs().max())
                us = time_graph([lambda k=k, v=v: fn(q, k, v, mask, scale) for k, v in kvs]) * 1e6
            except RuntimeError as exc:
                cells.append(f"{'n/a':>15}")
                results.append({"context": context, "variant": name, "error": str(exc).splitlines()[0]})
                continue
            cells.append(f"{us:8.1f}; {error:.0e}")
            results.append({"context": context, "variant": name, "us": round(us, 2), "max_rel_error": error})
        print(f"{context:>8} " + " ".join(cells), flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
