"""DDTree: turn one DFlash draft pass into a token tree for a single tree-verify target pass.

The draft gives one marginal distribution per block position (L rows). Under the factorised
proposal Q(y_1..y_L) = prod q_d(y_d), the expected accepted depth of a prefix-closed tree is the
sum of its nodes' prefix probabilities, so the best tree of B nodes is the B most probable
prefixes (DDTree, arXiv 2604.12989). They are found best-first with a max-heap over cumulative
log-probabilities, each depth restricted to its top-K tokens.

Node 0 is always the root: the bonus token, already decided by the target, not counted in the
budget. Nodes are stored in insertion order, which is topological (parent index < child index).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashtree.kernels.topk_logprobs import topk_logprobs


@dataclass(frozen=True, eq=False)
class DraftTree:
    tokens: Tensor   # int64 [n+1]: 0 = root (bonus token), then nodes in topological order
    parents: Tensor  # int64 [n+1]: parents[0] = -1
    depths: Tensor   # int64 [n+1]: root depth 0
    _children: tuple[dict[int, int], ...] = field(init=False, repr=False)
    _ancestors: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tokens, parents, depths = self.tokens.tolist(), self.parents.tolist(), self.depths.tolist()
        if not len(tokens) == len(parents) == len(depths) >= 1 or parents[0] != -1 or depths[0] != 0:
            raise ValueError("a draft tree needs equal-length tokens/parents/depths with a root at index 0")
        children: list[dict[int, int]] = [{} for _ in tokens]
        paths = [[0]]  # each node's root-to-node indices: its row of the ancestor mask
        for i in range(1, len(tokens)):
            p = parents[i]
            # The verify walk relies on these: parents come first, and siblings differ in token.
            if not 0 <= p < i or depths[i] != depths[p] + 1 or tokens[i] in children[p]:
                raise ValueError(f"draft tree node {i} is malformed (parent {p}, token {tokens[i]})")
            children[p][tokens[i]] = i
            paths.append(paths[p] + [i])
        # built here from the host lists: the per-level tensor form costs ~0.7 ms a step (a chain of 15 levels)
        ancestors = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)
        ancestors[[i for i, path in enumerate(paths) for _ in path], [j for path in paths for j in path]] = True
        object.__setattr__(self, "_children", tuple(children))
        object.__setattr__(self, "_ancestors", ancestors)

    def __len__(self) -> int:
        """Number of nodes including the root."""
        return len(self._children)

    def children(self, node: int) -> dict[int, int]:
        """token -> child index for the children of `node`."""
        return self._children[node]

    def ancestor_mask(self) -> Tensor:
        """bool [n+1, n+1]: [i, j] true iff j is i or an ancestor of i (the tree-attention visibility);
        the tree's own tensor, not to be written."""
        return self._ancestors

    def path_to(self, node: int) -> list[int]:
        """Indices from the root down to `node`."""
        path = [node]
        while path[-1] != 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]


def _tree(tokens: list[int], parents: list[int], depths: list[int]) -> DraftTree:
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return DraftTree(as_tensor(tokens), as_tensor(parents), as_tensor(depths))


def topk_table(draft_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """[L, V] draft logits -> (log-probs [L, k] float32 sorted descending, token ids [L, k]).

    True log-softmax values (to float32 rounding), not ranks or raw logits: the tree compares cumulative scores
    across depths, and Luce measured acceptance dropping 7.1 -> 5.3 with approximate log-probs."""
    if not 1 <= k <= draft_logits.shape[-1]:
        raise ValueError(f"top-k must be in [1, {draft_logits.shape[-1]}], got {k}")
    return topk_logprobs(draft_logits, k)  # on the GPU without the log-softmax's 16 MB (kernels/topk_logprobs.py)


def build_tree(root_token: int, top_logprobs: Tensor, top_ids: Tensor, budget: int,
               chain_seed: bool = True) -> DraftTree:
    """Best-first tree of at most `budget` nodes (root excluded) from an [L, K] top-k table.

    With `chain_seed` the greedy chain (rank 0 at every depth, min(budget, L) long) goes in
    first, so the tree can never accept less than chain decoding; the rest is filled with the
    most probable remaining prefixes. Equal scores pop in push order, so the result is
    deterministic."""
    if budget < 0:
        raise ValueError(f"tree budget must be >= 0, got {budget}")
    logprobs, ids = top_logprobs.float().tolist(), top_ids.tolist()  # one host copy each
    depth_cap, k = len(ids), len(ids[0]) if ids else 0
    tokens, parents, depths = [root_token], [-1], [0]
    heap: list[tuple[float, int, float, int, int, int]] = []
    order = itertools.count()

    def push(parent_score: float, row: int, rank: int, parent: int) -> None:
        # Keep the parent's score so a sibling's score is one addition, not a subtract-and-add.
        score = parent_score + logprobs[row][rank]
        heapq.heappush(heap, (-score, next(order), parent_score, row, rank, parent))

    def add(row: int, rank: int, parent: int) -> int:
        tokens.append(ids[row][rank])
        parents.append(parent)
        depths.append(row + 1)
        return len(tokens) - 1

    if chain_seed:
        score, node = 0.0, 0
        for row in range(min(budget, depth_cap)):
            if k > 1:  # a chain node's rank-1 sibling is the frontier the spine leaves behind
                push(score, row, 1, node)
            score += logprobs[row][0]
            node = add(row, 0, node)
    elif budget > 0 and depth_cap > 0:
        push(0.0, 0, 0, 0)

    while heap and len(tokens) - 1 < budget:
        neg_score, _, parent_score, row, rank, parent = heapq.heappop(heap)
        node = add(row, rank, parent)
        if rank + 1 < k:
            push(parent_score, row, rank + 1, parent)
        if row + 1 < depth_cap:
            push(-neg_score, row + 1, 0, node)
    return _tree(tokens, parents, depths)


def build_chain(root_token: int, top_ids: Tensor, length: int) -> DraftTree:
    """The plain DFlash chain: the rank-0 token of the first `length` rows.

    `top_ids` is the [L, K] table or just the [L] argmax ids."""
    chain = (top_ids if top_ids.dim() == 1 else top_ids[:, 0]).tolist()
    if not 0 <= length <= len(chain):
        raise ValueError(f"chain length must be in [0, {len(chain)}], got {length}")
    return _tree([root_token] + chain[:length], list(range(-1, length)), list(range(length + 1)))


def follow(tree: DraftTree, target_choice: Sequence[int] | Tensor) -> tuple[list[int], int]:
    """Walk the verified tree: `target_choice[i]` is the target's token after node i's prefix.

    Returns the accepted node indices (root first) and the next bonus token: the target's
    choice at the deepest accepted node, which no child matched."""
    choice = target_choice.tolist() if isinstance(target_choice, Tensor) else list(target_choice)
    accepted, nxt = [0], choice[0]
    while (child := tree.children(accepted[-1]).get(nxt)) is not None:
        accepted.append(child)
        nxt = choice[child]
    return accepted, nxt
