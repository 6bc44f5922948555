#!/usr/bin/env python3
"""The DeltaNet tree-verify kernel at the 27B shape (16 q/k heads, 48 value heads, 128 x 128 states) on the
GPU: the kernel's path before the ancestor mask and the solve by bands (parents chased, rounds at any depth;
gamma now summed over the mask either way) against the engine's call now (the mask, rounds up to
`MAX_ROUNDS`, bands beyond), each change alone, and the new call's neighbours, over chain, bushy and star
trees and the 64-node chain; beside the one-token recurrent step.

    python3 benchmarks/sweep_deltanet_tree.py [--out tree.json]

Each point runs under a CUDA graph with the state rotated past the L2 (`flashtree bench --kernels` timing)
and is checked against the torch reference (max |error| / max |reference|). Prints one table: us per call,
the largest error of each tree's row, and before / new.
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
from flashtree.kernels import gated_delta_triton as gdt  # noqa: E402

HK, H, D = 16, 48, 128
ROUNDS_ONLY = gdt.MAX_TREE_NODES  # max_rounds that never leaves the rounds: the solve before bands
# label -> (tree given as, max_rounds, block_v, warps (None: tree_verify's default), precision); the 2026-12-01
# sweep's launch shapes are settled (32 columns, tf32x3: its best two), so only the new kernel's register
# pressure is tried again (w8 is the default from 33 nodes on)
VARIANTS = {
    "before": ("parents", ROUNDS_ONLY, 32, None, "tf32x3"),
    "mask": ("ancestors", ROUNDS_ONLY, 32, None, "tf32x3"),  # the mask alone
    "bands": ("parents", gdt.MAX_ROUNDS, 32, None, "tf32x3"),  # the solve alone
    "new": ("ancestors", gdt.MAX_ROUNDS, 32, None, "tf32x3"),  # deltanet.py's call for a bf16 model
    "new/ieee": ("ancestors", gdt.MAX_ROUNDS, 32, None, "ieee"),  # a float32 model's
    "new/bands0": ("ancestors", 0, 32, None, "tf32x3"),  # bands at every depth: is MAX_ROUNDS the crossover?
    "new/v16": ("ancestors", gdt.MAX_ROUNDS, 16, None, "tf32x3"),  # more programs, smaller T x V tiles
    "new/w8": ("ancestors", gdt.MAX_ROUNDS, 32, 8, "tf32x3"),  # the bands' extra T x T tiles, more registers
}


def trees(rng: random.Random) -> dict[str, list[int]]:
    """Parent lists: chains (the chain mode), a bushy DDTree-like tree, a star, and the 64-node limit."""
    bushy = [-1] + [rng.randint(max(0, i - 4), i - 1) for i in range(1, 23)]
    return {"chain16": list(range(-1, 15)), "chain23": list(range(-1, 22)), "bushy23": bushy,
            "star23": [-1] + [0] * 22, "chain64": list(range(-1, 63))}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tree.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    states = [torch.randn(H, D, D, device="cuda") * 0.1 for _ in range(rotation(H * D * D * 4))]
    results = []
    token = [t.cuda() for t in (F.normalize(torch.randn(1, HK, D), dim=-1), F.normalize(torch.randn(1, HK, D), dim=-1),
                                torch.randn(1, H, D), -torch.rand(1, H), torch.rand(1, H))]
    us = time_graph([lambda s=s: gdt.recurrent_step(*token, s) for s in states]) * 1e6
    print(f"recurrent step (1 token): {us:.1f} us", flush=True)
    results.append({"tree": "ar", "variant": "recurrent", "us": us})
    print(f"{'tree (depth)':14}" + "".join(f"{label:>11}" for label in VARIANTS) + "  max err  before/new", flush=True)
    for name, parents in trees(random.Random(0)).items():
        t = len(parents)
        p = torch.tensor(parents, device="cuda")
        anc = gdt.ancestors_from_parents(p)
        tree = {"parents": {"parents": p}, "ancestors": {"ancestors": anc}}
        q, k = (F.normalize(torch.randn(t, HK, D, device="cuda"), dim=-1) for _ in range(2))
        v, g, beta = torch.randn(t, H, D, device="cuda"), -torch.rand(t, H, device="cuda"), torch.rand(t, H, device="cuda")
        ref = gdt.tree_verify_reference(q, k, v, g, beta, states[0], p)
        times, worst = {}, 0.0
        for label, (given, max_rounds, block_v, warps, precision) in VARIANTS.items():
            kw = dict(tree[given], block_v=block_v, num_warps=warps, precision=precision, max_rounds=max_rounds)
            out = gdt.tree_verify(q, k, v, g, beta, states[0], **kw)
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            us = time_graph([lambda s=s: gdt.tree_verify(q, k, v, g, beta, s, **kw) for s in states]) * 1e6
            results.append({"tree": name, "variant": label, "us": us, "err": err})
            times[label], worst = us, max(worst, err)
        depth = int(anc.sum(1).max()) - 1
        print(f"{f'{name} ({depth})':14}" + "".join(f"{times[label]:11.1f}" for label in VARIANTS)
              + f"  {worst:7.0e}  {times['before'] / times['new']:10.2f}x", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
