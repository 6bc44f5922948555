#!/usr/bin/env python3
"""Does qmh's time follow its CTA count in waves? One launch shape (the gate/up matrix's at M rows) timed on
matrices of 1 to 3 CTAs per SM, K 5120: if a matrix whose CTAs leave a few SMs a third CTA takes as long as one
where every SM has three, the tail of uneven CTAs per SM sets the time, not the bytes.

    python3 benchmarks/probe_waves.py [--rows 23] [--out waves.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

from flashtree.bench.kernels import rotation, time_graph  # noqa: E402
from flashtree.bench.steps import read_bandwidth  # noqa: E402
from flashtree.kernels.quant_matmul import mma, random_quant_weight  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="23,1")
    parser.add_argument("--out", default="waves.json")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k, qtype = 5120, QType.Q4_K
    read_bps = read_bandwidth(torch.device("cuda"))
    print(f"read bandwidth {read_bps / 1e12:.2f} TB/s, {sms} SMs")
    points = []
    for m in (int(r) for r in args.rows.split(",")):
        kernel = "qmv" if m == 1 else "qmh"
        config = mma.choose_config(qtype, m, 17408, k, sms)
        per_sm = 8 if m == 1 else 1  # qmv's CTAs hold 16 rows: 8 per SM at the 27B shapes
        for share in (1, 1.5, 2, 2 + 8 / sms, 2.5, 3, 3 + 8 / sms, 4):
            n = round(share * per_sm * sms) * config.rows_per_cta
            ctas = n // config.rows_per_cta * config.splits
            first = random_quant_weight(qtype, n, k, "cuda", seed=0)
            weights = [first] + [random_quant_weight(qtype, n, k, "cuda", seed=i) for i in range(1, rotation(first.nbytes))]
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            us = time_graph([lambda w=w: mma.matmul(x, w.raw, qtype, n, k, config, kernel) for w in weights]) * 1e6
            floor = first.nbytes / read_bps * 1e6
            points.append({"rows": m, "n": n, "ctas": ctas, "us": us, "floor_us": floor})
            print(f"{kernel} rows {m:2d} n {n:6d} CTAs {ctas:5d} ({ctas / sms:.2f}/SM): "
                  f"{us:6.1f} us, floor {floor:5.1f} ({100 * floor / us:.0f}%), {us / n * 1e3:.2f} ns/row", flush=True)
            del weights, first
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"read_tbs": read_bps / 1e12, "points": points}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
