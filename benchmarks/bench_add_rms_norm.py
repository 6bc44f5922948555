"""The residual add + RMSNorm of the decode and verify steps on the GPU: the Triton kernel (one program a row) against
the cluster kernel (kernels/add_rms_norm.cu, a row per cluster of CTAs) and variants of it, at the 27B hidden size.

Each point is a CUDA graph of 128 launches (a decode step's count) over 8 rotating buffer sets, replayed; the figure
is the median time per launch. "after qmv" pairs each launch with the Q4_K FFN down-projection matmul that
precedes it in the step (1 row) and reports the pair's time less the matmul's alone: what the norm adds to a step.

    python benchmarks/bench_add_rms_norm.py --out norm.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QType

from flashtree.bench.kernels import time_graph
from flashtree.kernels import rms_norm as norm
from flashtree.kernels.cuda_functions import launch, load_function
from flashtree.kernels.quant_matmul import quant_matmul, random_quant_weight

DIM = 5120
LAUNCHES = 128
SETS = 8

# name -> (text replaced in add_rms_norm.cu, by what), cluster size
VARIANTS = {
    "cluster 8": ((), 8),
    "cluster 8, relaxed arrive": ((("barrier.cluster.arrive.release.aligned;\\nbarrier.cluster.wait.acquire.aligned;",
                                   "barrier.cluster.arrive.relaxed.aligned;\\nbarrier.cluster.wait.aligned;"),), 8),
    "cluster 4": ((("constexpr int CLUSTER = 8;", "constexpr int CLUSTER = 4;"),), 4),
}


def variant_function(name: str, edits, device: torch.device):
    """The kernel of add_rms_norm.cu with `edits` applied (compiled here; the shipped one when there are none)."""
    if not edits:
        return norm._cluster_function(device, "add_rms_norm_f32")
    source = norm.cluster_source()
    for old, new in edits:
        assert old in source, (name, old)
        source = source.replace(old, new)
    return load_function(device, "add_rms_norm_f32", source)


def variant_call(fn, cluster: int, h, delta, w, total, normed):
    threads = min(1024, -(-DIM // (4 * cluster * 32)) * 32)
    return lambda: launch(fn, (h.shape[0] * cluster, 1), threads, [h, delta, w, total, normed, DIM, 1e-6], h.device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="add_rms_norm.json")
    parser.add_argument("--rows", default="1,23")
    args = parser.parse_args()
    dev = torch.device("cuda")
    w = 1 + 0.1 * torch.randn(DIM, device=dev)
    weight = random_quant_weight(QType.Q4_K, DIM, 17408, dev)
    results = []
    print(f"{'rows':>4}  {'kernel':28} {'us/launch':>9} {'after qmv':>9}  max |diff| vs triton")
    for rows in map(int, args.rows.split(",")):
        sets = [(torch.randn(rows, DIM, device=dev), torch.randn(rows, DIM, device=dev)) for _ in range(SETS)]
        outs = [(torch.empty(rows, DIM, device=dev), torch.empty(rows, DIM, device=dev)) for _ in range(SETS)]
        x = torch.randn(rows, 17408, device=dev)
        matmul = time_graph([lambda: quant_matmul(x, weight)] * LAUNCHES)

        def triton_call(i):
            h, d = sets[i % SETS]
            return lambda: norm._add_rms_norm_kernel[(rows,)](h, d, w, *outs[i % SETS], DIM, 1e-6, BLOCK=8192,
                                                               num_warps=8)

        calls = {"triton (one program a row)": [triton_call(i) for i in range(LAUNCHES)]}
        for name, (edits, cluster) in VARIANTS.items():
            fn = variant_function(name, edits, dev)
            calls[name] = [variant_call(fn, cluster, *sets[i % SETS], w, *outs[i % SETS]) for i in range(LAUNCHES)]
        reference = None
        for name, thunks in calls.items():
            for thunk in thunks[:SETS]:
                thunk()
            got = torch.cat([o[1] for o in outs])
            reference = got.clone() if reference is None else reference
            diff = (got - reference).abs().max().item()
            alone = time_graph(thunks)
            paired = time_graph([c for thunk in thunks for c in (lambda: quant_matmul(x, weight), thunk)])
            after = paired * 2 - matmul
            print(f"{rows:4d}  {name:28} {alone * 1e6:9.2f} {after * 1e6:9.2f}  {diff:.2e}", flush=True)
            results.append({"rows": rows, "kernel": name, "us": alone * 1e6, "us_after_qmv": after * 1e6,
                            "max_diff_vs_triton": diff})
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
