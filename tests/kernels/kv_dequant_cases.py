"""Runs the kv_dequant interpreter cases in one process (TRITON_INTERPRET=1 must be set before triton is
imported, so test_kv_dequant.py launches this file as a subprocess). Prints one JSON object: case id ->
max |kernel - reference| in units of the output dtype's spacing at the reference value (the reference:
`KVType.dequantize`)."""

import json
import os
import sys

import torch

from flashtree.kernels.kv_dequant import dequantize_kv
from flashtree.kernels.kv_quant import kv_type

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD_DIMS = {"q8_0": (32, 64, 256), "q4_0": (64, 256), "tq3_0": (128, 256)}
HEADS, CAPACITY, LO, HI = 3, 80, 5, 75  # a window of the cache: strided rows, a partial last program


def case_ids() -> list[str]:
    return [f"{name}-d{d}-{dtype}" for name, dims in HEAD_DIMS.items() for d in dims for dtype in DTYPES]


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    errors = {}
    for case in case_ids():
        name, d, dtype = case.split("-")
        t, dtype = kv_type(name), DTYPES[dtype]
        gen = torch.Generator().manual_seed(len(errors))
        cache = t.quantize(3 * torch.randn(HEADS, CAPACITY, int(d[1:]), generator=gen))
        rows = cache[:, LO:HI]
        out, ref = dequantize_kv(rows, t, dtype), t.dequantize(rows, dtype)
        assert out.shape == ref.shape and out.dtype == ref.dtype, case
        spacing = torch.nextafter(ref.abs(), torch.tensor(float("inf"), dtype=dtype)) - ref.abs()
        errors[case] = ((out.float() - ref.float()).abs() / spacing.float()).max().item()
    json.dump(errors, sys.stdout)


if __name__ == "__main__":
    main()
