"""DDTree builder, tree metadata and verify walk, checked against brute force."""

import itertools

import pytest
import torch

from flashtree.drafting.ddtree import DraftTree, build_chain, build_tree, follow, topk_table

ROOT = 7


def random_table(depth, k, seed):
    """Distinct random log-probs (sorted per row, so ties are improbable) and distinct ids per row."""
    g = torch.Generator().manual_seed(seed)
    logprobs = (-3 * torch.rand(depth, k, generator=g, dtype=torch.float64)).sort(dim=1, descending=True).values
    ids = torch.stack([torch.randperm(50, generator=g)[:k] + 100 for _ in range(depth)])
    return logprobs, ids


def all_prefixes(logprobs, ids):
    """{token path: cumulative log-prob} for every prefix of depth 1..L."""
    depth, k = ids.shape
    out = {}
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            path = tuple(int(ids[i, r]) for i, r in enumerate(ranks))
            out[path] = sum(float(logprobs[i, r]) for i, r in enumerate(ranks))
    return out


def tree_paths(tree):
    """Token path (root excluded) of every non-root node."""
    return {tuple(int(tree.tokens[j]) for j in tree.path_to(i)[1:]) for i in range(1, len(tree))}


def top(prefixes, n):
    return set(sorted(prefixes, key=prefixes.get, reverse=True)[:n])


def assert_consistent(tree):
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert tree.tokens.dtype == tree.parents.dtype == tree.depths.dtype == torch.int64
    assert tree.tokens[0] == ROOT and parents[0] == -1 and depths[0] == 0
    for i in range(1, len(tree)):
        assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1
        assert tree.children(parents[i])[int(tree.tokens[i])] == i


CASES = [(depth, k, seed) for depth in (3, 4) for k in (2, 3) for seed in range(3)]


@pytest.mark.parametrize("depth,k,seed", CASES)
def test_best_first_selects_top_budget_prefixes(depth, k, seed):
    logprobs, ids = random_table(depth, k, seed)
    prefixes = all_prefixes(logprobs, ids)
    for budget in range(len(prefixes) + 2):
        tree = build_tree(ROOT, logprobs, ids, budget, chain_seed=False)
        assert_consistent(tree)
        assert tree_paths(tree) == top(prefixes, budget)


@pytest.mark.parametrize("depth,k,seed", CASES)
def test_chain_seed_contains_chain_then_best_remaining(depth, k, seed):
    logprobs, ids = random_table(depth, k, seed)
    prefixes = all_prefixes(logprobs, ids)
    greedy = tuple(ids[:, 0].tolist())
    for budget in range(len(prefixes) + 2):
        tree = build_tree(ROOT, logprobs, ids, budget, chain_seed=True)
        assert_consistent(tree)
        chain_len = min(budget, depth)
        chain = {greedy[:d] for d in range(1, chain_len + 1)}
        assert len(tree) - 1 == min(budget, len(prefixes))
        # The spine sits at indices 1..chain_len.
        assert tree.parents[1:chain_len + 1].tolist() == list(range(chain_len))
        rest = tree_paths(tree) - chain
        assert chain <= tree_paths(tree)
        # Any best set of non-chain prefixes is prefix-closed given the chain (scores fall with depth).
        others = {p: s for p, s in prefixes.items() if p not in chain}
        assert rest == top(others, len(tree) - 1 - chain_len)


def test_small_budget_with_chain_seed_is_exactly_the_chain():
    logprobs, ids = random_table(6, 3, 0)
    for budget in range(7):
        tree = build_tree(ROOT, logprobs, ids, budget)
        chain = build_chain(ROOT, ids, budget)
        for a, b in ((tree.tokens, chain.tokens), (tree.parents, chain.parents), (tree.depths, chain.depths)):
            assert torch.equal(a, b)


