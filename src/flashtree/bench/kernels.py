"""`flashtree bench --kernels`: the quantized matmuls at the Qwen3.6-27B shapes against their floor and
against dense bf16 cuBLAS, in one run on one GPU.

For every type and matrix, each row count is timed as decode sees it: a CUDA graph of calls cycling
through enough copies of the weight (>= 256 MB between two reads of one copy) that the 60 MB L2 holds
none of them, replayed; the figure is the median time per call. The floor is the weight's bytes over
the read bandwidth measured in the same run (`x.sum()` over 4 GiB); the peer is `F.linear` with the
same matrix in bf16, timed the same way. Each point is checked against the float32 dequantization of
the GGUF bytes (`quant_matmul_reference`): err is max |out - ref| / max |ref|.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

from flashtree.bench.steps import read_bandwidth
from flashtree.errors import FlashtreeError
from flashtree.kernels.quant_matmul import (KERNELS, QuantWeight, block32_mma, mma, quant_matmul,
                                            quant_matmul_reference, random_quant_weight)

SHAPES = {"attn q+gate 12288x5120": (12288, 5120), "ffn gate/up 17408x5120": (17408, 5120),
          "ffn down 5120x17408": (5120, 17408), "lm_head 248320x5120": (248320, 5120)}
ROWS = (1, 2, 4, 8, 16, 23, 32)
TYPES = (QType.Q4_K, QType.Q6_K, QType.Q5_K, QType.Q8_0, QType.IQ4_XS)
ROTATE_BYTES = 256 << 20
REPLAYS = 20


def rotation(nbytes: int) -> int:
    """Copies of a weight cycled so that >= ROTATE_BYTES pass between two reads of one copy."""
    return max(2, math.ceil(ROTATE_BYTES / nbytes) + 1)


def time_graph(calls, replays: int = REPLAYS) -> float:
    """Median seconds per call of `calls` (a list of thunks) captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up outside the graph: compiles, allocator
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(calls))
    del graph
    return statistics.median(times)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def bench_point(weights: list[QuantWeight], m: int, matmul=quant_matmul) -> tuple[float, float]:
    """(seconds per call, relative error of the first copy's output)."""
    k = weights[0].shape[1]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=weights[0].device)
    err = _relative_error(matmul(x, weights[0]), quant_matmul_reference(x, weights[0]))
    return time_graph([lambda w=w: matmul(x, w) for w in weights]), err


def bench_dense(n: int, k: int, rows: tuple[int, ...], device) -> dict[int, float]:
    dense = [torch.randn(n, k, dtype=torch.bfloat16, device=device) for _ in range(rotation(n * k * 2))]
    result = {}
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        result[m] = time_graph([lambda w=w: F.linear(x, w) for w in dense])
    del dense
    torch.cuda.empty_cache()
    return result


def run_kernel_bench(out: str | None, types=TYPES, shapes=SHAPES, rows=ROWS, device="cuda") -> dict:
    if not torch.cuda.is_available():
        raise FlashtreeError("bench --kernels times GPU kernels: no CUDA device here")
    read_bps = read_bandwidth(torch.device(device))
    print(f"{torch.cuda.get_device_name(device)}: read bandwidth {read_bps / 1e12:.2f} TB/s (x.sum over 4 GiB)",
          flush=True)
    points = []
    for name, (n, k) in shapes.items():
        qtypes = [t for t in types if t in KERNELS and (t == QType.Q6_K or not name.startswith("lm_head"))]
        if not qtypes:
            continue
        dense = bench_dense(n, k, rows, device)
        for qtype in qtypes:
            first = random_quant_weight(qtype, n, k, device, seed=0)
            weights = [first] + [random_quant_weight(qtype, n, k, device, seed=i)
                                 for i in range(1, rotation(first.nbytes))]
            for m in rows:
                seconds, err = bench_point(weights, m)
                floor = first.nbytes / read_bps
                points.append({"type": qtype.name, "matrix": name, "n": n, "k": k, "rows": m,
                               "us": seconds * 1e6, "floor_us": floor * 1e6, "of_bandwidth": floor / seconds,
                               "bf16_us": dense[m] * 1e6, "vs_bf16": dense[m] / seconds, "err": err,
                               "layout": "mma" if first.mma_layout else "fields", "kernel": _kernel_name(first, m)})
                _print_point(points[-1])
            del weights, first
            torch.cuda.empty_cache()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(device),
              "read_tbs": read_bps / 1e12, "points": points}
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
    return report


def _kernel_name(weight: QuantWeight, m: int) -> str:
    """Which family multiplies M rows of `weight`: the tensor-core CUDA kernels (fragment-ordered Q4_K/Q6_K: mma;
    Q8_0, Q5_K, IQ4_XS from their fields: block32) or Triton."""
    if weight.mma_layout:
        return "mma"
    return "block32" if block32_mma.takes(weight.qtype, weight.shape, weight.device) and m <= mma.MAX_M else "triton"


def _print_point(p: dict) -> None:
    if p["rows"] == ROWS[0]:
        print(f"\n{'type':7} {'matrix':24} {'rows':>4} {'us':>8} {'floor':>7} {'% bw':>5} {'bf16 us':>8} "
              f"{'x bf16':>6} {'err':>8} kernel")
    print(f"{p['type']:7} {p['matrix']:24} {p['rows']:4d} {p['us']:8.1f} {p['floor_us']:7.1f} "
          f"{100 * p['of_bandwidth']:4.0f}% {p['bf16_us']:8.1f} {p['vs_bf16']:6.2f} {p['err']:8.1e} {p['kernel']}",
          flush=True)
