#!/usr/bin/env python3
"""Q6_K (default) or Q4_K at 2-64 rows of x on the GPU: the bf16 token-column kernel (qmm) against the float16
kernel (qmh, its x conversion included) at several launch shapes, and dense bf16 cuBLAS as the peer, at the 27B
shapes (Q6_K: the FFN down projections, attention V and the LM head, the head at 16 and 23 rows only).

    python3 benchmarks/sweep_mma_rows.py [--types Q6_K,Q4_K] [--out rows.json]

Each point is timed the way `flashtree bench --kernels` times one (CUDA graph, weights rotated past the
L2) and checked against the float32 dequantization (max |error| / max |reference|). Prints one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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

ROWS = (2, 8, 16, 23, 32, 64)
# per type: label -> (n, k, row counts)
SHAPES = {
    QType.Q6_K: {"down 5120x17408": (5120, 17408, ROWS), "v 1024x5120": (1024, 5120, ROWS),
                 "head 248320x5120": (248320, 5120, (16, 23))},
    QType.Q4_K: {"gate/up 17408x5120": (17408, 5120, ROWS), "down 5120x17408": (5120, 17408, ROWS),
                 # the model's fused matrices: the FFN's gate and up, a DeltaNet layer's qkv, z, beta and alpha
                 "gate+up 34816x5120": (34816, 5120, ROWS), "qkvz 16480x5120": (16480, 5120, ROWS),
                 "q+gate 12288x5120": (12288, 5120, ROWS), "kv 1024x5120": (1024, 5120, ROWS),
                 "out 5120x6144": (5120, 6144, ROWS)},
}
# qmh's other launch shapes (row tiles, warps, splits as a multiple of the default's, chains, CTAs per SM asked
# of ptxas: one row tile at 3 or 4 CTAs per SM spills 16-64 bytes at 3-4 token groups, sm_90, NVRTC 13.5; x loaded
# a sub-block ahead)
# (the shapes that lost at every point of the sweeps through 2026-12-01's eighth session are left out: two
# tiles at 4 warps, 8 warps, one chain without a CTA target, split K, 4 CTAs per SM; docs/runs/h200-2026-12-01-s8)
QMH_ALTERNATIVES = ((1, 4, 1, 2, 0, 0), (1, 4, 1, 2, 3, 0), (1, 4, 1, 2, 3, 1), (1, 4, 1, 1, 3, 1))


# qmh with warps owning row tiles of their own (x from L2 once per CTA; own 1: through L1, 2: staged in shared
# memory): rt, warps, splits (absolute), chains, CTAs per SM asked of ptxas, x ahead, own
OWN_ALTERNATIVES = ((1, 4, 2, 2, 3, 1, 1), (1, 4, 4, 2, 3, 1, 1), (1, 4, 2, 1, 3, 1, 1),
                    (1, 4, 1, 2, 3, 0, 2), (1, 4, 2, 2, 3, 0, 2), (1, 4, 4, 2, 3, 0, 2), (1, 4, 8, 2, 3, 0, 2),
                    (1, 4, 2, 1, 3, 0, 2), (1, 4, 4, 1, 3, 0, 2), (1, 8, 2, 2, 0, 0, 2), (1, 8, 4, 2, 0, 0, 2),
                    (1, 4, 4, 2, 4, 0, 2))


# qmv's: accumulator chains, CTAs per SM asked of ptxas
QMV_ALTERNATIVES = ((2, 0), (4, 0), (2, 5), (1, 6))

# `--ring`, in place of the alternatives above: qmh with the weights through a shared-memory ring, whose freed
# registers let a warp take two row tiles (x's fragments used twice): rt, chains, CTAs per SM asked of ptxas, own,
# splits as a multiple of the default's, ring stages, x ahead (None: the default's); qmv at ring stages (CTAs per SM
# asked: 0 the default's)
RING_ALTERNATIVES = ((1, 2, 3, None, 1, 2, None), (2, 1, 3, 0, 1, 2, 0), (2, 1, 3, 0, 1, 2, 1), (2, 1, 0, 0, 1, 2, 0),
                     (2, 1, 0, 0, 1, 2, 1), (2, 1, 0, 2, 1, 2, None))
QMV_RING_ALTERNATIVES = ((2, 0), (3, 0))
# `--one-cta`, in place of the alternatives above, on the wide Q4_K matrices at 9-32 rows: the launch of one CTA an SM
# (`mma._own_tiles_one_cta_an_sm`, the default) against the two-tile ring before it (FLASHTREE_QMH_ONE_CTA=0) and its
# other forms: rt, chains, ring stages, CTAs an SM (the warps then cover the tiles in that many CTAs an SM); then the
# one-CTA forms again with x staged by a warp of their own (own_tiles 4, untimed when built: thirty-first session)
ONE_CTA_ALTERNATIVES = ((1, 1, 2, 1), (1, 1, 3, 1), (1, 1, 4, 1), (1, 2, 3, 1), (2, 1, 2, 1), (2, 1, 3, 1),
                        (1, 1, 2, 2), (1, 1, 3, 2))
# `--narrow`, in place of the alternatives above, on the narrow matrices (the FFN down and out projections: 320 row
# tiles, fewer than 3 an SM): the default launch against warps owning tiles with x staged in shared memory and K
# split, in these forms: warps, splits, chains, ring stages, CTAs an SM asked of ptxas, the splits' sums through a
# thread-block cluster (`MMAConfig.cluster_splits`) or through global partials and a ticket. H100, thirtieth session:
# no cluster form won (Q4_K down at 23 rows: 8 warps split 3 ways 49.5 us, 16 warps split 6 ways 57.7, against 42.3;
# a cluster of 3-8 one-CTA-an-SM CTAs must fit one GPC, whose spare SMs then idle). The ticket forms (thirty-second
# session, two H100 runs): Q4_K down at 16 / 23 / 32 rows 2-10 % faster than the default, the out projection and
# Q6_K's down slower: not taken (docs/PERFORMANCE.md)
NARROW_ALTERNATIVES = ((16, 6, 2, 2, 0, False), (16, 6, 1, 3, 0, False), (20, 8, 1, 2, 0, False),
                       (10, 4, 1, 3, 0, False), (10, 4, 2, 3, 0, False), (8, 3, 2, 3, 0, False),
                       (8, 6, 2, 2, 2, False), (4, 3, 2, 3, 2, False), (4, 3, 2, 3, 2, True))
# `--resident`, in place of the alternatives above, on the LM head at 2-24 rows: x resident in shared memory, warps
# walking whole tiles grid-wide (`mma._RESIDENT_X_HEAD`, the default at 9-16 rows; 24 do not fit) against
# the launch without it and these other forms: own tiles (3: x resident; 2: x staged a super-block at a time for a
# CTA of that many warps a tile each, 970 CTAs of 16 on the head, which also fits 17-24 rows), warps, chains, ring
# stages. The head's launches today read x once per 32 rows (2-16 rows: 16, 2 warps splitting K): 1.9 GB of x at 23
# rows against 1.04 GB of weights; 16 warps owning tiles read it once per 256 rows (238 MB)
RESIDENT_ALTERNATIVES = ((3, 16, 2, 0), (3, 8, 2, 0), (3, 16, 1, 0), (3, 12, 2, 0), (3, 8, 2, 2),
                         (2, 16, 1, 3), (2, 16, 1, 2), (2, 16, 2, 2), (2, 8, 2, 3))
# and what `choose_config` took on these matrices before the ring (by token groups): the register-buffered qmh
PRE_RING = {2: mma.MMAConfig(1, 4, 1, 2), 3: mma.MMAConfig(1, 4, 1, 2, min_blocks=3, own_tiles=2),
            4: mma.MMAConfig(1, 4, 1, 2, min_blocks=3, own_tiles=2)}


def _label(kernel: str, c: mma.MMAConfig) -> str:
    return (f"{kernel} r{c.rt}w{c.warps}s{c.splits}c{c.chains}" + (f"b{c.min_blocks}" if c.min_blocks else "")
            + (f"x{c.x_ahead}" if c.x_ahead else "") + (f"own{c.own_tiles}" if c.own_tiles else "")
            + ("cl" if c.cluster_splits else "") + (f"g{c.ring}" if c.ring else ""))


def ring_variants(default: mma.MMAConfig, kernel: str, n: int, k: int, rows: int) -> list[tuple[str, str, mma.MMAConfig]]:
    if kernel == "qmv":
        configs = [dataclasses.replace(default, ring=ring, min_blocks=blocks or default.min_blocks)
                   for ring, blocks in QMV_RING_ALTERNATIVES]
    else:
        configs = [dataclasses.replace(default, rt=rt, chains=chains, min_blocks=blocks,
                                       own_tiles=default.own_tiles if own is None else own,
                                       splits=splits * default.splits, ring=ring,
                                       x_ahead=default.x_ahead if ahead is None else ahead)
                   for rt, chains, blocks, own, splits, ring, ahead in RING_ALTERNATIVES]
        if default.ring:
            configs.append(PRE_RING[mma.token_groups(rows)])
    return [(_label(kernel, c), kernel, c) for c in configs
            if c != default and n % c.rows_per_cta == 0 and (k // 256) >= 2 * c.splits]


def one_cta_variants(default: mma.MMAConfig, qtype: QType, n: int, k: int, rows: int,
                     sms: int) -> list[tuple[str, str, mma.MMAConfig]]:
    """The one-CTA-an-SM launch's other forms (`ONE_CTA_ALTERNATIVES`, those whose registers and shared memory fit)
    and the launch before it."""
    os.environ["FLASHTREE_QMH_ONE_CTA"] = "0"
    try:
        configs = [mma.choose_config(qtype, rows, n, k, sms)]
    finally:
        del os.environ["FLASHTREE_QMH_ONE_CTA"]
    tiles, tg = n // 16, mma.token_groups(rows)
    for rt, chains, ring, per_sm in ONE_CTA_ALTERNATIVES:
        warps = -(-tiles // (rt * per_sm * sms))
        c = mma.MMAConfig(rt, warps, 1, chains, min_blocks=per_sm if per_sm > 1 else 0, own_tiles=2, ring=ring)
        fits = per_sm * (c.ring_bytes(qtype) + mma._shared_x_bytes(tg)) <= 227 * 1024 and warps * per_sm <= 32
        if fits and tiles % rt == 0 and c not in configs:
            configs.append(c)
    # and each form of one CTA an SM with x staged by a warp of its own (own_tiles 4, `mma.x_producer_enabled`), or
    # where the default is that form, with the CTA barrier
    for c in (default, *configs):
        twin = dataclasses.replace(c, own_tiles={2: 4, 4: 2}.get(c.own_tiles, c.own_tiles))
        if c.own_tiles in (2, 4) and c.splits == 1 and not c.min_blocks and c.warps < 32 and twin not in configs:
            configs.append(twin)
    return [(_label("qmh", c), "qmh", c) for c in configs if c != default]


def _without_and_with(switch: str, qtype: QType, n: int, k: int, rows: int, sms: int) -> list[mma.MMAConfig]:
    """`choose_config`'s launch with the environment switch at 0, then at 1 (the switch left as it was)."""
    before = os.environ.get(switch)
    configs = []
    try:
        for value in ("0", "1"):
            os.environ[switch] = value
            configs.append(mma.choose_config(qtype, rows, n, k, sms))
    finally:
        if before is None:
            del os.environ[switch]
        else:
            os.environ[switch] = before
    return configs


