#!/usr/bin/env python3
"""Sweep the tensor-core Q4_K / Q6_K kernels' launch configurations on the GPU (27B shapes).

    python3 benchmarks/sweep_mma.py --out $OUT/sweep_mma.json [--budget-s 240]

For each type, matrix and row count, times every MMAConfig (row tiles per warp, warps per CTA,
CTAs per row group) the way `flashtree bench --kernels` times a point (CUDA graph, weights rotated
past the L2) and prints the best against the default `choose_config`. The cubins are compiled first
in parallel processes (NVRTC needs no GPU) into the on-disk cache the kernels load from.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

from flashtree.bench.kernels import bench_dense, rotation, time_graph  # noqa: E402
from flashtree.bench.steps import read_bandwidth  # noqa: E402
from flashtree.kernels.quant_matmul import mma, quant_matmul_reference, random_quant_weight  # noqa: E402

SHAPES = {"ffn gate/up 17408x5120": (17408, 5120), "ffn down 5120x17408": (5120, 17408),
          "lm_head 248320x5120": (248320, 5120), "attn q+gate 12288x5120": (12288, 5120),
          "kv 1024x5120": (1024, 5120)}
ROWS = (1, 16, 23, 32, 8)


def configs(qtype: QType, n: int, k: int, m: int) -> list[mma.MMAConfig]:
    out = []
    for rt, warps, splits in itertools.product((1, 2), (2, 4, 8), (1, 2, 4, 8)):
        if n % (16 * rt) or (k // 256) < splits * warps:
            continue
        out.append(mma.MMAConfig(rt, warps, splits))
    default = mma.choose_config(qtype, m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    return [default] + [c for c in out if c != default]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sweep_mma.json")
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--types", default="Q4_K,Q6_K")
    args = parser.parse_args()
    t0 = time.time()
    device = torch.device("cuda")
    arch = mma.arch_of(device)
    types = [QType[t] for t in args.types.split(",")]
    plan = []
    for qtype in types:
        for name, (n, k) in SHAPES.items():
            if name.startswith("lm_head") and qtype != QType.Q6_K:
                continue
            for m in ROWS:
                plan.append((qtype, name, n, k, m, configs(qtype, n, k, m)))
    start = time.time()
    jobs = {}
    for qtype, _, n, k, m, cs in plan:
        for c in cs:
            tg = mma.token_groups(m)
            kernel = mma.kernel_for(qtype, tg, n, k)
            name = mma._instance(qtype, c, tg, kernel)
            jobs[name] = mma._wrapper(name, qtype, c, tg, kernel)
    mma.precompile(list(jobs.items()), arch)
    print(f"compiled in {time.time() - start:.0f} s", flush=True)
    read_bps = read_bandwidth(device)
    print(f"read bandwidth {read_bps / 1e12:.2f} TB/s", flush=True)
    results = []
    print(f"{'type':5} {'matrix':24} {'M':>3} {'default us':>10} {'%bw':>4} {'best us':>8} {'%bw':>4} {'bf16 us':>7} "
          "best config / err")
    weights_key, weights, dense = None, None, {}
    for qtype, name, n, k, m, cs in plan:
        if time.time() - t0 > args.budget_s:
            print("budget spent", flush=True)
            break
        if (n, k) not in dense:  # the peer: the same matrix in bf16 through cuBLAS, timed the same way
            dense[(n, k)] = bench_dense(n, k, ROWS, device)
        if weights_key != (qtype, name):
            weights = None
            torch.cuda.empty_cache()
            first = random_quant_weight(qtype, n, k, device, seed=0)
            weights = [first] + [random_quant_weight(qtype, n, k, device, seed=i) for i in range(1, rotation(first.nbytes))]
            weights_key = (qtype, name)
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        ref = quant_matmul_reference(x, weights[0]).float()
        floor = weights[0].nbytes / read_bps
        row = {"type": qtype.name, "matrix": name, "n": n, "k": k, "rows": m, "floor_us": floor * 1e6,
               "bf16_us": dense[(n, k)][m] * 1e6, "configs": []}
        for c in cs:
            out = mma.matmul(x, weights[0].raw, qtype, n, k, c).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            us = time_graph([lambda w=w: mma.matmul(x, w.raw, qtype, n, k, c) for w in weights], replays=10) * 1e6
            row["configs"].append({"rt": c.rt, "warps": c.warps, "splits": c.splits, "us": us, "err": err})
        results.append(row)
        default, best = row["configs"][0], min(row["configs"], key=lambda r: r["us"])
        print(f"{qtype.name:5} {name:24} {m:3d} {default['us']:10.1f} {100 * floor * 1e6 / default['us']:3.0f}% "
              f"{best['us']:8.1f} {100 * floor * 1e6 / best['us']:3.0f}% {row['bf16_us']:7.1f} rt{best['rt']} w{best['warps']} "
              f"s{best['splits']} / {max(c['err'] for c in row['configs']):.1e}", flush=True)
        Path(args.out).write_text(json.dumps({"read_tbs": read_bps / 1e12, "points": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
