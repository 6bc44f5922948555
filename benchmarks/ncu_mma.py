#!/usr/bin/env python3
"""The tensor-core Q4_K kernels at one 27B matrix (FFN gate/up, 17408 x 5120) and a few row counts, launched a few
times each so that Nsight Compute can profile them by name (the launches are not timed here):

    ncu --clock-control none --section WarpStateStats -k regex:qmh python3 benchmarks/ncu_mma.py --rows 1,2,23

Each launch reads a fresh copy of the weight (six copies: past the 60 MB L2, as in the sweeps).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

from flashtree.kernels.quant_matmul import mma, random_quant_weight  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,23")
    parser.add_argument("--type", default="Q4_K")
    parser.add_argument("--shape", default="17408x5120")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--kernel", default=None, help="mma.cu kernel to force (qmh, qmm), else the engine's")
    args = parser.parse_args()
    qtype = QType[args.type]
    n, k = (int(v) for v in args.shape.split("x"))
    weights = [random_quant_weight(qtype, n, k, "cuda", seed=i) for i in range(6)]
    for m in (int(v) for v in args.rows.split(",")):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        for i in range(args.launches):
            mma.matmul(x, weights[i % len(weights)].raw, qtype, n, k, kernel=args.kernel)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
