"""Runs the kv_write interpreter cases in one process (TRITON_INTERPRET=1 must be set before triton is
imported, so test_kv_write.py launches this file as a subprocess). Prints one JSON object: case id ->
{"bytes": cache bytes that differ from the torch form's, "codes": TQ3_0 values whose 3-bit index differs,
"far_codes": those of them that are not a neighbour (the next level, same sign, or the other sign at the
lowest level: a rotated value on a threshold or at zero), "values": values in all, "max_error": max
|dequantized kernel - dequantized torch| / max |x|}; the "kv-" cases: `kv_case`."""

import json
import os
import sys

import torch

from flashtree.kernels.kv_quant import kv_type
from flashtree.kernels.kv_write import write_kv, write_rows
from flashtree.kernels.qk_norm_rope import qk_norm_rope, rope_tables_reference

HEAD_DIMS = {"q8_0": (32, 256), "q4_0": (64, 256), "tq3_0": (128, 256)}
TOKENS, HEADS, CAPACITY = 5, 3, 40


PAIRS = (("q8_0", "tq3_0"), ("tq3_0", "q4_0"), ("q4_0", "q8_0"))  # write_kv's (K, V) types, head_dim 256


def case_ids() -> list[str]:
    return [f"{name}-d{d}-{kind}" for name, dims in HEAD_DIMS.items() for d in dims
            for kind in ("random", "edges")] + [f"kv-{k}-{v}" for k, v in PAIRS]


def rows(kind: str, d: int, seed: int) -> torch.Tensor:
    """[TOKENS, HEADS, d] bf16 rows; "edges": an all-zero row, a -0.0 row, ties of magnitude (whose rotation
    cancels to about zero), a large and a tiny (fp16-subnormal scale) row, one value alone in its block."""
    gen = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(TOKENS, HEADS, d, generator=gen)
    if kind == "edges":
        x[0, 0] = 0.0
        x[0, 1] = -0.0
        x[1, 0] = torch.where(torch.arange(d) % 2 == 0, 2.0, -2.0)  # every block: +-2 ties, the first wins
        x[1, 1] *= 100  # TQ3_0's fp16 norm holds up to 65504 (torch's form overflows past it too)
        x[1, 2] *= 1e-6
        x[2, 0] = 0.0
        x[2, 0, 3] = -5.0
    return x.to(torch.bfloat16)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    for seed, case in enumerate(case_ids()):
        if case.startswith("kv-"):
            results[case] = kv_case(*case.split("-")[1:], seed)
            continue
        name, d, kind = case.split("-")
        t, x = kv_type(name), rows(kind, int(d[1:]), seed)
        slots = torch.tensor([7, 3, 30, 12, 0])  # out of order, not contiguous
        got = t.allocate(HEADS, CAPACITY, x.shape[-1], "cpu")
        want = got.clone()
        write_rows(x, got, slots, t)
        want.index_copy_(1, slots, t.quantize(x.transpose(0, 1)))
        scale = x.float().abs().max().item()
        error = (t.dequantize(got) - t.dequantize(want)).abs().max().item() / scale
        codes = far = 0
        if name == "tq3_0":
            a, b = t.indices(got), t.indices(want)
            differ = a != b
            neighbour = ((a >> 2) == (b >> 2)) & (((a & 3) - (b & 3)).abs() == 1) | (((a & 3) == 0) & ((b & 3) == 0))
            codes, far = int(differ.sum()), int((differ & ~neighbour).sum())
        results[case] = {"bytes": int((got != want).sum()), "codes": codes, "far_codes": far, "values": x.numel(),
                         "max_error": error}
    json.dump(results, sys.stdout)


def kv_case(name_k: str, name_v: str, seed: int) -> dict:
    """write_kv of raw keys (strided rows of a projection, normed and roped in the launch) and values, against
    the two-call path (`qk_norm_rope`, then `write_rows` per cache; each checked against its torch form by
    its own tests): {"bytes": cache bytes that differ}."""
    tk, tv = kv_type(name_k), kv_type(name_v)
    d, gen = 256, torch.Generator().manual_seed(seed)
    projection = (3 * torch.randn(TOKENS, HEADS, 2, d, generator=gen)).to(torch.bfloat16)
    k, v = projection[:, :, 0], projection[:, :, 1]
    weight = 1 + 0.1 * torch.randn(d, generator=gen)
    cos, sin = rope_tables_reference(torch.tensor([3, 9, 40, 41, 42]), 64, 1e7)
    slots = torch.tensor([7, 3, 30, 12, 0])
    caches = [t.allocate(HEADS, CAPACITY, d, "cpu") for t in (tk, tv, tk, tv)]
    write_kv(k, v, caches[0], caches[1], slots, tk, tv, k_norm=(weight, 1e-6, cos, sin))
    write_rows(qk_norm_rope(k, weight, 1e-6, cos, sin), caches[2], slots, tk)
    write_rows(v, caches[3], slots, tv)
    return {"bytes": int((caches[0] != caches[2]).sum() + (caches[1] != caches[3]).sum())}


if __name__ == "__main__":
    main()
