#!/usr/bin/env python3
"""Q8_0, Q5_K and IQ4_XS at 1-32 rows on the GPU: the tensor-core kernel (kernels/quant_matmul/block32_mma.cu, its x
conversion included) at several launch shapes against the Triton kernel it replaces and dense bf16 cuBLAS, at the 27B
shapes.

    python3 benchmarks/sweep_block32.py [--types Q8_0,Q5_K,IQ4_XS] [--budget-s 150] [--out block32.json]

Each point is timed the way `flashtree bench --kernels` times one (CUDA graph, weights rotated past the L2) and
checked against the float32 dequantization (max |error| / max |reference|). Prints one table: us and % of the
read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

from flashtree.bench.kernels import rotation, time_graph  # noqa: E402
from flashtree.bench.steps import read_bandwidth  # noqa: E402
from flashtree.kernels import cuda_functions  # noqa: E402
from flashtree.kernels.quant_matmul import (KERNELS, block32_mma, mma, quant_matmul_reference,  # noqa: E402
                                            random_quant_weight)

SHAPES = {"q+gate 12288x5120": (12288, 5120), "gate/up 17408x5120": (17408, 5120),
          "down 5120x17408": (5120, 17408), "kv 1024x5120": (1024, 5120), "head 248320x5120": (248320, 5120)}
ROWS = (1, 8, 23, 32)
CONFIGS = tuple(block32_mma.BlockConfig(rt, w) for rt, w in ((1, 4), (1, 8), (1, 16), (2, 8), (4, 8)))


def _precompile(device: torch.device, types) -> None:
    jobs = {}
    for qtype in types:
        for c in CONFIGS:
            for tg in (1, 2, 3, 4):
                name = block32_mma._instance(qtype, c, tg, torch.bfloat16)
                jobs[name] = block32_mma.source() + block32_mma._wrapper(name, qtype, c, tg, torch.bfloat16)
    jobs.update(block32_mma.cuda_jobs([], 132, torch.bfloat16))
    cuda_functions.precompile(list(jobs.items()), mma.arch_of(device))


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--out")
    parser.add_argument("--shapes", help="comma-separated labels (default: all)")
    parser.add_argument("--types", default="Q8_0,Q5_K,IQ4_XS")
    args = parser.parse_args()
    device = torch.device("cuda")
    started = time.perf_counter()
    types = [QType[name] for name in args.types.split(",")]
    _precompile(device, types)
    read_bps = read_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}: read bandwidth {read_bps / 1e12:.2f} TB/s; "
          f"compiled in {time.perf_counter() - started:.0f} s", flush=True)
    labels = args.shapes.split(",") if args.shapes else list(SHAPES)
    points = []
    print(f"{'type':6} {'matrix':20} {'rows':>4} {'floor':>6} {'cuBLAS':>7} {'Triton':>7} {'default':>8} "
          + " ".join(f"{f'r{c.rt}w{c.warps}':>7}" for c in CONFIGS) + "  err(default)")
    for qtype, label in [(t, lab) for t in types for lab in labels]:
        if time.perf_counter() - started > args.budget_s:
            break
        n, k = SHAPES[label]
        first = random_quant_weight(qtype, n, k, device, seed=0)
        weights = [first] + [random_quant_weight(qtype, n, k, device, seed=i)
                             for i in range(1, rotation(first.nbytes))]
        dense = [torch.randn(n, k, dtype=torch.bfloat16, device=device) for _ in range(rotation(n * k * 2))]
        floor = first.nbytes / read_bps
        for m in ROWS:
            if time.perf_counter() - started > args.budget_s:
                print("budget spent", flush=True)
                break
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            ours = lambda w, c=None: block32_mma.matmul(x, w.fields(), qtype, n, k, config=c)  # noqa: E731
            triton = lambda w: KERNELS[qtype].load().matmul(x, w.fields(), n, k, None)  # noqa: E731
            point = {"type": qtype.name, "matrix": label, "n": n, "k": k, "rows": m, "floor_us": floor * 1e6,
                     "cublas_us": time_graph([lambda w=w: F.linear(x, w) for w in dense]) * 1e6,
                     "triton_us": time_graph([lambda w=w: triton(w) for w in weights]) * 1e6,
                     "default_us": time_graph([lambda w=w: ours(w) for w in weights]) * 1e6,
                     "default": str(block32_mma.choose_config(qtype, m, n, k, mma.sm_count(device))),
                     "err": _error(ours(first), quant_matmul_reference(x, first)), "configs": {}}
            for c in CONFIGS:
                timed = time_graph([lambda w=w, c=c: ours(w, c) for w in weights])
                point["configs"][f"r{c.rt}w{c.warps}"] = timed * 1e6
            points.append(point)
            print(f"{qtype.name:6} {label:20} {m:4d} {floor * 1e6:6.1f} {point['cublas_us']:7.1f} "
                  f"{point['triton_us']:7.1f} "
                  f"{point['default_us']:7.1f}{'':1}"
                  + " ".join(f"{us:7.1f}" for us in point["configs"].values())
                  + f"  {point['err']:.1e} ({100 * floor * 1e6 / point['default_us']:.0f} % bw)", flush=True)
        del weights, first, dense
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(device), "read_tbs": read_bps / 1e12,
                                              "points": points}, indent=2))


if __name__ == "__main__":
    main()
