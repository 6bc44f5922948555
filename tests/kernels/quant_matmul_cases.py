"""Runs every quant_matmul interpreter case in one process (TRITON_INTERPRET=1 must be set before
triton is imported, so test_quant_matmul.py launches this file as a subprocess). Prints one JSON
object: case id -> max |kernel - reference| / max |reference|."""

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
M_VALUES = (1, 5, 16, 65)  # 65: the prefill path
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def case_ids() -> list[str]:
    ids = [f"{t.name}-m{m}-{d}" for t in KERNELS for m in M_VALUES for d in DTYPES]
    return ids + [f"{t.name}-m5-float32-nosplit" for t in KERNELS]


def weight(qtype: QType) -> QuantWeight:
    k = K.get(qtype, 512)
    values = np.random.default_rng(int(qtype)).standard_normal((N, k)).astype(np.float32)
    return QuantWeight.from_gguf_bytes(torch.from_numpy(quants.quantize(values, qtype)), qtype, (N, k))


def relative_error(x: torch.Tensor, w: QuantWeight, config=None) -> float:
    y, ref = quant_matmul(x, w, config).float(), quant_matmul_reference(x, w).float()
    assert y.shape == ref.shape and quant_matmul(x, w, config).dtype == x.dtype
    return ((y - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from flashtree.kernels.quant_matmul._launch import LaunchConfig  # imports triton

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    errors = {}
    for qtype in KERNELS:
        w = weight(qtype)
        for m in M_VALUES:
            x = torch.randn(m, w.shape[1], generator=gen)
            for name, dtype in DTYPES.items():
                errors[f"{qtype.name}-m{m}-{name}"] = relative_error(x.to(dtype), w)
        one_split = LaunchConfig(block_m=8, block_n=32, split_k=1, num_warps=4)
        errors[f"{qtype.name}-m5-float32-nosplit"] = relative_error(torch.randn(5, w.shape[1], generator=gen),
                                                                    w, one_split)
    json.dump(errors, sys.stdout)


if __name__ == "__main__":
    main()
