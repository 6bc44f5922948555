"""`flashtree bench --steps --profile`: where one step's time goes, by kernel family (torch.profiler).

On CUDA it counts the GPU kernels one call launches and their device time; on the CPU the operators and
their CPU time. The steps profiled: the AR step's eager forward, and on CUDA also its graph replay that the
timed steps run (the eager forward takes a few paths a graph does not, e.g. attention over a float cache);
then a speculative step's parts as the timed rows run them: the draft step, the verify, and the verify
followed by a commit.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

# first match wins: kernel or operator name pattern -> family
FAMILIES = (
    # before the types' patterns: the float16 x conversions and the norms that write that x name a type too
    (r"prep_x", "float16 x conversions"), (r"rms_norm", "RMSNorm"),
    (r"_q4_k", "Q4_K matmul"), (r"_q6_k", "Q6_K matmul"),  # qmm_/qmv_ (CUDA) and Triton
    (r"_q5_k|_q8_0|_iq4_xs", "other quantized matmul"), (r"dequant", "dequantize"),
    (r"_sum_splits", "split-K sums"),
    (r"gated_delta|recurrent|_tree_kernel|deltanet|conv_qkv|chunk_", "DeltaNet"),
    (r"attention|attn|softmax|flash|fmha", "attention"),
    (r"gemm|gemv|cutlass|xmma|cublas|nvjet|aten::mm|aten::addmm|aten::linear|aten::matmul|aten::bmm", "dense matmul (cuBLAS)"),
    (r"memcpy|memset|copy|aten::to\b|aten::cat|index", "copies and indexing"),
    (r"elementwise|vectorized|unrolled|reduce|aten::", "elementwise and reductions"),
)


TOP_NAMES = 25  # individual kernels listed by launch count (what a fusion would remove), and by time


def family(name: str) -> str:
    lowered = name.lower()
    for pattern, label in FAMILIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def profile_call(fn, device: torch.device, warmup: int = 2) -> dict:
    """Profile one call of `fn` after `warmup` calls: {"kernels": count, "ms": total, "families": {name:
    {"count", "ms"}}} (device kernels on CUDA, operators on the CPU)."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    families: dict[str, dict] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    names: dict[str, dict] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for event in prof.events():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and (event.cpu_parent is not None or not event.name.startswith("aten::")):
            continue  # top-level operators only: their time includes their children's
        microseconds = event.device_time if cuda else event.cpu_time_total
        entry = families[family(event.name)]
        entry["count"] += 1
        entry["ms"] += microseconds / 1e3
        names[event.name]["count"] += 1
        names[event.name]["ms"] += microseconds / 1e3
    total = {"kernels": sum(f["count"] for f in families.values()),
             "ms": sum(f["ms"] for f in families.values())}
    top = sorted(names.items(), key=lambda item: -item[1]["count"])[:TOP_NAMES]
    longest = sorted(names.items(), key=lambda item: -item[1]["ms"])[:TOP_NAMES // 2]
    return {**total, "families": dict(sorted(families.items(), key=lambda item: -item[1]["ms"])), "top": dict(top),
            "longest": dict(longest), "names": dict(names)}


def kernels_beyond(whole: dict, *parts: dict) -> dict[str, dict]:
    """The kernels (operators) of the profile `whole` beyond those of `parts` profiled alone, by name: count and
    time differences, where the count differs or the time by 1 us or more, longest first (e.g. a speculative
    step's graph less its verify and draft step: the tree build's, the walk's and the commit's kernels)."""
    beyond: dict[str, dict] = {}
    names = dict.fromkeys([*whole["names"], *(name for part in parts for name in part["names"])])
    for name in names:  # one only in a part (another variant where the whole runs it) counts negative
        count = whole["names"].get(name, {}).get("count", 0) - sum(
            part["names"].get(name, {}).get("count", 0) for part in parts)
        ms = whole["names"].get(name, {}).get("ms", 0.0) - sum(part["names"].get(name, {}).get("ms", 0.0) for part in parts)
        if count or abs(ms) >= 1e-3:
            beyond[name] = {"count": count, "ms": round(ms, 4)}
    return dict(sorted(beyond.items(), key=lambda item: -item[1]["ms"]))


def print_beyond(heading: str, beyond: dict[str, dict]) -> None:
    print(f"  {heading} (count, ms):")
    for label, entry in list(beyond.items())[:TOP_NAMES]:
        print(f"    {entry['count']:6d} {entry['ms']:9.3f}  {label[:110]}")


def print_profile(name: str, report: dict, device: torch.device) -> None:
    unit = "kernels" if device.type == "cuda" else "operators"
    print(f"\nprofile of one {name}: {report['kernels']} {unit}, {report['ms']:.3f} ms "
          f"({'GPU' if device.type == 'cuda' else 'CPU'} time)")
    for label, entry in report["families"].items():
        share = entry["ms"] / report["ms"] if report["ms"] else 0.0
        print(f"  {label:28} {entry['count']:6d} {entry['ms']:10.3f} ms {100 * share:5.1f} %")
    for heading, key in (("most launched", "top"), ("longest in total", "longest")):
        print(f"  {heading} ({unit}, count, ms):")
        for label, entry in report.get(key, {}).items():
            print(f"    {entry['count']:6d} {entry['ms']:9.3f}  {label[:110]}")
