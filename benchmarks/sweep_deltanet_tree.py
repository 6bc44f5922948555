#!/usr/bin/env python3
"""The DeltaNet tree-verify kernels at the 27B shape (16 q/k heads, 48 value heads, 128 x 128 states) on the
GPU, the CUDA C kernel (deltanet_tree.cu) and the Triton kernel's launch shapes, at several tree shapes, beside the
one-token recurrent step.

    python3 benchmarks/sweep_deltanet_tree.py [--out tree.json] [--phases]

Each point runs under a CUDA graph with the state rotated past the L2 (`flashtree bench --kernels` timing)
and is checked against the torch reference (max |error| / max |reference|). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashtree.bench.kernels import rotation, time_graph  # noqa: E402
from flashtree.kernels import gated_delta_cuda as gdc  # noqa: E402
from flashtree.kernels import gated_delta_triton as gdt  # noqa: E402

HK, H, D = 16, 48, 128
# (block_v, block_k, warps, precision, pipeline stages or None for Triton's default): the default first, then the
# launch shapes that compile without spills for sm_90 (scripts/compile_kernels_offline.py: block_k 64 and 128 spill);
# every point as the verify runs it, storing u and Gamma for the commit (`tree_verify_with_fold`)
VARIANTS = ((32, 16, 4, "tf32x3", None), (32, 16, 4, "tf32x3", 1), (32, 16, 8, "tf32x3", None),
            (32, 32, 4, "tf32x3", None), (32, 32, 8, "tf32x3", None), (16, 16, 4, "tf32x3", None),
            (16, 16, 8, "tf32x3", None), (16, 32, 8, "tf32x3", None), (32, 16, 4, "ieee", None))


# the commit's launch shapes (block_v, block_k, warps), each compiled without spills for sm_90 and checked on the GPU
# (tests/kernels/test_gated_delta_triton.py FOLD_SHAPES): the default first
FOLD_SHAPES = ((32, 16, 4), (64, 16, 4), (64, 32, 8), (32, 64, 8), (128, 16, 8), (128, 8, 4))


def trees(rng: random.Random) -> dict[str, list[int]]:
    """Parent lists: chains (the chain mode), a bushy DDTree-like tree, and a star."""
    bushy = [-1] + [rng.randint(max(0, i - 4), i - 1) for i in range(1, 23)]
    return {"chain16": list(range(-1, 15)), "chain23": list(range(-1, 22)), "bushy23": bushy,
            "star23": [-1] + [0] * 22}


def commit_rows(parents: list[int], layers: int = 48) -> list[dict]:
    """The commit of a depth-4 path of a 23-node verify into all 48 DeltaNet layers of the 27B shape: one
    `fold_path` a layer (its launch shapes) against one `fold_layers` launch; both read the verify's rows from
    `FoldBuffers` as the engine leaves them (the states, 151 MB, are past the L2 by their size)."""
    t, path = len(parents), [0, 1, 2, 3, 4]
    rows = torch.tensor(path + [0] * (t - len(path)), device="cuda")
    count = torch.tensor([len(path)], device="cuda")
    states = [torch.randn(H, D, D, device="cuda") * 0.1 for _ in range(layers)]
    buffers = [gdt.FoldBuffers.allocate(H, D, HK, D, "cuda") for _ in range(layers)]
    for b in buffers:
        b.u.normal_()
        b.gamma.uniform_(-3.0, 0.0)
        b.k.copy_(F.normalize(torch.randn_like(b.k), dim=-1))
    tables = gdt.FoldTables.of(states, buffers)
    results = []
    calls = [(f"fold_path x {layers}, v{bv}k{bk}w{w}", lambda bv=bv, bk=bk, w=w: [
        gdt.fold_path(b.k[:t], b.u[:t], b.gamma[:t], s, rows, count, block_v=bv, block_k=bk, num_warps=w)
        for s, b in zip(states, buffers)]) for bv, bk, w in FOLD_SHAPES]
    calls += [(f"fold_layers, v{bv}k{bk}w{w}", lambda bv=bv, bk=bk, w=w: gdt.fold_layers(
        tables, rows, count, block_v=bv, block_k=bk, num_warps=w)) for bv, bk, w in FOLD_SHAPES]
    for label, call in calls:
        us = time_graph([call]) * 1e6
        print(f"commit (23 nodes, path 5, {layers} layers): {label:32} {us:8.1f} us", flush=True)
        results.append({"tree": "commit", "variant": label, "us": us})
    return results


PHASES = ("wait for the kernel before", "loads landed", "K S0, Q S0, K K^T, Q K^T", "A, rhs, decayed Q K^T",
          "substitution (warp 0)", "outputs and stores")


def phase_rows(name: str, q, k, v, g, beta, state, parents) -> dict:
    """Where a CTA of the CUDA kernel spends its time (the phase-clock instance, deltanet_tree.cu TREE_PHASE_CLOCKS):
    each phase's SM cycles in every CTA, converted to ns by the median of the CTAs' global-timer spans over their
    cycles, and when the CTAs started and ended against the first start (one launch, after warm-up calls)."""
    t, h, dv = v.shape
    out, u = torch.empty_like(v), torch.empty_like(v)
    gamma = torch.empty(t, h, device="cuda")
    clocks = torch.zeros(dv // gdc.COLS, h, gdc.PHASE_WORDS, dtype=torch.int64, device="cuda")
    for _ in range(3):
        gdc.tree_verify(q, k, v, g, beta, state, parents, out, u, gamma, out, True, False, clocks=clocks)
    torch.cuda.synchronize()
    w = clocks.view(-1, gdc.PHASE_WORDS).double()
    stamps, start_ns, end_ns = w[:, :7], w[:, 8], w[:, 9]
    # one conversion for all CTAs (the global timer ticks coarsely on some GPUs): their spans' median
    ns_per_cycle = ((end_ns - start_ns) / (stamps[:, 6] - stamps[:, 0]).clamp(min=1)).median()
    phases = (stamps[:, 1:] - stamps[:, :-1]) * ns_per_cycle / 1e3  # us
    first = start_ns.min()
    report = {"tree": name, "ctas": w.shape[0], "sms": int(w[:, 7].unique().numel()),
              "phases_us": {label: {"median": round(phases[:, i].median().item(), 2),
                                    "max": round(phases[:, i].max().item(), 2)} for i, label in enumerate(PHASES)},
              "start_us": {"median": round(((start_ns - first).median() / 1e3).item(), 2),
                           "max": round(((start_ns - first).max() / 1e3).item(), 2)},
              "end_us": {"median": round(((end_ns - first).median() / 1e3).item(), 2),
                         "max": round(((end_ns - first).max() / 1e3).item(), 2)}}
    cells = " | ".join(f"{label} {v['median']:.2f}/{v['max']:.2f}" for label, v in report["phases_us"].items())
    print(f"phases {name:8} us median/max over {report['ctas']} CTAs on {report['sms']} SMs: {cells} | CTA start "
          f"{report['start_us']['median']:.2f}/{report['start_us']['max']:.2f}, end {report['end_us']['median']:.2f}/"
          f"{report['end_us']['max']:.2f} after the first start", flush=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tree.json")
    parser.add_argument("--commit-only", action="store_true", help="only the commit rows (fold_path, fold_layers)")
    parser.add_argument("--phases", action="store_true",
                        help="also where the CUDA kernel's CTAs spend their time, phase by phase (phase clocks)")
    args = parser.parse_args()
    if args.commit_only:
        Path(args.out).write_text(json.dumps(commit_rows(trees(random.Random(0))["bushy23"]), indent=2))
        return 0
    torch.manual_seed(0)
    states = [torch.randn(H, D, D, device="cuda") * 0.1 for _ in range(rotation(H * D * D * 4))]
    results = []
    token = [t.cuda() for t in (F.normalize(torch.randn(1, HK, D), dim=-1), F.normalize(torch.randn(1, HK, D), dim=-1),
                                torch.randn(1, H, D), -torch.rand(1, H), torch.rand(1, H))]
    us = time_graph([lambda s=s: gdt.recurrent_step(*token, s) for s in states]) * 1e6
    print(f"recurrent step (1 token): {us:.1f} us", flush=True)
    results.append({"tree": "ar", "variant": "recurrent", "us": us})
    for name, parents in trees(random.Random(0)).items():
        t = len(parents)
        p = torch.tensor(parents, device="cuda")
        q, k = (F.normalize(torch.randn(t, HK, D, device="cuda"), dim=-1) for _ in range(2))
        v, g, beta = torch.randn(t, H, D, device="cuda"), -torch.rand(t, H, device="cuda"), torch.rand(t, H, device="cuda")
        ref = gdt.tree_verify_reference(q, k, v, g, beta, states[0], p)
        cells = []
        # the CUDA C kernel (deltanet_tree.cu, the default where it takes the tree), then the Triton launch shapes
        launches = [("cuda", {})] + [
            (f"v{bv}k{bk}w{w}{'' if stages is None else f's{stages}'}/{precision}",
             dict(block_v=bv, block_k=bk, num_warps=w, precision=precision, num_stages=stages, cuda=False))
            for bv, bk, w, precision, stages in VARIANTS]
        for label, kw in launches:
            out = gdt.tree_verify_with_fold(q, k, v, g, beta, states[0], p, **kw)[0]
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            us = time_graph([lambda s=s: gdt.tree_verify_with_fold(q, k, v, g, beta, s, p, **kw) for s in states]) * 1e6
            results.append({"tree": name, "variant": label, "us": us, "err": err})
            cells.append(f"{label} {us:.1f} {err:.0e}")
        print(f"{name:8} " + " | ".join(cells), flush=True)
        if args.phases:
            results.append(phase_rows(name, q, k, v, g, beta, states[0], p))
    results += commit_rows(trees(random.Random(0))["bushy23"])
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
