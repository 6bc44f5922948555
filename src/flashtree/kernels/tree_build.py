"""The DDTree build and the greedy verify walk on the device, so a speculative step needs no host round trip.

* `build_tree(root, logprobs, ids, budget, size)`: the tree of `drafting.ddtree.build_tree(..., chain_seed=True)`
  from the draft's [L, K] top-k table, as the verify's padded rows (tokens, parents, depths and the ancestor
  visibility).
* `walk_tree(tokens, parents, choice)`: `drafting.ddtree.follow` over those rows: the accepted path and the
  next bonus token.

Each is one single-program Triton launch whose shapes depend only on (L, K, budget, size) and S (it is compiled
for each), with no host sync, so both can be captured in a CUDA graph. The program holds everything in registers:
the table, the ancestor set of every row (an int64 bit mask, hence MAX_TREE_ROWS = 64) and the best-first
frontier, one packed int64 key per entry, so that a single max-reduction pops the best entry with all its fields.
The key's high half is the score's float32 bits mapped to an ordered integer; below it the push slot, reversed, so
that equal scores pop in push order (drafting.ddtree's tie rule), then the entry's row, rank and parent.

The device adds scores in float32 where drafting.ddtree adds in Python's float64 (both in the same order), so
two prefixes whose scores differ by less than float32 rounding can come out in the other order: only such
near-ties give a different tree. The reference forms here add in float32 too and equal the kernels exactly.
Without Triton (CPU) the reference forms run, through host lists.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import triton_runs_on

try:  # the kernels need triton; the reference forms do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

MAX_TREE_ROWS = 64  # ancestor sets are int64 bit masks; a frontier key holds a parent in 6 bits
MAX_TABLE_ROWS = 64  # the draft rows a key's 6 row bits can name (a tree of 64 rows reaches depth 63)
MAX_TOPK = 32  # the ranks a key's 5 rank bits can name


def build_tree(root: torch.Tensor, logprobs: torch.Tensor, ids: torch.Tensor, budget: int,
               size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """root: int64 [1], the bonus token; logprobs: float32 [L, K], each row sorted descending (log-softmax top-k
    of the draft, from drafting.ddtree.topk_table); ids: int64 [L, K]; budget: nodes below the root; size: rows
    of the verify, budget + 1 <= size <= MAX_TREE_ROWS.

    Returns (tokens int64 [size], parents int64 [size], depths int64 [size], visible bool [size, size]) on the
    inputs' device, newly allocated: rows 0..n-1 the tree of drafting.ddtree.build_tree (n = 1 + nodes placed;
    row 0 the root, parent -1, depth 0; visible[i, j]: j is i or an ancestor of i); padding rows i >= n: the
    root token, parent -1, depth 0, visible only [i, i]."""
    _check_table(root, logprobs, ids, budget, size)
    if triton is None or not triton_runs_on(root.device):
        return build_tree_reference(root, logprobs, ids, budget, size)
    device = root.device
    tokens, parents, depths = (torch.empty(size, dtype=torch.long, device=device) for _ in range(3))
    visible = torch.empty(size, size, dtype=torch.bool, device=device)
    depth_cap, topk = logprobs.shape
    block_l, block_k = triton.next_power_of_2(depth_cap), triton.next_power_of_2(topk)
    _build_tree_kernel[(1,)](
        root, logprobs, ids, tokens, parents, depths, visible.view(torch.uint8), depth_cap, topk, size,
        logprobs.stride(0), logprobs.stride(1), ids.stride(0), ids.stride(1), BUDGET=budget,
        CHAIN_LEN=min(budget, depth_cap), BLOCK_L=block_l, BLOCK_K=block_k,
        BLOCK_S=max(2, triton.next_power_of_2(size)), FRONTIER=_frontier_capacity(budget),
        num_warps=_warps(block_l * block_k))
    return tokens, parents, depths, visible


def walk_tree(tokens: torch.Tensor, parents: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """tokens, parents: int64 [S] as build_tree returns them (padding rows have parent -1, so are nobody's child);
    choice: int64 [S], the target's greedy token after each row's prefix.

    Returns int64 [2 + 2*S], newly allocated: [count, bonus, path (S entries: the accepted rows root first,
    `count` of them, then 0, the root, repeated), path tokens (S entries: tokens[path[i]])]; exactly
    drafting.ddtree.follow: accepted = path[:count], bonus = the next bonus token."""
    _check_walk(tokens, parents, choice)
    if triton is None or not triton_runs_on(tokens.device):
        return walk_tree_reference(tokens, parents, choice)
    size = tokens.shape[0]
    result = torch.empty(2 + 2 * size, dtype=torch.long, device=tokens.device)
    _walk_tree_kernel[(1,)](tokens, parents, choice, result, tokens.stride(0), parents.stride(0), choice.stride(0),
                            SIZE=size, BLOCK_S=max(2, triton.next_power_of_2(size)), num_warps=1)
    return result


def build_tree_reference(root: torch.Tensor, logprobs: torch.Tensor, ids: torch.Tensor, budget: int,
                         size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """build_tree through host lists: drafting.ddtree.build_tree's best-first search, its scores added in
    float32 as the kernel adds them."""
    table = logprobs.detach().cpu().numpy()  # numpy float32 scalars add with float32 rounding
    token_of = ids.tolist()
    depth_cap, topk = table.shape
    tokens, parents, depths = [int(root.item())], [-1], [0]
    frontier: list[tuple[np.float32, int, np.float32, int, int, int]] = []
    order = itertools.count()  # equal scores pop in push order

    def push(parent_score: np.float32, row: int, rank: int, parent: int) -> None:
        score = parent_score + table[row, rank]
        heapq.heappush(frontier, (-score, next(order), parent_score, row, rank, parent))

    def place(row: int, rank: int, parent: int) -> int:
        tokens.append(token_of[row][rank])
        parents.append(parent)
        depths.append(row + 1)
        return len(tokens) - 1

    score, node = np.float32(0.0), 0
    for row in range(min(budget, depth_cap)):  # the greedy chain first: never accept less than a chain
        if topk > 1:
            push(score, row, 1, node)
        score = score + table[row, 0]
        node = place(row, 0, node)
    while frontier and len(tokens) - 1 < budget:
        neg_score, _, parent_score, row, rank, parent = heapq.heappop(frontier)
        node = place(row, rank, parent)
        if rank + 1 < topk:
            push(parent_score, row, rank + 1, parent)
        if row + 1 < depth_cap:
            push(-neg_score, row + 1, 0, node)
    return _padded_rows(tokens, parents, depths, size, root.device)


def walk_tree_reference(tokens: torch.Tensor, parents: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """walk_tree through host lists: drafting.ddtree.follow over the rows, bounded by their count as the
    kernel is (a malformed tree cannot loop)."""
    token_list, choice_list, size = tokens.tolist(), choice.tolist(), tokens.shape[0]
    children: list[dict[int, int]] = [{} for _ in range(size)]
    for node, parent in enumerate(parents.tolist()):
        if 0 <= parent < size:
            children[parent][token_list[node]] = node  # siblings differ in token; else the last row wins
    path, bonus = [0], choice_list[0]
    while len(path) < size and (child := children[path[-1]].get(bonus)) is not None:
        path.append(child)
        bonus = choice_list[child]
    padded = path + [0] * (size - len(path))
    return torch.tensor([len(path), bonus, *padded, *(token_list[i] for i in padded)], dtype=torch.long,
                        device=tokens.device)


def _padded_rows(tokens: list[int], parents: list[int], depths: list[int], size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = len(tokens)
    visible = torch.eye(size, dtype=torch.bool)
    for node in range(1, n):
        visible[node] |= visible[parents[node]]
    pad = size - n

    def column(values: list[int], fill: int) -> torch.Tensor:
        return torch.tensor(values + [fill] * pad, dtype=torch.long, device=device)

    return column(tokens, tokens[0]), column(parents, -1), column(depths, 0), visible.to(device)


def _frontier_capacity(budget: int) -> int:
    """Every push is a chain node's rank-1 sibling or one of a pop's two, and chain nodes plus pops are at most
    `budget`: at most 2 * budget entries are ever pushed. Entries are never moved, so a push's slot is its
    push order."""
    return max(2, triton.next_power_of_2(2 * budget))


def _warps(table_entries: int) -> int:
    # one warp reduces with shuffles alone, without shared memory and barriers: on the H200 the build of 63 nodes
    # took 22 us with 1 warp, 42 with 2, 51 with 4 (16 x 8 table), 23 / 36 / 43 us (32 x 32: 205 registers, no
    # spills); a larger table would not fit one warp's registers
    return 1 if table_entries <= 1024 else 4


def _check_table(root: torch.Tensor, logprobs: torch.Tensor, ids: torch.Tensor, budget: int, size: int) -> None:
    shape = tuple(logprobs.shape)
    if (root.dtype != torch.long or tuple(root.shape) != (1,) or logprobs.dtype != torch.float32
            or ids.dtype != torch.long or len(shape) != 2 or tuple(ids.shape) != shape
            or not 1 <= shape[0] <= MAX_TABLE_ROWS or not 1 <= shape[1] <= MAX_TOPK
            or not root.device == logprobs.device == ids.device):
        raise FlashtreeError(
            f"build_tree takes an int64 [1] root and a float32 log-prob and an int64 id table of one shape [L, K], "
            f"1 <= L <= {MAX_TABLE_ROWS}, 1 <= K <= {MAX_TOPK}, on one device; got {root.dtype} "
            f"{tuple(root.shape)}, {logprobs.dtype} {shape}, {ids.dtype} {tuple(ids.shape)} on {root.device}, "
            f"{logprobs.device}, {ids.device}")
    if not 0 <= budget < size <= MAX_TREE_ROWS:
        raise FlashtreeError(f"build_tree needs 0 <= budget and budget + 1 <= size <= {MAX_TREE_ROWS} "
                             f"(the root and every node take a verify row); got budget {budget}, size {size}")


def _check_walk(tokens: torch.Tensor, parents: torch.Tensor, choice: torch.Tensor) -> None:
    shape = tuple(tokens.shape)
    if (any(t.dtype != torch.long for t in (tokens, parents, choice)) or len(shape) != 1
            or tuple(parents.shape) != shape or tuple(choice.shape) != shape or not 1 <= shape[0] <= MAX_TREE_ROWS
            or not tokens.device == parents.device == choice.device):
        raise FlashtreeError(
            f"walk_tree takes int64 tokens, parents and choice of one length S, 1 <= S <= {MAX_TREE_ROWS}, on one "
            f"device; got {tokens.dtype} {shape}, {parents.dtype} {tuple(parents.shape)}, {choice.dtype} "
            f"{tuple(choice.shape)} on {tokens.device}, {parents.device}, {choice.device}")


if triton is not None:
    _NO_ENTRY = tl.constexpr(-(2**63))  # below every entry's key, -inf scores included: a free or popped slot

    @triton.jit
    def _ordered(score):
        """float32 -> int32 of the same order (finite values and infinities)."""
        bits = score.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # a negative float's magnitude bits count down

    @triton.jit
    def _entry_key(score, slot, row, rank, parent, FRONTIER: tl.constexpr):
        # bits 32..63 the ordered score, 17..24 the reversed slot (< 256), 11..16 row, 6..10 rank, 0..5 parent
        low = ((FRONTIER - 1 - slot) << 17) | (row << 11) | (rank << 6) | parent
        return (_ordered(score).to(tl.int64) << 32) | low.to(tl.int64)

    @triton.jit
    def _entry_fields(key, FRONTIER: tl.constexpr):
        """(slot, row, rank, parent, score) of an entry's key."""
        ordered = (key >> 32).to(tl.int32)
        score = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        low = key.to(tl.int32)  # the low half: the fields are 25 bits
        return FRONTIER - 1 - ((low >> 17) & 255), (low >> 11) & 63, (low >> 6) & 31, low & 63, score

    @triton.jit
    def _push(keys, parent_scores, slots, pushed, enabled, parent_score, score, row, rank, parent,
              FRONTIER: tl.constexpr):
        here = (slots == pushed) & enabled
        keys = tl.where(here, _entry_key(score, pushed, row, rank, parent, FRONTIER), keys)
        parent_scores = tl.where(here, parent_score, parent_scores)
        return keys, parent_scores, pushed + enabled.to(tl.int32)

    @triton.jit
    def _at(table, entry, row, rank, BLOCK_K: tl.constexpr):
        """table[row, rank] of the flat register table: the one selected entry summed with zeros (one reduction;
        a rank past the row's names the next row's rank 0, which no caller then uses)."""
        return tl.sum(tl.where(entry == row * BLOCK_K + rank, table, 0), axis=0)

    @triton.jit
    def _seed_chain(table_lp, entry, topk, CHAIN_LEN: tl.constexpr, BLOCK_K: tl.constexpr, FRONTIER: tl.constexpr):
        """The frontier after the greedy chain: each chain node's rank-1 sibling, in row order."""
        slots = tl.arange(0, FRONTIER)
        keys = tl.full([FRONTIER], _NO_ENTRY, tl.int64)
        parent_scores = tl.zeros([FRONTIER], tl.float32)
        pushed = tl.zeros([], tl.int32)
        has_siblings = (tl.zeros([], tl.int32) + topk) > 1  # a tensor, also where topk is a constant
        chain_score = tl.zeros([], tl.float32)
        for row in range(CHAIN_LEN):
            sibling = chain_score + _at(table_lp, entry, row, 1, BLOCK_K)
            keys, parent_scores, pushed = _push(keys, parent_scores, slots, pushed, has_siblings, chain_score,
                                                sibling, row, 1, row, FRONTIER)
            chain_score += _at(table_lp, entry, row, 0, BLOCK_K)
        return keys, parent_scores, pushed

    @triton.jit
    def _store_node(tokens_ptr, parents_ptr, depths_ptr, visible_ptr, size, node, ancestors, at, token, parent,
                    depth):
        """Writes row `at` of the outputs; returns the ancestor sets with its own: its parent's and itself."""
        mine = tl.sum(tl.where(node == parent, ancestors, 0), axis=0) | (tl.full([], 1, tl.int64) << at.to(tl.int64))
        tl.store(tokens_ptr + at, token)
        tl.store(parents_ptr + at, parent.to(tl.int64))
        tl.store(depths_ptr + at, depth.to(tl.int64))
        tl.store(visible_ptr + at * size + node, ((mine >> node.to(tl.int64)) & 1).to(tl.uint8), mask=node < size)
        return tl.where(node == at, mine, ancestors)

    @triton.jit
    def _store_fixed_rows(ids_ptr, ids_stride_l, tokens_ptr, parents_ptr, depths_ptr, visible_ptr, root, node,
                          chain_len, placed, size):
        """The rows the search did not place: the root, the chain (rows 1..chain_len, a path) and the padding."""
        fixed = ((node <= chain_len) | (node >= placed)) & (node < size)
        in_chain = (node >= 1) & (node <= chain_len)
        chain_ids = tl.load(ids_ptr + (node - 1) * ids_stride_l, mask=in_chain, other=0)
        tl.store(tokens_ptr + node, tl.where(in_chain, chain_ids, root), mask=fixed)
        tl.store(parents_ptr + node, tl.where(in_chain, node - 1, -1).to(tl.int64), mask=fixed)
        tl.store(depths_ptr + node, tl.where(in_chain, node, 0).to(tl.int64), mask=fixed)
        row_of, col_of = node[:, None], node[None, :]
        sees = tl.where(row_of <= chain_len, col_of <= row_of, col_of == row_of)
        tl.store(visible_ptr + row_of * size + col_of, sees.to(tl.uint8), mask=fixed[:, None] & (col_of < size))

    @triton.jit
    def _build_tree_kernel(root_ptr, logprobs_ptr, ids_ptr, tokens_ptr, parents_ptr, depths_ptr, visible_ptr,
                           depth_cap, topk, size, lp_stride_l, lp_stride_k, ids_stride_l, ids_stride_k,
                           BUDGET: tl.constexpr, CHAIN_LEN: tl.constexpr, BLOCK_L: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, FRONTIER: tl.constexpr):
        # the loops' bounds are constants: the launch shapes depend on them anyway (and older interpreters
        # cannot iterate over a scalar argument)
        entry = tl.arange(0, BLOCK_L * BLOCK_K)  # the table flat, so that a look-up is one reduction
        rows, ranks = entry // BLOCK_K, entry % BLOCK_K
        in_table = (rows < depth_cap) & (ranks < topk)
        table_lp = tl.load(logprobs_ptr + rows * lp_stride_l + ranks * lp_stride_k, mask=in_table, other=0.0)
        table_ids = tl.load(ids_ptr + rows * ids_stride_l + ranks * ids_stride_k, mask=in_table, other=0)
        node = tl.arange(0, BLOCK_S)
        own = tl.full([BLOCK_S], 1, tl.int64) << node.to(tl.int64)
        ancestors = tl.where(node <= CHAIN_LEN, own | (own - 1), own)  # the root and the chain are a path
        keys, parent_scores, pushed = _seed_chain(table_lp, entry, topk, CHAIN_LEN, BLOCK_K, FRONTIER)
        slots = tl.arange(0, FRONTIER)
        placed = tl.zeros([], tl.int32) + CHAIN_LEN + 1
        for _ in range(CHAIN_LEN, BUDGET):  # best first: place the best entry, push its next sibling and child
            best = tl.max(keys, axis=0)
            if best != _NO_ENTRY:  # else the table has no more nodes to give (K = 1, or fewer rows than budget)
                slot, row, rank, parent, score = _entry_fields(best, FRONTIER)
                taken = slots == slot
                keys = tl.where(taken, _NO_ENTRY, keys)
                parent_score = tl.sum(tl.where(taken, parent_scores, 0.0), axis=0)
                ancestors = _store_node(tokens_ptr, parents_ptr, depths_ptr, visible_ptr, size, node, ancestors,
                                        placed, _at(table_ids, entry, row, rank, BLOCK_K), parent, row + 1)
                sibling = parent_score + _at(table_lp, entry, row, rank + 1, BLOCK_K)
                keys, parent_scores, pushed = _push(keys, parent_scores, slots, pushed, rank + 1 < topk,
                                                    parent_score, sibling, row, rank + 1, parent, FRONTIER)
                child = score + _at(table_lp, entry, row + 1, 0, BLOCK_K)
                keys, parent_scores, pushed = _push(keys, parent_scores, slots, pushed, row + 1 < depth_cap,
                                                    score, child, row + 1, 0, placed, FRONTIER)
                placed += 1
        _store_fixed_rows(ids_ptr, ids_stride_l, tokens_ptr, parents_ptr, depths_ptr, visible_ptr,
                          tl.load(root_ptr), node, CHAIN_LEN, placed, size)

    @triton.jit
    def _walk_tree_kernel(tokens_ptr, parents_ptr, choice_ptr, result_ptr, tokens_stride, parents_stride,
                          choice_stride, SIZE: tl.constexpr, BLOCK_S: tl.constexpr):
        node = tl.arange(0, BLOCK_S)
        inside = node < SIZE
        tokens = tl.load(tokens_ptr + node * tokens_stride, mask=inside, other=0)
        parents = tl.load(parents_ptr + node * parents_stride, mask=inside, other=-1)
        choice = tl.load(choice_ptr + node * choice_stride, mask=inside, other=0)
        path = tl.zeros([BLOCK_S], tl.int64)
        path_tokens = tl.zeros([BLOCK_S], tl.int64) + tl.load(tokens_ptr)
        at = tl.zeros([], tl.int32)
        count = tl.full([], 1, tl.int32)
        wanted = tl.load(choice_ptr)
        searching = count > 0
        for _ in range(1, SIZE):  # a path holds at most `size` rows; once a row has no match the rest skip
            if searching:
                # siblings differ in token: at most one child matches (padding rows have parent -1)
                child = tl.max(tl.where((parents == at) & (tokens == wanted), node, -1), axis=0)
                searching = child >= 0
                if searching:
                    path = tl.where(node == count, child.to(tl.int64), path)
                    path_tokens = tl.where(node == count, wanted, path_tokens)
                    wanted = tl.sum(tl.where(node == child, choice, 0), axis=0)
                    at = child
                    count += 1
        tl.store(result_ptr, count.to(tl.int64))
        tl.store(result_ptr + 1, wanted)
        tl.store(result_ptr + 2 + node, path, mask=inside)
        tl.store(result_ptr + 2 + SIZE + node, path_tokens, mask=inside)
