#!/usr/bin/env python3
"""Does qmh's time follow its CTA count in waves? One launch shape (the gate/up matrix's at M rows) timed on
matrices of 1 to 4 CTAs per SM, K 5120, and the same matrices with the CTAs sharing the (row group, super-block)
units equally (`MMAConfig.stream`, 3 CTAs per SM); then the 27B model's wide Q4_K verify matrices (gate + up fused,
q + gate) both ways. If a matrix whose CTAs leave a few SMs a third CTA takes as long as one where every SM has
three, the tail of uneven CTAs per SM sets the time, not the bytes.

    python3 benchmarks/probe_waves.py [--rows 23,1] [--out waves.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

from flashtree.bench.kernels import rotation, time_graph  # noqa: E402
from flashtree.bench.steps import read_bandwidth  # noqa: E402
from flashtree.kernels.quant_matmul import mma, quant_matmul_reference, random_quant_weight  # noqa: E402

K, QTYPE = 5120, QType.Q4_K
MODEL_ROWS = {"gate+up 34816x5120": 34816, "q+gate 12288x5120": 12288}


def time_point(label: str, m: int, n: int, kernel: str, config: mma.MMAConfig, read_bps: float, sms: int) -> dict:
    first = random_quant_weight(QTYPE, n, K, "cuda", seed=0)
    weights = [first] + [random_quant_weight(QTYPE, n, K, "cuda", seed=i) for i in range(1, rotation(first.nbytes))]
    x = torch.randn(m, K, dtype=torch.bfloat16, device="cuda")
    ref = quant_matmul_reference(x.float(), first)
    err = ((mma.matmul(x, first.raw, QTYPE, n, K, config, kernel).float() - ref).abs().max() / ref.abs().max()).item()
    us = time_graph([lambda w=w: mma.matmul(x, w.raw, QTYPE, n, K, config, kernel) for w in weights]) * 1e6
    floor = first.nbytes / read_bps * 1e6
    ctas = mma.stream_ctas(config, n, K, sms) if config.stream else n // config.rows_per_cta * config.splits
    print(f"{label:20} {kernel} rows {m:2d} n {n:6d}{' stream' if config.stream else '       '} CTAs {ctas:5d} "
          f"({ctas / sms:5.2f}/SM): {us:6.1f} us, floor {floor:5.1f} ({100 * floor / us:3.0f}%), err {err:.0e}",
          flush=True)
    del weights, first
    torch.cuda.empty_cache()
    return {"label": label, "rows": m, "n": n, "stream": config.stream, "ctas": ctas, "us": us, "floor_us": floor,
            "err": err}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="23,1")
    parser.add_argument("--out", default="waves.json")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    read_bps = read_bandwidth(torch.device("cuda"))
    print(f"read bandwidth {read_bps / 1e12:.2f} TB/s, {sms} SMs")
    points = []
    for m in (int(r) for r in args.rows.split(",")):
        kernel = "qmv" if m == 1 else "qmh"
        config = mma.choose_config(QTYPE, m, 17408, K, sms)
        variants = [config] + ([replace(config, stream=3)] if config.own_tiles == 2 else [])
        per_sm = 8 if m == 1 else 1  # qmv's CTAs hold 16 rows: 8 per SM at the 27B shapes
        for share in (1, 1.5, 2, 2 + 8 / sms, 2.5, 3, 3 + 8 / sms, 4):
            n = round(share * per_sm * sms) * config.rows_per_cta
            points += [time_point("waves", m, n, kernel, c, read_bps, sms) for c in variants]
        if m > 1:
            for label, n in MODEL_ROWS.items():
                model = mma.choose_config(QTYPE, m, n, K, sms)
                points += [time_point(label, m, n, kernel, c, read_bps, sms)
                           for c in [model] + ([replace(model, stream=3)] if model.own_tiles == 2 else [])]
    Path(args.out).write_text(json.dumps({"read_tbs": read_bps / 1e12, "points": points}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