def resident_variants(default: mma.MMAConfig, qtype: QType, n: int, k: int, rows: int,
                      sms: int) -> list[tuple[str, str, mma.MMAConfig]]:
    """The launch without x resident (FLASHTREE_QMH_RESIDENT_X=0), the one with it (=1), and the
    `RESIDENT_ALTERNATIVES` whose shared memory fits."""
    configs = _without_and_with("FLASHTREE_QMH_RESIDENT_X", qtype, n, k, rows, sms)
    configs += [mma.MMAConfig(1, warps, 1, chains, own_tiles=own, ring=ring)
                for own, warps, chains, ring in RESIDENT_ALTERNATIVES]
    tg = mma.token_groups(rows)
    static = {2: mma._shared_x_bytes(tg)}  # own tiles 2's x stages (static shared memory)
    return [(_label("qmh", c), "qmh", c) for c in dict.fromkeys(configs)
            if c != default and n % (16 * c.rt) == 0
            and c.dynamic_shared_bytes(qtype, tg, k) + static.get(c.own_tiles, 0) <= 227 * 1024]


def narrow_variants(default: mma.MMAConfig, n: int, k: int) -> list[tuple[str, str, mma.MMAConfig]]:
    """The `NARROW_ALTERNATIVES` that divide the matrix's tiles and leave every split a super-block."""
    configs = [mma.MMAConfig(1, warps, splits, chains, min_blocks=blocks, own_tiles=2, ring=ring, cluster=cluster)
               for warps, splits, chains, ring, blocks, cluster in NARROW_ALTERNATIVES]
    return [(_label("qmh", c), "qmh", c) for c in configs
            if c != default and n % c.rows_per_cta == 0 and k // 256 >= c.splits]


def variants(qtype: QType, m: int, n: int, k: int, ring: bool = False, one_cta: bool = False, narrow: bool = False,
             resident: bool = False) -> list[tuple[str, str, mma.MMAConfig]]:
    """qmm and qmh in their own launch shapes (marked *), and qmh at the other shapes that fit the matrix; one
    row: qmv in its own shape and at the other chain counts and CTA targets. `ring`: the defaults' weight-ring
    forms instead of the other shapes."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if m == 1:  # decode: the one-row kernel, at more accumulator chains and CTAs per SM
        c = mma.choose_config(qtype, 1, n, k, sms)
        out = [(_label("qmv", c) + "*", "qmv", c)]
        if ring:
            return out + ring_variants(c, "qmv", n, k, m)
        for chains, min_blocks in QMV_ALTERNATIVES:
            alt = mma.MMAConfig(c.rt, c.warps, c.splits, chains, min_blocks)
            if alt != c:
                out.append((_label("qmv", alt), "qmv", alt))
        return out
    rows = min(m, mma.MAX_M)
    out = []
    for kernel in ("qmm", "qmh"):
        c = mma.choose_config(qtype, rows, n, k, sms, kernel=kernel)
        out.append((_label(kernel, c) + "*", kernel, c))
    default = out[-1][2]
    if ring:
        return out + ring_variants(default, "qmh", n, k, m)
    if one_cta:
        return out + one_cta_variants(default, qtype, n, k, rows, sms)
    if narrow:
        return out + narrow_variants(default, n, k)
    if resident:
        return out + resident_variants(default, qtype, n, k, rows, sms)
    for rt, warps, split, chains, min_blocks, x_ahead in QMH_ALTERNATIVES:
        c = mma.MMAConfig(rt, warps, split * default.splits, chains, min_blocks, x_ahead)
        if c != default and n % (16 * rt) == 0 and (k // 256) >= warps * c.splits:
            out.append((_label("qmh", c), "qmh", c))
    for rt, warps, splits, chains, min_blocks, x_ahead, own in OWN_ALTERNATIVES:
        c = mma.MMAConfig(rt, warps, splits, chains, min_blocks, x_ahead, own)
        if c != default and n % c.rows_per_cta == 0 and (k // 256) >= 2 * splits:
            out.append((_label("qmh", c), "qmh", c))
    return out


def precompile(types: list[QType], arch: str, ring: bool, one_cta: bool, narrow: bool, resident: bool) -> None:
    """Every instance the sweep launches, and qmh's x conversions, compiled in parallel into the on-disk cache."""
    jobs = {}
    for qtype in types:
        jobs[mma._prep_x_instance(qtype)] = mma._prep_x_wrapper(qtype)
        for n, k, rows in SHAPES[qtype].values():
            for m in rows:
                tg = mma.token_groups(min(m, mma.MAX_M))
                for _, kernel, c in variants(qtype, m, n, k, ring, one_cta, narrow, resident):
                    name = mma._instance(qtype, c, tg, kernel)
                    jobs[name] = mma._wrapper(name, qtype, c, tg, kernel)
    mma.precompile(list(jobs.items()), arch)


def sweep_shape(qtype: QType, label: str, n: int, k: int, rows, read_bps: float, deadline: float,
                results: dict, ring: bool, one_cta: bool, narrow: bool, resident: bool) -> None:
    first = random_quant_weight(qtype, n, k, "cuda", seed=0)
    weights = [first] + [random_quant_weight(qtype, n, k, "cuda", seed=i) for i in range(1, rotation(first.nbytes))]
    dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(rotation(n * k * 2))]
    floor = first.nbytes / read_bps
    for m in rows:
        if time.time() > deadline:
            print("budget spent", flush=True)
            break
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        ref = quant_matmul_reference(x, first).float()
        cells = []
        us = time_graph([lambda w=w: F.linear(x, w) for w in dense]) * 1e6
        cells.append(f"bf16 {us:.1f}")
        results["points"].append({"type": qtype.name, "matrix": label, "rows": m, "variant": "dense bf16", "us": us})
        for name, kernel, config in variants(qtype, m, n, k, ring, one_cta, narrow, resident):
            try:
                out = mma.matmul(x, first.raw, qtype, n, k, config, kernel).float()
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the sweep goes on
                cells.append(f"{name}: FAIL {str(e)[:80]}")
                continue
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            us = time_graph([lambda w=w: mma.matmul(x, w.raw, qtype, n, k, config, kernel) for w in weights]) * 1e6
            results["points"].append({"type": qtype.name, "matrix": label, "rows": m, "variant": name, "us": us,
                                      "of_bw": floor * 1e6 / us, "err": err})
            cells.append(f"{name}: {us:.1f} ({100 * floor * 1e6 / us:.0f}%) {err:.0e}")
        print(f"{qtype.name} {label:20} {m:3d}  " + " | ".join(cells), flush=True)
    del weights, dense, first
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="Q6_K", help="comma-separated: Q6_K, Q4_K")
    parser.add_argument("--out", default="rows.json")
    parser.add_argument("--budget-s", type=float, default=360)
    parser.add_argument("--rows", default=None, help="comma-separated row counts (default: each shape's own)")
    parser.add_argument("--matrices", default=None, help="comma-separated matrix labels' first words (gate/up, down, ...)")
    parser.add_argument("--ring", action="store_true", help="the defaults against their weight-ring forms only")
    parser.add_argument("--one-cta", action="store_true",
                        help="Q4_K's one-CTA-an-SM launch against the launch before it and its other forms only")
    parser.add_argument("--narrow", action="store_true",
                        help="the narrow matrices' K split for warps owning tiles against the defaults only")
    parser.add_argument("--resident", action="store_true",
                        help="the LM head at 2-24 rows: x resident in shared memory (the default at 9-16) "
                             "against its other forms")
    args = parser.parse_args()
    types = [QType[name] for name in args.types.split(",")]
    for qtype in types:
        chosen = {label: (n, k, tuple(int(r) for r in args.rows.split(",")) if args.rows else rows)
                  for label, (n, k, rows) in SHAPES[qtype].items()
                  if args.matrices is None or label.split()[0] in args.matrices.split(",")}
        SHAPES[qtype] = chosen
    t0 = time.time()
    precompile(types, mma.arch_of(torch.device("cuda")), args.ring, args.one_cta, args.narrow, args.resident)
    print(f"compiled in {time.time() - t0:.0f} s; * = the kernel's own launch shape", flush=True)
    read_bps = read_bandwidth(torch.device("cuda"))
    print(f"read bandwidth {read_bps / 1e12:.2f} TB/s", flush=True)
    results = {"read_tbs": read_bps / 1e12, "points": []}
    for qtype in types:
        for label, (n, k, rows) in SHAPES[qtype].items():
            sweep_shape(qtype, label, n, k, rows, read_bps, t0 + args.budget_s, results, args.ring, args.one_cta,
                        args.narrow, args.resident)
            Path(args.out).write_text(json.dumps(results, indent=2))
    print_summary(results["points"])
    return 0


def print_summary(points: list[dict]) -> None:
    """Per matrix and row count: the default (the qmh or qmv marked *) and the fastest other variant, us (% of
    the bandwidth)."""
    print("\nsummary: default* against the fastest other variant")
    cells: dict[tuple, list[dict]] = {}
    for p in points:
        if p["variant"] != "dense bf16":
            cells.setdefault((p["type"], p["matrix"], p["rows"]), []).append(p)
    for (qtype, matrix, rows), group in cells.items():
        marked = [p for p in group if p["variant"].endswith("*") and not p["variant"].startswith("qmm")]
        if not marked:
            continue
        default = marked[0]
        others = [p for p in group if p is not default and not p["variant"].startswith("qmm")]
        best = min(others, key=lambda p: p["us"], default=None)
        line = f"{qtype} {matrix:20} {rows:3d}  {default['variant']:28} {default['us']:7.1f} ({100 * default['of_bw']:.0f}%)"
        if best:
            line += f"  | {best['variant']:28} {best['us']:7.1f} ({100 * best['of_bw']:.0f}%) {default['us'] / best['us']:.2f}x"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