def test_k1_is_the_chain_and_depth_is_capped():
    logprobs, ids = random_table(5, 1, 1)
    tree = build_tree(ROOT, logprobs, ids, budget=100, chain_seed=False)
    assert tree.tokens.tolist() == [ROOT] + ids[:, 0].tolist()
    assert int(tree.depths.max()) == 5
    assert build_chain(ROOT, ids[:, 0], 5).tokens.tolist() == tree.tokens.tolist()
    with pytest.raises(ValueError):
        build_chain(ROOT, ids, 6)


def test_ties_are_deterministic():
    logprobs = torch.full((4, 3), -1.0)
    ids = torch.arange(12).view(4, 3)
    a, b = (build_tree(ROOT, logprobs, ids, 9, chain_seed=False) for _ in range(2))
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    # Equal scores pop in push order: all of depth 1, then each parent's rank-0 child, then rank 1.
    assert a.tokens.tolist() == [ROOT, 0, 1, 2, 3, 3, 3, 4, 4, 4]
    assert a.parents.tolist() == [-1, 0, 0, 0, 1, 2, 3, 1, 2, 3]


def test_topk_table():
    logits = torch.randn(15, 40, dtype=torch.bfloat16)
    logprobs, ids = topk_table(logits, 4)
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert logprobs.dtype == torch.float32 and ids.dtype == torch.int64 and logprobs.shape == (15, 4)
    assert torch.all(logprobs[:, :-1] >= logprobs[:, 1:])
    torch.testing.assert_close(logprobs, expected.topk(4, dim=-1).values)
    torch.testing.assert_close(logprobs, expected.gather(1, ids))
    with pytest.raises(ValueError):
        topk_table(logits, 41)


def test_ancestor_mask_matches_brute_force():
    logprobs, ids = random_table(4, 3, 5)
    tree = build_tree(ROOT, logprobs, ids, 30)
    mask = tree.ancestor_mask()
    assert mask.dtype == torch.bool and mask.shape == (31, 31)
    for i in range(len(tree)):
        ancestors = set(tree.path_to(i))
        assert mask[i].nonzero().flatten().tolist() == sorted(ancestors)


def hand_tree():
    """root(7) -> a(1) -> b(2) -> c(3);  root -> d(4) -> e(5);  a -> f(6)."""
    tokens = [7, 1, 4, 2, 5, 6, 3]
    parents = [-1, 0, 0, 1, 2, 1, 3]
    depths = [0, 1, 1, 2, 2, 2, 3]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def test_path_to_and_children():
    tree = hand_tree()
    assert tree.path_to(6) == [0, 1, 3, 6] and tree.path_to(0) == [0]
    assert tree.children(0) == {1: 1, 4: 2} and tree.children(1) == {2: 3, 6: 5} and tree.children(6) == {}


def test_follow_deep_path():
    # Target agrees all the way down a->b->c, then its choice after c (9) becomes the bonus.
    assert follow(hand_tree(), [1, 2, 0, 3, 0, 0, 9]) == ([0, 1, 3, 6], 9)


def test_follow_sibling_branch():
    # Target picks the second root child d, then e, then 8.
    assert follow(hand_tree(), torch.tensor([4, 0, 5, 0, 8, 0, 0])) == ([0, 2, 4], 8)
    # Off-spine sibling at depth 2: a then f.
    assert follow(hand_tree(), [1, 6, 0, 0, 0, 11, 0]) == ([0, 1, 5], 11)


def test_follow_rejects_at_root():
    assert follow(hand_tree(), [9, 1, 4, 2, 5, 6, 3]) == ([0], 9)


@pytest.mark.parametrize("parents,depths,tokens", [
    ([-1, 1], [0, 1], [7, 1]),          # parent not before child
    ([-1, 0, 0], [0, 1, 1], [7, 1, 1]),  # duplicate sibling token
    ([-1, 0], [0, 2], [7, 1]),           # depth inconsistent
])
def test_malformed_trees_rejected(parents, depths, tokens):
    with pytest.raises(ValueError):
        DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))
