#!/usr/bin/env python3
"""Where the time of Q4_K's float16 kernel (qmh) goes, on the GPU: the kernel as shipped against copies of
mma.cu with one part taken out (x's loads, the MMAs, the weight decoding, the weight loads after the first
super-block), at the 27B shapes and 16/23/32 rows. The results are wrong by design; only the times count.

    python3 benchmarks/ablate_qmh.py [--out ablate.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402

from flashtree.bench.kernels import rotation, time_graph  # noqa: E402
from flashtree.bench.steps import read_bandwidth  # noqa: E402
from flashtree.kernels.quant_matmul import mma, random_quant_weight  # noqa: E402
from sweep_mma_variants import _compile, _load  # noqa: E402

QT = QType.Q4_K
SHAPES = {"gate/up 17408x5120": (17408, 5120), "down 5120x17408": (5120, 17408)}
ROWS = (16, 23, 32)
# (label, text in mma.cu, its replacement): each takes one part out of qmh's main loop
ABLATIONS = {
    "shipped": None,
    "no x loads": ("const uint4 v = __ldg(xb[tg] + 4 * j);", "const uint4 v = make_uint4(j, j + 1, j + 2, tg);"),
    "no MMAs": ("for (int tg = 0; tg < TG; ++tg) mma_f16(p[s % CH][rt][tg], a, bx[tg][u][0], bx[tg][u][1]);",
                "for (int tg = 0; tg < TG; ++tg) p[s % CH][rt][tg][0] += __uint_as_float(a[0] ^ a[1] ^ a[2] ^ a[3] ^ bx[tg][u][0] ^ bx[tg][u][1]);"),
    "no decode": ("a[0] = hfma2(and_or<0x000F000Fu>(lo, k.f16_1024), sc0, c0);", "a[0] = lo ^ sc0 ^ c0;"),
    "no weight loads": ("if (sb + WARPS < end) load_weights<QT, RT>(quants, high, scales, dvals, tile0, SB, sb + WARPS, lane, g, w1);",
                        "if (sb + WARPS < end) w1 = w0;"),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="ablate.json")
    args = parser.parse_args()
    shipped = mma.source()
    arch = mma.arch_of(torch.device("cuda"))
    sources = {}
    for label, patch in ABLATIONS.items():
        if patch is None:
            sources[label] = shipped
            continue
        assert patch[0] in shipped, label
        text = shipped.replace(patch[0], patch[1])
        if label == "no decode":  # the other three A registers too
            for r, (mask, word) in enumerate((("0x00F000F0u", "lo"), ("0x000F000Fu", "lo8"), ("0x00F000F0u", "lo8")), 1):
                sc, c = ("sc0", "c0") if r == 2 else ("sc1", "c1")
                text = text.replace(f"a[{r}] = hfma2(and_or<{mask}>({word}, k.f16_1024), {sc}, {c});",
                                    f"a[{r}] = {word} ^ {sc} ^ {c};")
        if label == "no weight loads":
            text = text.replace("if (sb + WARPS < end) load_weights<QT, RT>(quants, high, scales, dvals, tile0, SB, sb + WARPS, lane, g, w0);",
                                "if (sb + WARPS < end) w0 = w1;")
        sources[label] = text
    jobs, plan = {}, []
    for n, k in SHAPES.values():
        for m in ROWS:
            c, tg = mma.choose_config(QT, m, n, k), mma.token_groups(m)
            for i, label in enumerate(sources):
                name = f"ab{i}_" + mma._instance(QT, c, tg, "qmh")
                jobs[name] = (sources[label] + mma._wrapper(name, QT, c, tg, "qmh"), label)
            plan.append((n, k, m, c, tg))
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor() as pool:
        cubins = dict(pool.map(_compile, [(name, src, arch) for name, (src, _) in jobs.items()]))
    read_bps = read_bandwidth(torch.device("cuda"))
    print(f"read bandwidth {read_bps / 1e12:.2f} TB/s; us per call (share of the bandwidth)", flush=True)
    results = []
    for (label_shape, (n, k)) in SHAPES.items():
        first = random_quant_weight(QT, n, k, "cuda", seed=0)
        weights = [first] + [random_quant_weight(QT, n, k, "cuda", seed=i) for i in range(1, rotation(first.nbytes))]
        floor = first.nbytes / read_bps
        for m in ROWS:
            c, tg = mma.choose_config(QT, m, n, k), mma.token_groups(m)
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            xh, sums, scale = mma.prepare_x(x, QT)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            cells = []
            for i, label in enumerate(sources):
                name = f"ab{i}_" + mma._instance(QT, c, tg, "qmh")
                if isinstance(cubins[name], str):
                    cells.append(f"{label}: FAIL")
                    print(cubins[name][-600:])
                    continue
                fn = _load(cubins[name], name, 0)

                def call(w, fn=fn):
                    p = mma.pieces_of(w.raw, QT, n, k)
                    mma.launch(fn, (n // (16 * c.rt), c.splits), 32 * c.warps,
                                [xh, sums, scale, p["quants"], p["scales"], out, out, mma._tickets(x.device, 0), m, n, k],
                                x.device)

                us = time_graph([lambda w=w: call(w) for w in weights]) * 1e6
                results.append({"matrix": label_shape, "rows": m, "ablation": label, "us": us})
                cells.append(f"{label}: {us:.1f} ({100 * floor * 1e6 / us:.0f}%)")
            print(f"{label_shape:20} {m:3d}  " + " | ".join(cells), flush=True)
        del weights, first
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
