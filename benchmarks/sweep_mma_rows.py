#!/usr/bin/env python3
"""Q4_K at 2-64 rows of x on the GPU: the bf16 token-column kernel (qmm) against the float16 kernel (qmh,
its x conversion included) at several launch shapes, and dense bf16 cuBLAS as the peer, at the 27B shapes.

    python3 benchmarks/sweep_mma_rows.py [--out rows.json]

Each point is timed the way `flashtree bench --kernels` times one (CUDA graph, weights rotated past the
L2) and checked against the float32 dequantization (max |error| / max |reference|). Prints one table.
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
from flashtree.kernels.quant_matmul import mma, quant_matmul_reference, random_quant_weight  # noqa: E402

SHAPES = {"gate/up 17408x5120": (17408, 5120), "down 5120x17408": (5120, 17408),
          "q+gate 12288x5120": (12288, 5120), "kv 1024x5120": (1024, 5120)}
ROWS = (2, 8, 16, 23, 32, 64)
QT = QType.Q4_K


def variants(m: int, n: int, k: int) -> list[tuple[str, str, mma.MMAConfig | None]]:
    """qmm and qmh as shipped, and qmh at other launch shapes (row tiles, warps, splits, chains)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = mma.choose_config(QT, min(m, 32), n, k, sms)
    out = [("qmm", "qmm", mma.choose_config(QT, min(m, 32), n, k, sms, kernel="qmm")), ("qmh", "qmh", default)]
    for rt, warps, split, chains in ((1, 4, 1, 2), (2, 4, 1, 1), (1, 4, 1, 1), (1, 8, 1, 2), (1, 4, 2, 2)):
        c = mma.MMAConfig(rt, warps, split * default.splits, chains)
        if c != default and n % (16 * rt) == 0 and (k // 256) >= warps * c.splits:
            out.append((f"qmh r{rt}w{warps}s{c.splits}c{chains}", "qmh", c))
    return out


def precompile(arch: str) -> None:
    """Every instance the sweep launches, compiled in parallel into the on-disk cache first."""
    jobs = {}
    for n, k in SHAPES.values():
        for m in ROWS:
            tg = mma.token_groups(min(m, 32))
            for _, kernel, c in variants(m, n, k):
                name = mma._instance(QT, c, tg, kernel)
                jobs[name] = mma._wrapper(name, QT, c, tg, kernel)
    mma.precompile(list(jobs.items()), arch)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="rows.json")
    parser.add_argument("--budget-s", type=float, default=240)
    args = parser.parse_args()
    t0 = time.time()
    precompile(mma.arch_of(torch.device("cuda")))
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    read_bps = read_bandwidth(torch.device("cuda"))
    print(f"read bandwidth {read_bps / 1e12:.2f} TB/s", flush=True)
    results = {"read_tbs": read_bps / 1e12, "points": []}
    for label, (n, k) in SHAPES.items():
        first = random_quant_weight(QT, n, k, "cuda", seed=0)
        weights = [first] + [random_quant_weight(QT, n, k, "cuda", seed=i) for i in range(1, rotation(first.nbytes))]
        dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(rotation(n * k * 2))]
        floor = first.nbytes / read_bps
        for m in ROWS:
            if time.time() - t0 > args.budget_s:
                print("budget spent", flush=True)
                break
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = quant_matmul_reference(x, first).float()
            cells = []
            us = time_graph([lambda w=w: F.linear(x, w) for w in dense]) * 1e6
            cells.append(f"bf16 {us:.1f}")
            results["points"].append({"matrix": label, "rows": m, "variant": "dense bf16", "us": us})
            for name, kernel, config in variants(m, n, k):
                try:
                    out = mma.matmul(x, first.raw, QT, n, k, config, kernel).float()
                except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the sweep goes on
                    cells.append(f"{name}: FAIL {str(e)[:80]}")
                    continue
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                us = time_graph([lambda w=w: mma.matmul(x, w.raw, QT, n, k, config, kernel) for w in weights]) * 1e6
                results["points"].append({"matrix": label, "rows": m, "variant": name, "us": us,
                                          "of_bw": floor * 1e6 / us, "err": err})
                cells.append(f"{name}: {us:.1f} ({100 * floor * 1e6 / us:.0f}%) {err:.0e}")
            print(f"{label:20} {m:3d}  " + " | ".join(cells), flush=True)
        del weights, dense, first
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
