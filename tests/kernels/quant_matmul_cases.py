"""Runs every quant_matmul interpreter case in one process (TRITON_INTERPRET=1 must be set before
triton is imported, so test_quant_matmul.py launches this file as a subprocess). Prints one JSON
object: case id -> measurement (see `case_ids` for what each kind of id measures)."""

import json
import os
import sys

import numpy as np
import torch

from gguf import GGMLQuantizationType as QType

from flashtree.formats import quants
from flashtree.kernels.quant_matmul import KERNELS, QuantWeight, quant_matmul, quant_matmul_reference

N = 48
K = {QType.Q8_0: 128}  # others: 512 (two super-blocks)
M_VALUES = (1, 7, 16, 23, 64, 65)  # <= 64: the v2 tiled skinny path by default; 65: the prefill path
# bfloat16: the interpreter's bf16 tl.dot is broken, so choose_config gives bf16 x a float32 dot
# there (the bf16 tensor-core path runs in the GPU test); float16 x takes the x-dtype tensor-core dot
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ROUNDED_DTYPES = ("float16",)  # also compared with weights first rounded to x's dtype
DENSE_M = 512  # _launch.DENSE_MIN_M: bf16/f16 prefill chunks dequantize the weight (v1 kernel, "store")
DENSE_DTYPES = ("float16", "bfloat16")


def case_ids() -> list[str]:
    """{type}-m{M}-{dtype}: max |kernel - float32 reference| / max |reference|, default config;
    ...-rounded-ulps: max |kernel - reference from weights rounded to x's dtype| in units of the
    output dtype's spacing (<= 1: only the final rounding differs);
    ...-{v1,v2}-...: explicit LaunchConfigs (v1: the chunked kernel; split: split-K > 1);
    {type}-deterministic: 1.0 when two split-K calls give bit-identical results;
    {type}-m512-{dtype}: the dense prefill path (dequantize_dense + torch matmul); with one-hot x
    (-onehot-rounded-ulps) the output is the dequantized weights themselves, in ulps of x's dtype."""
    ids = []
    for t in KERNELS:
        ids += [f"{t.name}-m{m}-{d}" for m in M_VALUES for d in DTYPES]
        ids += [f"{t.name}-m{m}-{d}-rounded-ulps" for m in M_VALUES if 1 < m <= 64 for d in ROUNDED_DTYPES]
        ids += [f"{t.name}-m5-float32-v1-nosplit", f"{t.name}-m5-float32-v1-fma-split",
                f"{t.name}-m16-float32-v1-tf32x3-split", f"{t.name}-m23-float16-v2-split",
                f"{t.name}-m23-float16-v2-split-rounded-ulps", f"{t.name}-m3-float32-v2-split-bn32",
                f"{t.name}-deterministic"]
        ids += [f"{t.name}-m{DENSE_M}-{d}" for d in DENSE_DTYPES]
        ids += [f"{t.name}-m{DENSE_M}-{d}-onehot-rounded-ulps" for d in DENSE_DTYPES]
    return ids


def weight(qtype: QType) -> QuantWeight:
    k = K.get(qtype, 512)
    values = np.random.default_rng(int(qtype)).standard_normal((N, k)).astype(np.float32)
    return QuantWeight.from_gguf_bytes(torch.from_numpy(quants.quantize(values, qtype)), qtype, (N, k))


def relative_error(x: torch.Tensor, w: QuantWeight, config=None) -> float:
    y, ref = quant_matmul(x, w, config), quant_matmul_reference(x, w).float()
    assert y.shape == ref.shape and y.dtype == x.dtype
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def rounded_weight_ulps(x: torch.Tensor, w: QuantWeight, config=None) -> float:
    """Max |kernel - (x @ round(W)^T rounded to x's dtype)| over the local output spacing (floored at
    2**-16 max |reference|, as outputs near 0 have spacings below float32 accumulation noise)."""
    rounded = w.dequantize().to(x.dtype).float()
    ref = (x.float() @ rounded.T).to(x.dtype)
    y = quant_matmul(x, w, config)
    spacing = torch.maximum(torch.nextafter(ref.abs(), torch.tensor(float("inf"), dtype=x.dtype)) - ref.abs(),
                            torch.nextafter(y.abs(), torch.tensor(float("inf"), dtype=x.dtype)) - y.abs())
    floor = ref.float().abs().max() * 2.0 ** -16
    return ((y.float() - ref.float()).abs() / spacing.float().clamp(min=floor)).max().item()


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from flashtree.kernels.quant_matmul._launch import LaunchConfig  # imports triton

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    errors = {}
    for qtype in KERNELS:
        w = weight(qtype)
        k = w.shape[1]
        tile = KERNELS[qtype].load().TILE_VALUES
        for m in M_VALUES:
            x = torch.randn(m, k, generator=gen)
            for name, dtype in DTYPES.items():
                errors[f"{qtype.name}-m{m}-{name}"] = relative_error(x.to(dtype), w)
                if name in ROUNDED_DTYPES and 1 < m <= 64:  # M = 1 (v1 fma) keeps float32 weights
                    errors[f"{qtype.name}-m{m}-{name}-rounded-ulps"] = rounded_weight_ulps(x.to(dtype), w)
        x5 = torch.randn(5, k, generator=gen)
        errors[f"{qtype.name}-m5-float32-v1-nosplit"] = relative_error(
            x5, w, LaunchConfig(block_m=8, block_n=32, split_k=1, num_warps=4))
        errors[f"{qtype.name}-m5-float32-v1-fma-split"] = relative_error(
            x5, w, LaunchConfig(block_m=8, block_n=32, split_k=2, num_warps=4, dot="fma"))
        errors[f"{qtype.name}-m16-float32-v1-tf32x3-split"] = relative_error(
            torch.randn(16, k, generator=gen), w, LaunchConfig(block_m=16, block_n=64, split_k=2, num_warps=4,
                                                               dot="tf32x3"))
        # v2 with split-K = 4 and the smallest BLOCK_K (several steps per split for 512-value rows)
        split = LaunchConfig(block_m=32, block_n=64, split_k=4 if k // tile >= 4 else 2, num_warps=4,
                             dot="x_dtype", block_k=tile, num_stages=2)
        x23 = torch.randn(23, k, generator=gen).half()
        errors[f"{qtype.name}-m23-float16-v2-split"] = relative_error(x23, w, split)
        errors[f"{qtype.name}-m23-float16-v2-split-rounded-ulps"] = rounded_weight_ulps(x23, w, split)
        bn32 = LaunchConfig(block_m=16, block_n=32, split_k=2, num_warps=4, dot="ieee", block_k=2 * tile)
        errors[f"{qtype.name}-m3-float32-v2-split-bn32"] = relative_error(torch.randn(3, k, generator=gen), w, bn32)
        first, second = quant_matmul(x23, w, split), quant_matmul(x23, w, split)
        errors[f"{qtype.name}-deterministic"] = float(torch.equal(first, second))
        onehot = torch.nn.functional.one_hot(torch.arange(DENSE_M) % k, k).float()
        for name in DENSE_DTYPES:
            dtype = DTYPES[name]
            errors[f"{qtype.name}-m{DENSE_M}-{name}"] = relative_error(
                torch.randn(DENSE_M, k, generator=gen).to(dtype), w)
            errors[f"{qtype.name}-m{DENSE_M}-{name}-onehot-rounded-ulps"] = rounded_weight_ulps(onehot.to(dtype), w)
    json.dump(errors, sys.stdout)


if __name__ == "__main__":
    main()
