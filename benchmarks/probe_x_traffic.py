#!/usr/bin/env python3
"""Does reading x from L2 add to a skinny matmul's weight stream? A probe of qmh's access pattern at the 27B's fused
gate + up (34816 x 5120 Q4_K, 100 MB): 1088 programs of 4 warps, each walking the 20 super-blocks of K and reading,
per super-block, its own 32 rows of weights (4608 bytes) and all of x's (8, 16, 24 or 32 rows x 512 bytes), the
bytes summed so that none is skipped. docs/PERFORMANCE.md (twenty-seventh session) fits the sweeps' 23-row times as
the weights at the read bandwidth plus x's re-reads at ~7.3 TB/s, added; this measures the two streams alone and
together, without the MMAs.

    python3 benchmarks/probe_x_traffic.py [--out probe.json]
    TRITON_INTERPRET=1 python3 benchmarks/probe_x_traffic.py --check    (CPU: the kernel's sums against torch's)

Each point: us per launch in a CUDA graph, the weights rotated past the L2 (`flashtree bench --kernels` timing), x
one buffer (hot in L2, as the real kernel's). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

CTAS, STEPS = 1088, 20  # 34816 rows / 32 a CTA; K 5120 / 256
WEIGHT_WORDS = 32 * 256 * 9 // 16 // 4  # 32 rows x 256 Q4_K values (4.5 bits) a super-block, in 32-bit words
X_ROW_WORDS = 256 * 2 // 4  # a token row's 256 float16 values a super-block


@triton.jit
def _probe_kernel(w_ptr, x_ptr, out_ptr, STEPS: tl.constexpr, W_WORDS: tl.constexpr, X_WORDS: tl.constexpr,
                  BLOCK_W: tl.constexpr, BLOCK_X: tl.constexpr):
    pid = tl.program_id(0)
    acc_w = tl.zeros([BLOCK_W], tl.int32)
    acc_x = tl.zeros([BLOCK_X], tl.int32)
    w_offs, x_offs = tl.arange(0, BLOCK_W), tl.arange(0, BLOCK_X)
    for step in range(STEPS):
        if W_WORDS > 0:
            acc_w += tl.load(w_ptr + (pid.to(tl.int64) * STEPS + step) * W_WORDS + w_offs, mask=w_offs < W_WORDS,
                             other=0)
        if X_WORDS > 0:
            acc_x += tl.load(x_ptr + step * X_WORDS + x_offs, mask=x_offs < X_WORDS, other=0)
    tl.store(out_ptr + pid, tl.sum(acc_w, 0) + tl.sum(acc_x, 0))


def probe(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, ctas: int, steps: int, w_words: int,
          x_words: int) -> None:
    _probe_kernel[(ctas,)](w, x, out, STEPS=steps, W_WORDS=w_words, X_WORDS=x_words,
                           BLOCK_W=triton.next_power_of_2(max(w_words, 1)),
                           BLOCK_X=triton.next_power_of_2(max(x_words, 1)), num_warps=4)


def check() -> int:
    """Small sizes on the CPU interpreter: each program's sum is its weights' and all of x's (int32, wrapping)."""
    ctas, steps, w_words, x_words = 3, 2, 36, 20
    w = torch.randint(-1000, 1000, (ctas * steps * w_words,), dtype=torch.int32)
    x = torch.randint(-1000, 1000, (steps * x_words,), dtype=torch.int32)
    out = torch.empty(ctas, dtype=torch.int32)
    probe(w, x, out, ctas, steps, w_words, x_words)
    want = w.view(ctas, -1).sum(1, dtype=torch.int32) + x.sum(dtype=torch.int32)
    ok = torch.equal(out, want)
    print("probe sums", "equal" if ok else f"differ: {out.tolist()} against {want.tolist()}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="probe.json")
    parser.add_argument("--check", action="store_true", help="the kernel's sums at small sizes (the interpreter)")
    args = parser.parse_args()
    if args.check:
        return check()
    from flashtree.bench.kernels import rotation, time_graph
    from flashtree.bench.steps import read_bandwidth

    bandwidth = read_bandwidth(torch.device("cuda"))
    weight_bytes = CTAS * STEPS * WEIGHT_WORDS * 4
    weights = [torch.randint(-9, 9, (CTAS * STEPS * WEIGHT_WORDS,), dtype=torch.int32, device="cuda")
               for _ in range(rotation(weight_bytes))]
    x = torch.randint(-9, 9, (STEPS * 32 * X_ROW_WORDS,), dtype=torch.int32, device="cuda")
    out = torch.empty(CTAS, dtype=torch.int32, device="cuda")

    def us(w_words: int, x_words: int) -> float:
        return time_graph([lambda w=w: probe(w, x, out, CTAS, STEPS, w_words, x_words) for w in weights]) * 1e6

    weights_only = us(WEIGHT_WORDS, 0)
    rows = [{"x_rows": 0, "x_MB": 0.0, "weights_us": weights_only}]
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s; weights {weight_bytes / 1e6:.1f} MB: {weights_only:.1f} us "
          f"(floor {weight_bytes / bandwidth * 1e6:.1f})")
    print(f"{'x rows':>6} {'x MB':>7} {'x only':>8} {'both':>8} {'both - weights':>15} {'x MB / added':>13}")
    for x_rows in (8, 16, 24, 32):
        x_words = x_rows * X_ROW_WORDS
        x_only, both = us(0, x_words), us(WEIGHT_WORDS, x_words)
        x_mb = CTAS * STEPS * x_words * 4 / 1e6
        added = both - weights_only
        rows.append({"x_rows": x_rows, "x_MB": x_mb, "x_only_us": x_only, "both_us": both, "added_us": added})
        print(f"{x_rows:>6} {x_mb:>7.0f} {x_only:>8.1f} {both:>8.1f} {added:>15.1f} "
              f"{(x_mb / added if added > 0 else float('inf')):>10.2f} TB/s", flush=True)
    Path(args.out).write_text(json.dumps({"bandwidth_TBps": bandwidth / 1e12, "weights_MB": weight_bytes / 1e6,
                                          "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
