"""Runs the interpreter cases of the small fused kernels (the RoPE tables, attention q/k norm + RoPE and the K/V
cache write, the output gate, SiLU-and-multiply, residual add + RMSNorm) in one process: TRITON_INTERPRET=1 must be set
before triton is imported, so test_fusion.py launches this file as a subprocess. Prints one JSON object:
case id -> max |kernel - reference| / max |reference| over the outputs."""

import json
import os
import sys

import torch

from flashtree.kernels.activations import (gated_heads, gated_heads_reference, glu_halves, interleaved_silu_mul,
                                          silu_mul, silu_mul_reference)
from flashtree.kernels.qk_norm_rope import (norm_rope_into_cache, qk_norm_rope, qk_norm_rope_reference, rope_tables,
                                            rope_tables_reference)
from flashtree.kernels.kv_quant import rotate
from flashtree.kernels.rms_norm import add_rms_norm, add_rms_norm_reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def case_ids() -> list[str]:
    return [f"{kernel}-{d}" for kernel in ("rope_tables", "qk_norm_rope", "qk_norm_rope_rotated", "norm_rope_into_cache",
                                           "gated_heads", "silu_mul", "interleaved_silu_mul", "add_rms_norm")
            for d in DTYPES]


def error(got, want) -> float:
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(got, want))


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    gen = torch.Generator().manual_seed(0)
    result = {}
    for name, dtype in DTYPES.items():
        qg = torch.randn(5, 4, 2, 64, generator=gen).to(dtype) * 3  # [T, heads, (query ; gate), head_dim]
        q, w = qg[:, :, 0], 1 + 0.1 * torch.randn(64, generator=gen)
        positions = torch.tensor([0, 1, 7, 300, 4096, 262143])
        result[f"rope_tables-{name}"] = error(rope_tables(positions, 32, 1e7), rope_tables_reference(positions, 32, 1e7))
        cos, sin = rope_tables(torch.tensor([0, 1, 7, 300, 4096]), 32, 1e7)
        result[f"qk_norm_rope-{name}"] = error(qk_norm_rope(q, w, 1e-6, cos, sin),
                                               qk_norm_rope_reference(q, w, 1e-6, cos, sin))
        # a query for TQ3_0 keys (head_dim 256: two 128-value groups), rotated in the same launch
        q256, w256 = (torch.randn(5, 4, 256, generator=gen) * 3).to(dtype), 1 + 0.1 * torch.randn(256, generator=gen)
        result[f"qk_norm_rope_rotated-{name}"] = error(qk_norm_rope(q256, w256, 1e-6, cos, sin, rotated=True),
                                                       rotate(qk_norm_rope_reference(q256, w256, 1e-6, cos, sin)))

        # K and V of 5 tokens into rows 9, 2, 7, 3, 11 of the caches (bf16 activations: float16 caches, -ctk f16)
        kv = torch.randn(5, 2, 2, 64, generator=gen).to(dtype) * 3  # [T, (k ; v), kv heads, head_dim]
        slots = torch.tensor([9, 2, 7, 3, 11])
        cache_dtype = torch.float32 if dtype == torch.float32 else torch.float16
        caches = [torch.zeros(2, 12, 64, dtype=cache_dtype) for _ in range(2)]
        norm_rope_into_cache(kv[:, 0], kv[:, 1], w, 1e-6, cos, sin, caches[0], caches[1], slots)
        want = [torch.zeros(2, 12, 64, dtype=cache_dtype) for _ in range(2)]
        want[0].index_copy_(1, slots, qk_norm_rope_reference(kv[:, 0], w, 1e-6, cos, sin).transpose(0, 1).to(cache_dtype))
        want[1].index_copy_(1, slots, kv[:, 1].transpose(0, 1).to(cache_dtype))
        result[f"norm_rope_into_cache-{name}"] = error(tuple(c[:, slots] for c in caches),
                                                       tuple(c[:, slots] for c in want))

        out = torch.randn(4, 5, 64, generator=gen).to(dtype)  # attention output [heads, T, head_dim]
        gate = qg[:, :, 1]  # read in place from the interleaved rows
        result[f"gated_heads-{name}"] = error(gated_heads(out, gate), gated_heads_reference(out, gate))

        gate_up = (torch.randn(3, 2 * 96, generator=gen) * 4).to(dtype)
        result[f"silu_mul-{name}"] = error(silu_mul(gate_up[:, :96], gate_up[:, 96:]),
                                           silu_mul_reference(gate_up[:, :96], gate_up[:, 96:]))
        # a fused gate + up weight's interleaved outputs (8 gate values, then their 8 up values, in turn)
        result[f"interleaved_silu_mul-{name}"] = error(interleaved_silu_mul(gate_up),
                                                       silu_mul_reference(*glu_halves(gate_up)))

        h, delta = (torch.randn(3, 320, generator=gen) * 4).to(dtype), torch.randn(3, 320, generator=gen).to(dtype)
        w = 1 + 0.1 * torch.randn(320, generator=gen)
        result[f"add_rms_norm-{name}"] = error(add_rms_norm(h, delta, w, 1e-6), add_rms_norm_reference(h, delta, w, 1e-6))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
