#!/usr/bin/env python3
"""Launch settings of kernels/tree_attention.py at the Qwen3.6-27B attention shape (24 query heads, 4 KV
heads, head_dim 256), on the GPU: for each case (tokens per call, committed rows, cache type) the
(BLOCK_M, BLOCK_N, warps, stages, splits) points, in a fixed random order as far as the budget allows, are
timed with CUDA events and checked against the default launch's output; the table gives each case's
default and best points, time and K/V read bandwidth.

    python3 benchmarks/sweep_tree_attention.py --out $OUT/sweep_attention.json [--budget-s 100]

`--compare` instead times a short fixed list of launches (`COMPARED`) at the verify / decode shapes of
`COMPARE_CASES` (or `--cases`) as the model calls the kernel (the query's norm and RoPE at the load and the
output gate at the store, except over TQ3_0 rows, whose rotation keeps them apart), each captured
`GRAPH_CALLS` times in one CUDA graph (GPU time, no launch overhead), next to `--baseline FILE`: another
version of kernels/tree_attention.py (e.g. `git show REV:...`), at its defaults:

    python3 benchmarks/sweep_tree_attention.py --compare --baseline .baseline/tree_attention.py --out $OUT/compare.json
    python3 benchmarks/sweep_tree_attention.py --compare --cases 1:262144:tq3_0,23:65536:q8_0 --baseline ... --out ...

`--cuda-decode-from ROWS` sets where a decode over TQ3_0 or Q8_0 rows takes the CUDA C kernel
(kernels/attention_decode.cu; `attention_decode.MIN_ROWS`): with 0 and a baseline from before it, "new default" against
the baseline is the CUDA decode against the Triton one at every row count (where the two cross: `MIN_ROWS`).
`--cuda-verify-from ROWS` does the same for a tree over TQ3_0 or Q8_0 rows (kernels/attention_verify.cu): "new
default" against "tail" / "no tail" (Triton's verify with and without its tail tile, its default from / below 16K
rows). Over Q8_0 rows the CUDA kernels read a query normed before them: "q normed before" is the model's path there,
"new default" Triton's kernel with the norm fused.

`--float32-query` feeds the raw query and gate in float32, as the 27B engine's float32 activations do (a bf16 query,
the default, compiles to another, lighter kernel); candidates "q normed before ..." time `qk_norm_rope` into the bf16
operands and the kernel without the fused norm together (attention.py's verify since 2026-12-06).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from flashtree.bench.kernels import time_graph  # noqa: E402
from flashtree.kernels import attention_decode, attention_verify  # noqa: E402
from flashtree.kernels.kv_quant import kv_type  # noqa: E402
from flashtree.kernels.qk_norm_rope import qk_norm_rope, rope_tables  # noqa: E402
from flashtree.kernels.tree_attention import (  # noqa: E402
    KV_KINDS, _launch_defaults, choose_splits, programs_per_sm, tree_attention)

HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256
CASES = [  # (tokens per call, committed rows, cache type)
    (23, 65536, "f16"), (23, 1024, "f16"), (1, 65536, "f16"), (65, 65536, "f16"), (23, 65536, "tq3_0"),
    (23, 65536, "q8_0"), (512, 65536, "tq3_0"),
]
# timed before the random order: the quantized rows' defaults (decode, verify) and their neighbours
FIRST = [(16, 16, 4, 3, 1), (16, 32, 8, 3, 1), (16, 16, 4, 3, 2), (16, 16, 4, 3, 0.5), (64, 16, 4, 3, 1),
         (128, 32, 8, 2, 1), (128, 32, 8, 3, 1), (128, 32, 8, 2, 2)]
GRID = dict(block_m=(16, 32, 64, 128), block_rows=(16, 32, 64), num_warps=(4, 8), num_stages=(1, 2, 3),
            split_scale=(0.5, 1, 2, 4))


def inputs(n: int, committed: int, cache: str) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = kv_type(cache)
    kv = [t.quantize(torch.randn(KV_HEADS, committed + n, HEAD_DIM, device="cuda", generator=g)) for _ in range(2)]
    visible = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    return dict(q=torch.randn(HEADS, n, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16),
                k_cache=kv[0], v_cache=kv[1], kv_type_k=cache, kv_type_v=cache,
                start_t=torch.tensor([committed], device="cuda"), visible=visible,
                positions=torch.arange(committed, committed + n, device="cuda"), kv_end=committed + n,
                scale=HEAD_DIM ** -0.5)


def timed(fn, repeat: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat * 1e3  # microseconds


def sweep_case(n: int, committed: int, cache: str, deadline: float) -> dict:
    args = inputs(n, committed, cache)
    kv_bytes = 2 * args["k_cache"][:, : committed + n].numel() * args["k_cache"].element_size()
    reference = tree_attention(**args)
    default_us = timed(lambda: tree_attention(**args))
    group_rows = HEADS // KV_HEADS * n
    quantized = KV_KINDS[kv_type(cache).name] > 0
    points = []
    grid = list(itertools.product(*GRID.values()))
    random.Random(0).shuffle(grid)  # a budget cut short still samples the whole space
    grid = FIRST + [point for point in grid if point not in FIRST]
    for block_m, rows, warps, stages, scale in grid:
        if block_m < min(64, group_rows):
            continue  # a smaller query tile than the default decodes each K/V row once per extra tile
        if time.time() > deadline:
            break
        m_tiles = -(-group_rows // block_m)
        splits = max(1, round(scale * choose_splits(committed + n, KV_HEADS, m_tiles, block_rows=rows,
                                                    programs_per_sm=programs_per_sm(quantized, m_tiles))))
        launch = dict(block_m=block_m, block_rows=rows, num_warps=warps, num_stages=stages, split=splits)
        try:
            out = tree_attention(**args, **launch)
            error = ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
            us = timed(lambda: tree_attention(**args, **launch))
        except Exception as exc:  # noqa: BLE001 - out of shared memory / registers: not a candidate
            points.append({**launch, "error": str(exc).splitlines()[0][:120]})
            continue
        points.append({**launch, "us": round(us, 1), "rel_error": error})
    good = [p for p in points if "us" in p and p["rel_error"] < 2e-2]
    best = min(good, key=lambda p: p["us"]) if good else None
    return {"tokens": n, "committed": committed, "cache": cache, "kv_bytes": kv_bytes, "default_us": round(default_us, 1),
            "default_GBps": round(kv_bytes / default_us / 1e3, 1), "best": best,
            "best_GBps": round(kv_bytes / best["us"] / 1e3, 1) if best else None, "points": points}


COMPARE_CASES = [(23, 1024, "f16"), (23, 8192, "f16"), (23, 65536, "f16"), (1, 1024, "f16"), (1, 65536, "f16"),
                 (65, 8192, "f16")]  # (tokens, committed rows, cache type)
GRAPH_CALLS = 10
# (name, launch overrides, split scale on the default choice); block_m / block_rows / num_warps left out keep
# the default's. The query-tile candidates apply only where the default tile is 64 rows (T >= 11), the
# register caps only to a decode (one query tile).
COMPARED = [
    ("new default", {}, 1),
    ("f16 operands", {"operands": torch.float16}, 1),
    ("splits x2", {}, 2),
    ("splits x0.5", {}, 0.5),
    ("2 stages", {"num_stages": 2}, 1),
    ("32-row chunks", {"block_rows": 32}, 1),
    ("64-row chunks 2 st", {"block_rows": 64, "num_stages": 2}, 1),
    ("64-row chunks 1 st", {"block_rows": 64, "num_stages": 1}, 1),
    ("M32 32-row chunks", {"block_m": 32, "block_rows": 32}, 1),
    ("M128 8 warps", {"block_m": 128, "num_warps": 8}, 1),
    # the verify's default (64-row tile, 4 warps) compiles with the query's norm and the gate to 336 bytes a thread
    # of spills (sm_90, offline, 2026-12-04); these two compile to 204 and 108 registers without
    ("M64 8 warps", {"block_m": 64, "num_warps": 8}, 1),
    ("M32 8 warps", {"block_m": 32, "num_warps": 8}, 1),
    ("128 regs", {"max_registers": 128}, 1),
    ("splits x0.75", {}, 0.75),
    # TQ3_0 rows (cases with a TQ3_0 side only): the float32 decode the pairs replace, and the pairs with
    # 32-row chunks on 8 warps (offline sm_90, triton 3.6: 147 registers, 150 warp instructions a K/V row
    # against the default's 153)
    ("float32 TQ3 decode", {"tq3_pairs": False}, 1),
    ("32-row chunks 8 warps", {"block_rows": 32, "num_warps": 8, "max_registers": 255}, 1),
    # a decode over quantized rows waits on its chunk's chain of dependent steps (17 barriers a 16-row chunk on 4
    # warps; fifteenth session): programs of 2 or 1 warps (1 warp: 5 barriers, each within the warp; offline
    # sm_90, triton 3.6: TQ3_0 pairs 255 registers and 288 bytes of spills, Q8_0 255 without), more of them an SM
    # (the default split count aims at 4 programs an SM: 1-warp programs want twice to four times as many)
    ("2 warps splits x2", {"num_warps": 2, "max_registers": 255}, 2),
    ("1 warp splits x2", {"num_warps": 1, "max_registers": 255}, 2),
    ("1 warp splits x4", {"num_warps": 1, "max_registers": 255}, 4),
    # TQ3_0 fields loaded with their use: the 1-warp pair decode then fits 255 registers without spills
    ("1 warp at use splits x2", {"num_warps": 1, "max_registers": 255, "fields_ahead": False}, 2),
    # a decode with the MMAs' sides swapped (K rows the M side, the group's 6 query rows padded to 8 the N side):
    # the [D, 8] accumulator takes half the registers of a [16, D] one (offline sm_90, triton 3.6, TQ3_0 pairs:
    # 1 warp 197 registers and 1676 instructions a chunk where the 16-row tile takes 255 and 1840; 4 warps 96
    # registers, 519 a warp, fields at use)
    ("swap 1 warp x2", {"swap": True, "block_m": 8, "num_warps": 1}, 2),
    ("swap 1 warp x2.5", {"swap": True, "block_m": 8, "num_warps": 1}, 2.5),
    ("swap 2 warps pairs x2", {"swap": True, "block_m": 8, "num_warps": 2, "tq3_pairs": True, "fields_ahead": False},
     2),
    ("swap 4 warps pairs x1.25", {"swap": True, "block_m": 8, "num_warps": 4, "tq3_pairs": True,
                                  "fields_ahead": False}, 1.25),
    ("swap 4 warps pairs ahead", {"swap": True, "block_m": 8, "num_warps": 4, "tq3_pairs": True}, 1),
    ("swap 4 warps x1.25", {"swap": True, "block_m": 8, "num_warps": 4}, 1.25),
    # more programs an SM under a register cap (offline sm_90, triton 3.6, TQ3_0 pairs at use: 1 warp at 168
    # registers 24 bytes of stack, 12 programs an SM; 2 warps at 96 registers 56 bytes, 10 programs an SM)
    ("swap 1 warp 168 regs x3", {"swap": True, "block_m": 8, "num_warps": 1, "max_registers": 168}, 3),
    ("swap 2 warps 96 regs x2.5", {"swap": True, "block_m": 8, "num_warps": 2, "max_registers": 96}, 2.5),
    # the 2-warp swapped decode with its TQ3_0 fields loaded a chunk ahead (offline sm_90, triton 3.6: 168 registers,
    # no stack, 6 programs an SM where the default's 128 registers give 8): the next chunk's loads in flight
    ("swap 2 warps pairs ahead x0.75", {"swap": True, "block_m": 8, "num_warps": 2, "tq3_pairs": True,
                                        "fields_ahead": True}, 0.75),
    ("swap 2 warps pairs ahead x1", {"swap": True, "block_m": 8, "num_warps": 2, "tq3_pairs": True,
                                     "fields_ahead": True}, 1),
    # the query normed and roped by its own launch (`qk_norm_rope`, stored as the bf16 operand) and read as it is:
    # with float32 activations (`--float32-query`, the 27B's) the default verify tile's fused norm holds the float32
    # [64, 256] query tile and compiles to 2144 bytes a thread of stack (offline sm_90, triton 3.9, 2026-12-06;
    # 360 with a bf16 query), in each split's prologue; the verify's attention took 50 us a layer in the H100 step
    # profile where this sweep's bf16 query took 23 on the H200 (f16 cases only: TQ3_0 queries are normed apart)
    ("q normed before", {"norm_before": True}, 1),
    ("q normed before M32 32-row", {"norm_before": True, "block_m": 32, "block_rows": 32}, 1),
    ("q normed before splits x0.5", {"norm_before": True}, 0.5),
    ("splits x0.25", {}, 0.25),
    # a verify's rows past its 128-row tile (10 of 138 a KV head) in a tile of their own, by default from 16K rows:
    # without it, and forced at shorter ranges (offline sm_90, triton 3.6, warp instructions a 16 K/V rows: TQ3_0's
    # second 128-row tile 5256, its swapped 16-row tail 2212; Q8_0's 4360 and 2424)
    ("no tail", {"tail": False}, 1),
    ("tail", {"tail": True}, 1),
    # the verify's 128-row tile decoding TQ3_0 as float16 pairs: since its float32 query is rounded before the launch,
    # 255 registers and no stack, 1140 loop instructions a warp a 32-row chunk against the float32 decode's 1314 and
    # 24 bytes (offline sm_90, triton 3.6; the twenty-third session's pairs there spilled, 1158.5 -> 1237.4 us at 262K)
    ("tile pairs", {"tq3_pairs": True}, 1),
    # the Triton decode at its own launch (any launch setting keeps a decode over TQ3_0 rows off the CUDA C kernel,
    # kernels/attention_decode.cu, which "new default" takes from `attention_decode.MIN_ROWS` rows)
    ("triton decode", {"swap": True, "block_m": 8, "num_warps": 2, "max_registers": 128, "tq3_pairs": True,
                       "fields_ahead": False}, 1),
]
TQ3_ONLY = {"triton decode", "float32 TQ3 decode", "32-row chunks 8 warps", "1 warp at use splits x2", "swap 2 warps pairs x2",
            "swap 4 warps pairs x1.25", "swap 4 warps pairs ahead", "swap 2 warps pairs ahead x0.75",
            "swap 2 warps pairs ahead x1", "tile pairs"}


def model_inputs(n: int, committed: int, cache: str, query_dtype: torch.dtype = torch.bfloat16) -> dict:
    """`inputs` as attention.py passes them for a bf16 model (float32 activations, bf16 operands): the raw query
    rows (strided, beside the gate rows of the same projection; `query_dtype`, float32 as the 27B engine's
    activations, bf16 as the sweeps before 2026-12-06), the q norm and RoPE tables, and the gate; over
    TQ3_0 rows the query normed and rotated in a launch before (float32), the values rotated back in the call."""
    args = inputs(n, committed, cache)
    if kv_type(cache).rotated:
        g = torch.Generator(device="cuda").manual_seed(1)
        rows = torch.randn(n, HEADS, 2, HEAD_DIM, device="cuda", generator=g)
        args.update(q=args["q"].float(), gate=rows[:, :, 1], unrotate_values=True, operands=torch.bfloat16)
        return args
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = torch.randn(n, HEADS, 2, HEAD_DIM, device="cuda", generator=g).to(query_dtype)
    weight = 1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", generator=g)
    args.update(q=rows[:, :, 0].transpose(0, 1), gate=rows[:, :, 1],
                q_norm=(weight, 1e-6, *rope_tables(args["positions"], 64, 1e7)), operands=torch.bfloat16)
    return args


def normed_before(args: dict, launch: dict):
    """The call with the query normed and roped by `qk_norm_rope` first (into the operands' dtype), then attended
    without the fused norm: both launches, as one callable."""
    raw, (weight, eps, cos, sin) = args["q"], args["q_norm"]
    rest = {key: value for key, value in args.items() if key not in ("q", "q_norm")}

    def call():
        q = qk_norm_rope(raw.transpose(0, 1), weight, eps, cos, sin, out_dtype=args["operands"]).transpose(0, 1)
        return tree_attention(q, **{**rest, **launch}, out_dtype=raw.dtype)
    return call


def graph_timed(fn) -> float:
    """Microseconds per call of fn, GRAPH_CALLS calls captured in one CUDA graph (`bench.kernels.time_graph`)."""
    return time_graph([fn] * GRAPH_CALLS) * 1e6


def compared_launch(n: int, committed: int, cache: str, overrides: dict, split_scale: float,
                    tq3_only: bool = False) -> dict | None:
    """The launch overrides of one COMPARED entry at (n, committed, cache), the default's tile and chunk unless
    overridden; None where a query-tile, register-cap or TQ3_0 candidate does not apply."""
    if (tq3_only and cache != "tq3_0") or (overrides.get("norm_before") and kv_type(cache).rotated):
        return None
    group_rows = HEADS // KV_HEADS * n
    quantized = KV_KINDS[kv_type(cache).name] > 0
    default_m, default_rows, *_ = _launch_defaults(group_rows, HEAD_DIM, quantized, tq3=cache == "tq3_0")
    if (("block_m" in overrides and default_m < 64 and not overrides.get("swap"))
            or ("max_registers" in overrides and group_rows > default_m)
            or (overrides.get("swap") and group_rows > overrides["block_m"])):
        return None
    launch = dict(overrides)
    if split_scale != 1:
        block_m = launch.get("block_m", default_m)
        m_tiles = -(-group_rows // block_m)
        launch["split"] = max(1, round(split_scale * choose_splits(committed + n, KV_HEADS, m_tiles,
                                                                   block_rows=launch.get("block_rows", default_rows),
                                                                   programs_per_sm=programs_per_sm(quantized, m_tiles))))
    return launch


def compare(baseline: str | None, cases: list[tuple[int, int, str]], names: list[str], deadline: float,
            query_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    old = None
    if baseline:
        spec = importlib.util.spec_from_file_location("tree_attention_baseline", baseline)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    rows = []
    for n, committed, cache in cases:
        args = model_inputs(n, committed, cache, query_dtype)
        reference = tree_attention(**args)
        k = args["k_cache"][:, : committed + n]
        row = {"tokens": n, "committed": committed, "cache": cache, "kv_bytes": 2 * k.numel() * k.element_size()}
        if old is not None:
            row["baseline"] = round(graph_timed(lambda: old.tree_attention(**args)), 1)
        for name, overrides, scale in COMPARED:
            if name not in names:
                continue
            launch = compared_launch(n, committed, cache, overrides, scale, tq3_only=name in TQ3_ONLY)
            if launch is None or time.time() > deadline:
                continue
            call = (normed_before(args, {k: v for k, v in launch.items() if k != "norm_before"})
                    if launch.get("norm_before") else lambda: tree_attention(**{**args, **launch}))
            try:
                out = call()
                error = ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
                us = graph_timed(call)
            except Exception as exc:  # noqa: BLE001 - out of shared memory / registers: not a candidate
                row[name] = str(exc).splitlines()[0][:60]
                continue
            row[name] = round(us, 1) if error < 2e-2 else f"{us:.1f} (error {error:.1e})"
        rows.append(row)
    return rows


def print_compared(rows: list[dict], names: list[str]) -> None:
    names = ["baseline"] + names
    print(f"{'T':>3} {'rows':>6} {'cache':>5} " + " ".join(f"{name:>{max(9, len(name))}}" for name in names)
          + f" {'best GB/s':>9}   (us per call; GB/s: the K/V bytes over the fastest)")
    for r in rows:
        times = [r[name] for name in names if isinstance(r.get(name), float)]
        rate = f"{r['kv_bytes'] / min(times) / 1e3:.0f}" if times and "kv_bytes" in r else "-"
        print(f"{r['tokens']:>3} {r['committed']:>6} {r['cache']:>5} "
              + " ".join(f"{str(r.get(name, '-')):>{max(9, len(name))}}" for name in names) + f" {rate:>9}")


def parse_cases(text: str) -> list[tuple[int, int, str]]:
    cases = []
    for item in text.split(","):
        try:
            tokens, rows, cache = item.split(":")
            cases.append((int(tokens), int(rows), kv_type(cache).name))
        except Exception as exc:  # noqa: BLE001 - any malformed item: one message naming it
            raise argparse.ArgumentTypeError(f"case {item!r} is not TOKENS:ROWS:CACHE ({exc})") from None
    return cases


def parse_candidates(text: str) -> list[str]:
    names = [name for name, _, _ in COMPARED]
    chosen = text.split(",")
    unknown = [name for name in chosen if name not in names]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown candidates {unknown}; COMPARED has {names}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=100.0)
    parser.add_argument("--compare", action="store_true", help="time COMPARED at COMPARE_CASES (see the docstring)")
    parser.add_argument("--baseline", help="with --compare: a tree_attention.py file timed at its defaults")
    parser.add_argument("--cases", type=parse_cases,
                        help="TOKENS:ROWS:CACHE[,...] instead of CASES (COMPARE_CASES with --compare), "
                             "e.g. 1:262144:tq3_0,23:65536:q8_0")
    parser.add_argument("--candidates", type=parse_candidates, default=[name for name, _, _ in COMPARED],
                        help="with --compare: NAME[,...] of COMPARED (default all)")
    parser.add_argument("--float32-query", action="store_true",
                        help="with --compare: the raw query and gate in float32, as the 27B engine's activations")
    parser.add_argument("--cuda-decode-from", type=int, default=attention_decode.MIN_ROWS,
                        help="rows from which a decode over TQ3_0 or Q8_0 rows takes the CUDA C kernel "
                             "(attention_decode)")
    parser.add_argument("--cuda-verify-from", type=int, default=attention_verify.MIN_ROWS,
                        help="rows from which a verify over TQ3_0 or Q8_0 rows takes the CUDA C kernel "
                             "(attention_verify)")
    args = parser.parse_args()
    attention_decode.MIN_ROWS = args.cuda_decode_from
    attention_verify.MIN_ROWS = args.cuda_verify_from
    if args.compare:
        rows = compare(args.baseline, args.cases or COMPARE_CASES, args.candidates, time.time() + args.budget_s,
                       torch.float32 if args.float32_query else torch.bfloat16)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print_compared(rows, args.candidates)
        return
    results = []
    cases = args.cases or CASES
    per_case = args.budget_s / len(cases)
    for case in cases:
        results.append(sweep_case(*case, deadline=time.time() + per_case))
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"{'T':>4} {'rows':>7} {'cache':>6} {'default us':>11} {'GB/s':>7} {'best us':>9} {'GB/s':>7}  best point")
    for r in results:
        b = r["best"] or {}
        point = {k: b[k] for k in ("block_m", "block_rows", "num_warps", "num_stages", "split") if k in b}
        print(f"{r['tokens']:>4} {r['committed']:>7} {r['cache']:>6} {r['default_us']:>11} {r['default_GBps']:>7} "
              f"{b.get('us', '-'):>9} {r['best_GBps'] or '-':>7}  {point}  ({len(r['points'])} points)")


if __name__ == "__main__":
    main()
