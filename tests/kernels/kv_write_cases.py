"""Runs the kv_write interpreter cases in one process (TRITON_INTERPRET=1 must be set before triton is
imported, so test_kv_write.py launches this file as a subprocess). Prints one JSON object: case id ->
{"bytes": cache bytes that differ from the torch form's, "codes": TQ3_0 values whose 3-bit index differs,
"far_codes": those of them that are not a neighbour (the next level, same sign, or the other sign at the
lowest level: a rotated value on a threshold or at zero), "values": values in all, "max_error": max
|dequantized kernel - dequantized torch| / max |x|}."""

import json
import os
import sys

import torch

from flashtree.kernels.kv_quant import kv_type
from flashtree.kernels.kv_write import write_rows

HEAD_DIMS = {"q8_0": (32, 256), "q4_0": (64, 256), "tq3_0": (128, 256)}
TOKENS, HEADS, CAPACITY = 5, 3, 40


def case_ids() -> list[str]:
    return [f"{name}-d{d}-{kind}" for name, dims in HEAD_DIMS.items() for d in dims
            for kind in ("random", "edges")]


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


if __name__ == "__main__":
    main()
