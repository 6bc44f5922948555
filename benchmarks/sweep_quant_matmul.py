#!/usr/bin/env python3
"""Sweep quant_matmul's LaunchConfig space on the GPU at the Qwen3.6-27B shapes.

    python3 benchmarks/sweep_quant_matmul.py --out $OUT/sweep.json

For each type, shape (5120x5120, 17408x5120, 5120x17408; Q6_K also the 248320x5120 LM head) and
M in {1, 16, 23, 32, 64}, times the v2 tiled kernel over a bounded candidate list (BLOCK_N, BLOCK_K,
num_warps, num_stages, two split-K targets), plus the current default (`choose_config`) and the v1
default (the old fma/tf32x3 path) for comparison, and prints the best config per point with GB/s
and the fraction of the measured read bandwidth (`x.sum()` over a 4 GiB bf16 tensor: read-only
bytes / time, no copy).

Timing: a CUDA graph of 8-64 calls cycling through enough copies of the weight to exceed the L2
cache (>= 192 MB between two reads of one copy), so every call reads HBM as in decode (a 27B
model's weights never stay in L2); reported us is the median replay time per call, including the
split-K reduction kernel and the kernel-to-kernel gap inside a graph.

Every config is first checked against a float32 dequantization (max error <= 2e-2 of the largest
output; failures are listed in the JSON and skipped). Bounded to ~4.5 minutes (--budget-s): Triton
compiles run first in parallel worker processes (sharing the on-disk Triton cache, at most 45% of
the budget); the timing phase goes through the points in priority order (Q4_K, Q6_K, Q8_0, Q5_K,
IQ4_XS) and stops when the budget is spent. The JSON is rewritten after
every point, so a killed run still leaves its results.

--smoke runs tiny shapes on the CPU through the Triton interpreter (set TRITON_INTERPRET=1) to
check the plumbing; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout, as_completed
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

SHAPES = {"hidden 5120x5120": (5120, 5120), "gate/up 17408x5120": (17408, 5120),
          "down 5120x17408": (5120, 17408)}
LM_HEAD = {"lm_head 248320x5120": (248320, 5120)}
TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_K", "IQ4_XS")  # priority order
M_VALUES = (1, 16, 23, 32, 64)
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the first is choose_config's default tile
TILES = ((64, 256, 4, 3), (64, 256, 4, 2), (64, 128, 4, 4), (32, 256, 4, 3), (128, 256, 8, 3),
         (128, 128, 4, 3), (32, 512, 4, 2))
SPLIT_TARGETS = (2, 8)  # programs per SM the split-K aims at (the default aims at 4)
L2_FLUSH_BYTES = 192 << 20
GRAPH_CALLS = (8, 64)  # matmuls per timed graph: for a weight read once per call / cycled copies
READ_BYTES = 4 << 30
X_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def point_list(types, smoke: bool):
    points = []
    for name in types:
        shapes = dict(SHAPES)
        if name == "Q6_K":
            shapes.update(LM_HEAD)
        if smoke:
            shapes = {"smoke 48x512": (48, 512)}
        for shape, (n, k) in shapes.items():
            for m in M_VALUES:
                points.append((name, shape, n, k, m))
    return points


def candidates(name: str, n: int, k: int, m: int, device: torch.device, smoke: bool,
               x_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Config dicts for one point: v2 candidates, then the current default and the v1 default."""
    import triton
    from flashtree.kernels.quant_matmul import KERNELS
    from flashtree.kernels.quant_matmul._launch import (LaunchConfig, _TILED_MAX_SPLIT_K, _sm_count,
                                                        choose_config, split_for)

    qtype = QType[name]
    module = KERNELS[qtype].load()
    block_values = 256 if qtype != QType.Q8_0 else 32
    tile = module.TILE_VALUES
    block_m = max(16, triton.next_power_of_2(m))
    sms = _sm_count(device)
    dot = "x_dtype"
    configs = []
    tiles = TILES[:2] if smoke else TILES
    for block_n, block_k, warps, stages in tiles:
        if k % block_k or block_k % tile:
            continue
        if smoke:
            block_n = min(block_n, 64)
        for target in SPLIT_TARGETS:
            split = split_for(n, block_n, k // block_k, target * sms, _TILED_MAX_SPLIT_K)
            configs.append(LaunchConfig(block_m, block_n, split, warps, dot, block_k, stages))
    default = choose_config(m, n, k, x_dtype, device, block_values, tile, getattr(module, "DEFAULT_BLOCK_K", 256),
                            **getattr(module, "TUNING", {}))
    v1 = choose_config(m, n, k, x_dtype, device, block_values, 0)
    out, seen = [], set()
    for label, config in [("default", default), ("v1", v1)] + [("candidate", c) for c in configs]:
        if config in seen:
            continue
        seen.add(config)
        out.append({"label": label, "config": asdict(config)})
    return out


# ---------------------------------------------------------------------------------------------
# compile phase (worker processes)

_WEIGHTS: dict = {}


def _weight(name: str, n: int, k: int, device: str, copies: int = 1):
    from flashtree.kernels.quant_matmul import random_quant_weight

    key = (name, n, k, device)
    have = _WEIGHTS.setdefault(key, [])
    while len(have) < copies:
        have.append(random_quant_weight(QType[name], n, k, device, seed=len(have)))
    return have[:copies]


_DENSE: dict = {}
MAX_ERROR = 2e-2  # of max |reference|: bf16 weights and output (the GPU test's bound is 1e-2)


def _warm(job: tuple) -> tuple:
    """Compile and run one config once, checking the result against a float32 dequantization
    (a config that computes garbage must not win): job = (name, n, k, m, config dict, x dtype)."""
    name, n, k, m, config, x_dtype = job
    try:
        from flashtree.kernels.quant_matmul import quant_matmul
        from flashtree.kernels.quant_matmul._launch import LaunchConfig

        device = "cuda" if torch.cuda.is_available() else "cpu"
        w = _weight(name, n, k, device)[0]
        if (name, n, k) not in _DENSE:
            _DENSE[(name, n, k)] = w.dequantize()
        x = torch.randn(m, k, device=device).to(X_DTYPES[x_dtype])
        y = quant_matmul(x, w, LaunchConfig(**config)).float()
        ref = x.float() @ _DENSE[(name, n, k)].T
        error = ((y - ref).abs().max() / ref.abs().max()).item()
        if not error <= MAX_ERROR:
            return job, f"wrong result: max error {error:.3g} of max |reference|"
        return job, None
    except Exception as exc:  # noqa: BLE001 - recorded, the config is skipped
        return job, f"{type(exc).__name__}: {str(exc)[:300]}"


def compile_all(jobs: list[tuple], workers: int, deadline: float) -> dict:
    """Runs `_warm` for every job in parallel; returns {job key: error} for the failures."""
    failures = {}
    if workers <= 0:
        for job in jobs:
            if time.time() > deadline:
                break
            job, error = _warm(job)
            if error:
                failures[_job_key(job)] = error
        return failures
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(_warm, job) for job in jobs]
    done = 0
    try:
        for future in as_completed(futures, timeout=max(1.0, deadline - time.time())):
            job, error = future.result()
            done += 1
            if error:
                failures[_job_key(job)] = error
    except FutureTimeout:
        print(f"compile phase: budget spent after {done}/{len(jobs)} configs; the rest compile on demand",
              flush=True)
    pool.shutdown(wait=True, cancel_futures=True)  # running jobs finish: no GPU work during timing
    return failures


