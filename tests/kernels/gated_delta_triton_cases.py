"""Runs every gated_delta_triton interpreter case in one process (TRITON_INTERPRET=1 must be set before
triton is imported, so test_gated_delta_triton.py launches this file as a subprocess). Prints one JSON
object: case id -> {"error": max relative error against the torch reference (outputs and, for
recurrent_step, the updated state), "state_changed": whether tree_verify touched the state}."""

from __future__ import annotations

import json
import os
import random
import sys

import torch

H = 3


def inputs(t, h=H, hk=None, dk=32, dv=32, seed=0, strong_decay=False, aligned=False):
    """Random inputs; `aligned`: every key near one direction (similarity ~0.9), beta 1 and no decay, the
    ill-conditioned case for the tree's triangular solve (its A entries near 1: a solve that is not a substitution
    on I + A itself loses digits there; a two-level-a-round form measured 2.5e-2 of error where one level took 2e-7)."""
    gen = torch.Generator().manual_seed(seed)
    hk = hk or h
    q = torch.randn(t, hk, dk, generator=gen) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=gen), dim=-1)
    if aligned:
        k = torch.nn.functional.normalize(0.9 * k[:1] + 0.1 * k, dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * (20.0 if strong_decay else 1.0)
    beta = torch.rand(t, h, generator=gen)
    if aligned:
        g, beta = torch.zeros_like(g), torch.ones_like(beta)
    return q, k, v, g, beta, torch.randn(h, dk, dv, generator=gen)


def random_parents(t, seed, roots=0.15):
    rng = random.Random(seed)
    return torch.tensor([-1 if i == 0 or rng.random() < roots else rng.randrange(i) for i in range(t)])


TREES = {
    "chain17": lambda: torch.arange(-1, 16),
    "chain64": lambda: torch.arange(-1, 63),
    "star8": lambda: torch.full((8,), -1),
    "single": lambda: torch.tensor([-1]),
    "small10": lambda: torch.tensor([-1, 0, 0, 1, 1, 3, 2, 6, 6, 4]),
    "binary31": lambda: torch.tensor([-1] + [(i - 1) // 2 for i in range(1, 31)]),
    "random4": lambda: random_parents(4, 1),
    "random17": lambda: random_parents(17, 2),
    "random40": lambda: random_parents(40, 3),
    "random64": lambda: random_parents(64, 4),
}


def case_ids() -> list[str]:
    ids = []
    for d in (32, 64):
        for t in (1, 4, 17):
            ids.append(f"recurrent-d{d}-t{t}")
    ids += ["recurrent-d32-t17-gqa", "recurrent-d64-t4-bv32", "recurrent-d32-t5-strided",
            "recurrent-d32-t6-strong", "recurrent-d32-three-calls", "recurrent-d64x32-t4"]
    ids += ["fold-d32-small10", "fold-d64-random17-gqa", "fold-d32-random17-padded", "fold-d32-chain64",
            "fold-d32-random17-empty", "fold-d64x32-binary31-strong", "fold-d32-random17-layers-gqa-padded"]
    ids += [f"tree-d32-{name}" for name in TREES]
    ids += ["tree-d64-random64", "tree-d64-chain64-strong", "tree-d32-random17-gqa",
            "tree-d64-random17-bv32-bk32", "tree-d32-random17-strided", "tree-d64x32-random17",
            "tree-d32-random64-ieee", "tree-d32-random17-bv16", "tree-d32-chain17-aligned", "tree-d32-random40-aligned"]
    return ids


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def strided(q, k, v, g, beta, state):
    """Views with gaps between heads/tokens (what slicing a fused projection gives)."""
    def widen(x):
        big = torch.zeros(*x.shape[:-1], x.shape[-1] + 7)
        big[..., 3:3 + x.shape[-1]] = x
        return big[..., 3:3 + x.shape[-1]]
    big_g = torch.zeros(g.shape[0], g.shape[1] * 2)
    big_g[:, ::2] = g
    big_state = torch.zeros(state.shape[0] + 2, state.shape[1], state.shape[2] + 16)
    view = big_state[1:-1, :, 8:8 + state.shape[2]]
    view.copy_(state)
    return widen(q), widen(k), widen(v), big_g[:, ::2], beta.t().contiguous().t(), view


def recurrent_case(case: str) -> dict:
    from flashtree.kernels.gated_delta_triton import recurrent_step, recurrent_step_reference

    parts = case.split("-")
    dk, dv = (int(x) for x in parts[1][1:].split("x")) if "x" in parts[1] else (int(parts[1][1:]),) * 2
    t = 3 if parts[2] == "three" else int(parts[2][1:])
    args = inputs(t, hk=1 if "gqa" in case else None, dk=dk, dv=dv, seed=t + dk, strong_decay="strong" in case)
    if "strided" in case:
        args = strided(*args)
    q, k, v, g, beta, state = args
    ref_state = state.clone()
    ref = recurrent_step_reference(q, k, v, g, beta, ref_state)
    if "three" in case:  # three single-token calls equal one call over the sequence
        out = torch.cat([recurrent_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], state)
                         for i in range(t)])
    else:
        out = recurrent_step(q, k, v, g, beta, state, block_v=32 if "bv32" in case else None)
    assert out.shape == ref.shape and out.dtype == torch.float32
    return {"error": max(rel(out, ref), rel(state, ref_state)), "state_changed": True}


def tree_case(case: str) -> dict:
    from flashtree.kernels.gated_delta_triton import tree_verify, tree_verify_reference

    parts = case.split("-")
    dk, dv = (int(x) for x in parts[1][1:].split("x")) if "x" in parts[1] else (int(parts[1][1:]),) * 2
    parents = TREES[parts[2]]()
    t = parents.shape[0]
    seed = 7 * t + dk + list(TREES).index(parts[2])
    args = inputs(t, hk=1 if "gqa" in case else None, dk=dk, dv=dv, seed=seed, strong_decay="strong" in case,
                  aligned="aligned" in case)
    if "strided" in case:
        args = strided(*args)
    q, k, v, g, beta, state = args
    before = state.clone()
    options = {}
    if "bv32" in case:
        options.update(block_v=32, block_k=32)
    if "bv16" in case:
        options.update(block_v=16)
    if "ieee" in case:
        options.update(precision="ieee")
    out = tree_verify(q, k, v, g, beta, state, parents, **options)
    ref = tree_verify_reference(q, k, v, g, beta, state, parents)
    assert out.shape == ref.shape and out.dtype == torch.float32
    return {"error": rel(out, ref), "state_changed": not torch.equal(state, before)}


def root_to_leaf(parents: torch.Tensor) -> torch.Tensor:
    """The path from a root to the tree's deepest node."""
    depth = [0] * len(parents)
    for i, p in enumerate(parents.tolist()):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    node, path = max(range(len(depth)), key=depth.__getitem__), []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return torch.tensor(path[::-1])


def fold_case(case: str) -> dict:
    """A verified tree's u and gamma (`tree_verify_with_fold`) folded along a root-to-leaf path (`fold_path`) equal
    the recurrence run over the path's tokens in order; an empty path leaves the state as it is."""
    from flashtree.kernels.gated_delta_triton import fold_path, recurrent_step_reference, tree_verify_with_fold

    if "layers" in case:
        return fold_layers_case(case)
    parts = case.split("-")
    dk, dv = (int(x) for x in parts[1][1:].split("x")) if "x" in parts[1] else (int(parts[1][1:]),) * 2
    parents = TREES[parts[2]]()
    t = parents.shape[0]
    q, k, v, g, beta, state = inputs(t, hk=1 if "gqa" in case else None, dk=dk, dv=dv, seed=3 * t + dk,
                                     strong_decay="strong" in case)
    _, u, gamma = tree_verify_with_fold(q, k, v, g, beta, state, parents)
    path = root_to_leaf(parents)
    ref_state = state.clone()
    if "empty" in case:
        fold_path(k, u, gamma, state, torch.cat([path, path.new_zeros(3)]), torch.tensor([0]))
        return {"error": rel(state, ref_state), "state_changed": True}
    recurrent_step_reference(*(x[path] for x in (q, k, v, g, beta)), ref_state)
    if "padded" in case:  # a commit graph's path: padded with the root, its length on the device
        fold_path(k, u, gamma, state, torch.cat([path, path.new_zeros(5)]), torch.tensor([len(path)]))
    else:
        fold_path(k, u, gamma, state, path)
    return {"error": rel(state, ref_state), "state_changed": True}


def fold_layers_case(case: str) -> dict:
    """Three layers' verifies left in their `FoldBuffers` (their u, Gamma and k the returned ones, k as given) and
    committed by one `fold_layers` launch: each state bit-equal to its own `fold_path`, and as the recurrence."""
    from flashtree.kernels.gated_delta_triton import (FoldBuffers, FoldTables, fold_layers, fold_path,
                                                      recurrent_step_reference, tree_verify_with_fold)

    parents = TREES[case.split("-")[2]]()
    t = parents.shape[0]
    path = root_to_leaf(parents)
    padded = torch.cat([path, path.new_zeros(4)])
    states, buffers, by_layer, errors = [], [], [], [0.0]
    for layer in range(3):
        q, k, v, g, beta, state = inputs(t, hk=1 if "gqa" in case else None, seed=11 + layer)
        into = FoldBuffers.allocate(state.shape[0], state.shape[2], k.shape[1], k.shape[2], "cpu")
        o, u, gamma = tree_verify_with_fold(q, k, v, g, beta, state, parents, into=into)
        plain = tree_verify_with_fold(q, k, v, g, beta, state, parents)
        if not (all(torch.equal(a, b) for a, b in zip((o, u, gamma), plain)) and torch.equal(into.k[:t], k)):
            return {"error": float("inf"), "state_changed": True}
        alone, ref = state.clone(), state.clone()
        fold_path(k, u, gamma, alone, padded, torch.tensor([len(path)]))
        recurrent_step_reference(*(x[path] for x in (q, k, v, g, beta)), ref)
        states.append(state)
        buffers.append(into)
        by_layer.append((alone, ref))
    fold_layers(FoldTables.of(states, buffers), padded, torch.tensor([len(path)]))
    for state, (alone, ref) in zip(states, by_layer):
        errors.append(0.0 if torch.equal(state, alone) else float("inf"))
        errors.append(rel(state, ref))
    return {"error": max(errors), "state_changed": True}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    results = {}
    for case in case_ids():
        run = {"recurrent": recurrent_case, "fold": fold_case, "tree": tree_case}[case.split("-")[0]]
        results[case] = run(case)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
