"""Runs the tree_build interpreter cases in one process (TRITON_INTERPRET=1 must be set before triton is
imported, so test_tree_build.py launches this file as a subprocess). Prints one JSON object: case id -> whether
the kernel's result equals the reference form's exactly and drafting.ddtree's (build_tree / follow).

Imported without the interpreter, the same checks hold the reference forms to drafting.ddtree."""

import json
import os
import sys
import zlib

import torch

from flashtree.drafting import ddtree
from flashtree.kernels.tree_build import build_tree, build_tree_reference, walk_tree, walk_tree_reference

VOCAB = 50
ROOT_TOKEN = VOCAB  # no drafted token: a walk that chooses it stops (padding rows carry it, never as a child)
BUDGETS = (1, 5, 22, 63)
PADDED_SIZE = {1: 3, 5: 64, 22: 30}  # verify rows past the tree (budget 63 fills all 64)


def _sizes(budget: int) -> tuple[int, ...]:
    return (budget + 1, PADDED_SIZE[budget]) if budget in PADDED_SIZE else (budget + 1,)


# id -> (L, K, budget, size); the tables are the log-softmax top-k of random logits (no exact ties), changed for
# the property a special case names (see build_inputs)
BUILDS = {f"build-L{d}-K{k}-B{b}-S{s}": (d, k, b, s)
          for d in (1, 4, 15, 16) for k in (1, 2, 8) for b in BUDGETS for s in _sizes(b)}
BUILDS |= {"build-ties-K8": (16, 8, 63, 64), "build-ties-K2": (4, 2, 7, 10), "build-neg-inf": (2, 8, 40, 48),
           "build-strided": (15, 8, 22, 23), "build-root-only": (4, 2, 0, 1)}
# id -> (build case whose tree is walked, chance that a row's choice is a child's token); a deepest walk takes
# the child toward the deepest leaf, the others a random child
WALKS = {"walk-deepest-L16-K8-B63": ("build-L16-K8-B63-S64", 1.0),
         "walk-deepest-L15-K2-B22": ("build-L15-K2-B22-S30", 1.0),
         "walk-deepest-L16-K1-B63": ("build-L16-K1-B63-S64", 1.0), "walk-deepest-ties": ("build-ties-K8", 1.0),
         "walk-random-L16-K8-B63": ("build-L16-K8-B63-S64", 0.9),
         "walk-random-L16-K8-B22": ("build-L16-K8-B22-S23", 0.9),
         "walk-stops-L16-K8-B63": ("build-L16-K8-B63-S64", 0.0), "walk-stops-padded": ("build-L4-K2-B1-S3", 0.0),
         "walk-one-row": ("build-root-only", 0.0)}


def case_ids() -> list[str]:
    return [*BUILDS, *WALKS]


def _generator(case: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(case.encode()))


def build_inputs(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(root, logprobs, ids, budget, size) of a build case. ties: every row's log-probs in exact steps of 0.5,
    two of each, so that float32 and float64 add alike and many prefixes score the same (they must pop in push
    order); neg-inf: ranks the draft gives no mass (-inf); strided: tables that are views with non-unit
    strides."""
    depth, k, budget, size = BUILDS[case]
    logprobs, ids = ddtree.topk_table(torch.randn(depth, VOCAB, generator=_generator(case)) * 3, k)
    if case.startswith("build-ties"):
        logprobs = (-0.5 - 0.5 * (torch.arange(k) // 2)).float().expand(depth, k).contiguous()
    elif case == "build-neg-inf":
        logprobs[:, 2:] = float("-inf")  # 6 finite nodes: the rest tie at -inf
    elif case == "build-strided":
        logprobs, ids = logprobs.t().contiguous().t(), ids.t().contiguous().t()
    return torch.tensor([ROOT_TOKEN]), logprobs, ids, budget, size


def walk_choice(tokens: torch.Tensor, parents: torch.Tensor, follow_chance: float, deepest: bool,
                gen: torch.Generator) -> torch.Tensor:
    """The target's choice at each row of a tree: with `follow_chance` the token of a child (the one toward the
    deepest leaf, or a random one), else a random token (seldom a child's)."""
    choice = torch.randint(0, VOCAB, tokens.shape, generator=gen)
    height = [0] * tokens.shape[0]  # rows below each row on its longest path down
    for node in reversed(range(1, tokens.shape[0])):
        if parents[node] >= 0:
            height[parents[node]] = max(height[parents[node]], height[node] + 1)
    for node in range(tokens.shape[0]):
        children = (parents == node).nonzero().flatten().tolist()
        if children and torch.rand((), generator=gen) < follow_chance:
            pick = max(children, key=height.__getitem__) if deepest else \
                children[torch.randint(0, len(children), (), generator=gen)]
            choice[node] = tokens[pick]
    return choice


def walk_inputs(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, parents, choice) of a walk case: the reference tree of its build case and a walk_choice; the
    walks that stop choose the root token at the root, which only padding rows carry."""
    build, follow_chance = WALKS[case]
    tokens, parents, _, _ = build_tree_reference(*build_inputs(build))
    choice = walk_choice(tokens, parents, follow_chance, case.startswith("walk-deepest"), _generator(case))
    if follow_chance == 0.0:
        choice[0] = ROOT_TOKEN
    return tokens, parents, choice


def _rows_match_ddtree(rows: tuple[torch.Tensor, ...], root, logprobs, ids, budget: int, size: int) -> bool:
    tokens, parents, depths, visible = rows
    tree = ddtree.build_tree(int(root), logprobs, ids, budget, chain_seed=True)
    n = len(tree)
    padding = torch.arange(n, size)
    return (torch.equal(tokens[:n], tree.tokens) and torch.equal(parents[:n], tree.parents)
            and torch.equal(depths[:n], tree.depths) and torch.equal(visible[:n, :n], tree.ancestor_mask())
            and not visible[:n, n:].any() and bool((tokens[n:] == int(root)).all())
            and bool((parents[n:] == -1).all()) and bool((depths[n:] == 0).all())
            and torch.equal(visible[n:], torch.eye(size, dtype=torch.bool)[padding]))


def build_agrees(case: str) -> bool:
    """build_tree (the kernel under the interpreter, else the reference form) equals the reference form exactly
    and drafting.ddtree.build_tree row for row, its padding as documented."""
    inputs = build_inputs(case)
    rows = build_tree(*inputs)
    reference = build_tree_reference(*inputs)
    same = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(rows, reference))
    return same and rows[3].dtype == torch.bool and _rows_match_ddtree(rows, *inputs)


def walk_agrees(case: str) -> bool:
    """walk_tree equals the reference form exactly and drafting.ddtree.follow on the tree's rows."""
    tokens, parents, choice = walk_inputs(case)
    result = walk_tree(tokens, parents, choice)
    if not torch.equal(result, walk_tree_reference(tokens, parents, choice)):
        return False
    size, n = tokens.shape[0], 1 + int((parents >= 0).sum())
    depths = torch.zeros(n, dtype=torch.long)
    for node in range(1, n):
        depths[node] = depths[parents[node]] + 1
    accepted, bonus = ddtree.follow(ddtree.DraftTree(tokens[:n], parents[:n], depths), choice[:n])
    count, path = len(accepted), result[2 : 2 + size]
    return (result[:2].tolist() == [count, bonus] and path[:count].tolist() == accepted and not path[count:].any()
            and torch.equal(result[2 + size :], tokens[path]))


def agrees(case: str) -> bool:
    return walk_agrees(case) if case in WALKS else build_agrees(case)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    json.dump({case: agrees(case) for case in case_ids()}, sys.stdout)


if __name__ == "__main__":
    main()