def _job_key(job: tuple) -> str:
    name, n, k, m, config, _ = job
    return json.dumps([name, k, m, config], sort_keys=True)


def compile_jobs(points, device, smoke, x_dtype: str) -> list[tuple]:
    """One job per distinct compile: the v2 kernels do not specialize on M (one compile per
    BLOCK_M); N is a multiple of 16 at every shape, so the smallest N of each K stands in."""
    smallest_n = {}
    for name, _, n, k, _ in points:
        smallest_n[(name, k)] = min(n, smallest_n.get((name, k), n))
    jobs, seen = [], set()
    for name, _, n, k, m in points:
        for cand in candidates(name, n, k, m, device, smoke, X_DTYPES[x_dtype]):
            config = cand["config"]
            m_key = config["block_m"] if config["block_k"] else m  # v1 specializes on M
            key = json.dumps([name, k, m_key, config], sort_keys=True)
            if key not in seen:
                seen.add(key)
                jobs.append((name, smallest_n[(name, k)], k, m, config, x_dtype))
    return jobs


# ---------------------------------------------------------------------------------------------
# timing


def bench_ms(fn, device: torch.device, calls: int = 1) -> float:
    """Milliseconds per `fn()` call, which makes `calls` quant_matmul calls: a CUDA graph of about
    64 matmuls (8 when one call reads >= 192 MB), replayed 8 times, median. (triton's
    do_bench_cudagraph sizes its graph from eager timings that the Python launch cost dominates
    for kernels this short, and would spend ~0.3 s per config.)"""
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    reps = max(1, math.ceil(GRAPH_CALLS[1] / calls)) if calls > 1 else GRAPH_CALLS[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(8):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] / reps


def read_bandwidth(device: torch.device, smoke: bool) -> float:
    """Bytes/s of x.sum() over a 4 GiB bf16 tensor: every byte read once, nothing written back."""
    nbytes = (64 << 20) if smoke else READ_BYTES
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    if device.type == "cuda":
        from triton.testing import do_bench

        ms = do_bench(lambda: x.sum(), rep=200)
    else:
        ms = bench_ms(lambda: x.sum(), device)
    return nbytes / (ms * 1e-3)


