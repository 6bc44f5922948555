"""Runs the rms_norm interpreter cases in one process (TRITON_INTERPRET=1 must be set before triton is
imported, so test_rms_norm.py launches this file as a subprocess). Prints one JSON object: case id ->
max |kernel - reference| in units of the output dtype's spacing at the reference value."""

import json
import os
import sys

import torch

from flashtree.kernels.rms_norm import gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPES = {"rows": (5, 5120), "heads": (3, 4, 256), "one": (1, 96)}


def case_ids() -> list[str]:
    return ([f"{shape}-{d}" for shape in SHAPES for d in DTYPES] + [f"strided-{d}" for d in DTYPES]
            + [f"gated-{d}" for d in DTYPES] + [f"gated_strided-{d}" for d in DTYPES])


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    spacing = torch.nextafter(ref.abs(), torch.tensor(float("inf"), dtype=ref.dtype)) - ref.abs()
    return ((out.float() - ref.float()).abs() / spacing.float()).max().item()


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    gen = torch.Generator().manual_seed(0)
    result = {}
    for shape_name, shape in SHAPES.items():
        x = torch.randn(*shape, generator=gen) * 3
        w = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
        for name, dtype in DTYPES.items():
            xd = x.to(dtype)
            result[f"{shape_name}-{name}"] = ulps(rms_norm(xd, w, 1e-6), rms_norm_reference(xd, w, 1e-6))
    # the attention's per-head q slice: rows strided by twice the head size
    qg = torch.randn(6, 4, 2, 64, generator=gen)
    w = 1 + 0.1 * torch.randn(64, generator=gen)
    for name, dtype in DTYPES.items():
        q = qg.to(dtype)[:, :, 0]
        result[f"strided-{name}"] = ulps(rms_norm(q, w, 1e-6), rms_norm_reference(q, w, 1e-6))
    # the DeltaNet output: float32 rows, a gate in the activation dtype, the output in it too
    o = torch.randn(5, 6, 32, generator=gen)
    w = 1 + 0.1 * torch.randn(32, generator=gen)
    for name, dtype in DTYPES.items():
        z = torch.randn(5, 6, 32, generator=gen).to(dtype)
        result[f"gated-{name}"] = ulps(gated_rms_norm(o, w, 1e-6, z, dtype), gated_rms_norm_reference(o, w, 1e-6, z, dtype))
        # z as the model passes it: a slice of the fused input projection's rows, [T, heads, D] strided, read in place
        rows = torch.randn(5, 7 * 32 + 6 * 32, generator=gen).to(dtype)
        z = rows[:, 7 * 32:].reshape(5, 6, 32)
        result[f"gated_strided-{name}"] = ulps(gated_rms_norm(o, w, 1e-6, z, dtype),
                                               gated_rms_norm_reference(o, w, 1e-6, z, dtype))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