def time_point(name, n, k, m, cands, device, failures, read_bps, deadline, x_dtype) -> list[dict]:
    from flashtree.kernels.quant_matmul import quant_matmul
    from flashtree.kernels.quant_matmul._launch import LaunchConfig

    nbytes = _weight(name, n, k, device.type)[0].nbytes
    copies = 1 if device.type != "cuda" else max(1, math.ceil(L2_FLUSH_BYTES / nbytes))
    weights = _weight(name, n, k, device.type, copies)
    gen = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, k, generator=gen, device=device).to(x_dtype)
    rows = []
    for cand in cands:
        if time.time() > deadline:
            break
        config = cand["config"]
        m_key = config["block_m"] if config["block_k"] else m
        error = failures.get(json.dumps([name, k, m_key, config], sort_keys=True))
        row = {"qtype": name, "n": n, "k": k, "m": m, "label": cand["label"], "config": config,
               "weight_bytes": nbytes, "copies": copies}
        if error is None:
            launch = LaunchConfig(**config)

            def calls(launch=launch):
                for w in weights:
                    quant_matmul(x, w, launch)

            try:
                calls()  # compile (if the warm-up missed it) outside the timed graph
                ms = bench_ms(calls, device, copies) / copies
                gbs = nbytes / (ms * 1e-3) / 1e9
                row.update(us=ms * 1e3, gbs=gbs, of_read=gbs * 1e9 / read_bps)
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {str(exc)[:300]}"
        if error is not None:
            row["error"] = error
        rows.append(row)
    return rows


def describe(config: dict) -> str:
    if not config["block_k"]:
        return f"v1 {config['dot']} bm{config['block_m']} bn{config['block_n']} split{config['split_k']}"
    return (f"v2 bn{config['block_n']} bk{config['block_k']} split{config['split_k']} "
            f"w{config['num_warps']} s{config['num_stages']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for every timing and the best configs")
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated, in priority order")
    parser.add_argument("--budget-s", type=float, default=255.0, help="stop timing new configs after this")
    parser.add_argument("--compile-share", type=float, default=0.45,
                        help="fraction of the budget the parallel compile phase may use")
    parser.add_argument("--workers", type=int, default=None,
                        help="compile processes (default: CPUs - 2, at most 14, on CUDA; 0 on the CPU)")
    parser.add_argument("--x-dtype", choices=list(X_DTYPES), default="bfloat16")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (CPU + TRITON_INTERPRET=1; float16 x: the interpreter's bf16 dot is broken)")
    args = parser.parse_args()

    start = time.time()
    deadline = start + args.budget_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("needs a CUDA GPU (or TRITON_INTERPRET=1 with --smoke)")
    types = [t for t in args.types.split(",") if t]
    points = point_list(types, args.smoke)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    read_bps = read_bandwidth(device, args.smoke)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"{device_name}: read bandwidth (x.sum over a {'64 MiB' if args.smoke else '4 GiB'} bf16 tensor) "
          f"{read_bps / 1e9:.0f} GB/s",
          flush=True)

    if args.smoke:
        args.x_dtype = "float16"
    x_dtype = X_DTYPES[args.x_dtype]
    jobs = compile_jobs(points, device, args.smoke, args.x_dtype)
    workers = args.workers
    if workers is None:
        workers = 0 if device.type != "cuda" else min(14, max(1, (os.cpu_count() or 2) - 2))
    t0 = time.time()
    failures = compile_all(jobs, workers, start + args.budget_s * args.compile_share)
    print(f"compiled {len(jobs)} configs with {workers} workers in {time.time() - t0:.0f} s "
          f"({len(failures)} failed: skipped)", flush=True)

    report = {"device": device_name, "read_gbs": read_bps / 1e9, "budget_s": args.budget_s, "x_dtype": args.x_dtype,
              "m_values": list(M_VALUES), "best": [], "runs": [], "compile_failures": failures,
              "unfinished": []}
    header = (f"{'type':7} {'shape':20} {'M':>3} {'best us':>8} {'GB/s':>6} {'%read':>6} {'default':>8} "
              f"{'v1':>8}  best config")
    print(header, flush=True)
    for name, shape, n, k, m in points:
        if time.time() > deadline:
            report["unfinished"].append([name, shape, m])
            continue
        cands = candidates(name, n, k, m, device, args.smoke, x_dtype)
        rows = time_point(name, n, k, m, cands, device, failures, read_bps, deadline, x_dtype)
        for row in rows:
            row["shape"] = shape
        report["runs"].extend(rows)
        timed = [r for r in rows if "us" in r]
        if not timed:
            report["unfinished"].append([name, shape, m])
            continue
        best = min(timed, key=lambda r: r["us"])
        by_label = {r["label"]: r.get("us") for r in rows}
        summary = {**best, "default_us": by_label.get("default"), "v1_us": by_label.get("v1"),
                   "complete": len(rows) == len(cands)}
        report["best"].append(summary)

        def fmt(us):
            return f"{us:8.1f}" if us is not None else f"{'-':>8}"

        print(f"{name:7} {shape:20} {m:3d} {best['us']:8.1f} {best['gbs']:6.0f} {100 * best['of_read']:5.0f}% "
              f"{fmt(summary['default_us'])} {fmt(summary['v1_us'])}  {describe(best['config'])}"
              f"{'' if summary['complete'] else ' (partial)'}", flush=True)
        out.write_text(json.dumps(report, indent=1))
    report["elapsed_s"] = time.time() - start
    out.write_text(json.dumps(report, indent=1))
    print(f"done in {report['elapsed_s']:.0f} s; {len(report['unfinished'])} points left untimed; wrote {out}",
          flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
