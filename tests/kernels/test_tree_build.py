"""kernels/tree_build: the device tree build and verify walk against their reference forms and drafting.ddtree
(CPU interpreter, in a subprocess), the reference forms against drafting.ddtree in-process, bad input, and on a
GPU inside a captured graph."""

import pytest
import torch

from flashtree.drafting.ddtree import topk_table
from flashtree.errors import FlashtreeError
from flashtree.kernels.tree_build import (MAX_TREE_ROWS, build_tree, build_tree_reference, walk_tree,
                                          walk_tree_reference)
from tests.kernels import tree_build_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases("tests.kernels.tree_build_cases")


@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernels_equal_the_reference_forms_and_ddtree(interpreter_results, case):
    assert interpreter_results[case] is True


@pytest.mark.parametrize("case", cases.case_ids())
def test_reference_forms_equal_ddtree(case):
    assert cases.agrees(case)


def test_walk_cases_go_deep_and_stop_at_the_root():
    """The walk cases test what they claim: the deepest walks accept the tree's longest path (its chain: 15 or 16
    drafted rows below the root), the stopping ones the root alone."""
    for case in cases.WALKS:
        count = int(walk_tree_reference(*cases.walk_inputs(case))[0])
        if case.startswith("walk-deepest"):
            assert count >= 16, case
        if case.startswith("walk-stops"):
            assert count == 1, case


def test_a_short_table_leaves_padding_rows():
    """K = 1 gives only the rank-0 chain: a budget past the table's rows places L nodes, the rest is padding."""
    root, logprobs, ids = torch.tensor([3]), torch.zeros(4, 1), torch.tensor([[10], [11], [12], [13]])
    tokens, parents, depths, visible = build_tree(root, logprobs, ids, 9, 12)
    assert tokens.tolist() == [3, 10, 11, 12, 13] + [3] * 7
    assert parents.tolist() == [-1, 0, 1, 2, 3] + [-1] * 7 and depths.tolist() == [0, 1, 2, 3, 4] + [0] * 7
    assert torch.equal(visible, torch.eye(12, dtype=torch.bool) | torch.ones(12, 12, dtype=torch.bool).tril()
                       .logical_and(torch.arange(12)[:, None] < 5))


def test_errors_name_the_problem():
    root, logprobs, ids = torch.tensor([1]), torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.long)
    for bad in ((root, logprobs.double(), ids), (root, logprobs, ids.int()), (torch.tensor([1, 2]), logprobs, ids),
                (root, torch.zeros(0, 2), ids[:0]), (root, logprobs[:, :0], ids[:, :0]), (root, logprobs, ids[:3]),
                (root, torch.zeros(4, 33), torch.zeros(4, 33, dtype=torch.long))):
        with pytest.raises(FlashtreeError, match=r"build_tree takes .* 1 <= K <= 32"):
            build_tree(*bad, 3, 4)
    for budget, size in ((5, 5), (63, MAX_TREE_ROWS + 1), (-1, 4)):
        with pytest.raises(FlashtreeError, match=r"budget \+ 1 <= size <= 64.*got budget"):
            build_tree(root, logprobs, ids, budget, size)
    rows = torch.zeros(5, dtype=torch.long)
    too_long = torch.zeros(MAX_TREE_ROWS + 1, dtype=torch.long)
    for bad in ((rows, rows, rows[:4]), (rows, rows.int(), rows), (rows[:0],) * 3, (too_long,) * 3):
        with pytest.raises(FlashtreeError, match=r"walk_tree takes .* 1 <= S <= 64"):
            walk_tree(*bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("depth, k, budget, size", [(15, 8, 22, 30), (16, 1, 63, 64), (16, 8, 63, 64)])
def test_graph_replays_build_and_walk_new_tables(depth, k, budget, size):
    """Captured once, replayed with other tables, roots and choices written into the same input buffers (as the
    speculative step's graph is): each replay equals the reference forms on those inputs."""
    gen = torch.Generator().manual_seed(depth * k + budget)

    def new_table() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logprobs, ids = topk_table(torch.randn(depth, cases.VOCAB, generator=gen) * 3, k)
        return torch.randint(0, cases.VOCAB + 1, (1,), generator=gen), logprobs, ids

    inputs = [x.cuda() for x in new_table()]
    choice = torch.zeros(size, dtype=torch.long, device="cuda")
    walk_tree(*build_tree(*inputs, budget, size)[:2], choice)  # compiled and loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = build_tree(*inputs, budget, size)
        result = walk_tree(rows[0], rows[1], choice)
    for replay in range(6):
        table = new_table()
        for buffer, new in zip(inputs, table):
            buffer.copy_(new)
        want = build_tree_reference(*table, budget, size)
        walked = cases.walk_choice(want[0], want[1], 0.9, replay % 2 == 0, gen)
        choice.copy_(walked)
        graph.replay()
        assert all(torch.equal(got.cpu(), expected) for got, expected in zip(rows, want)), replay
        assert torch.equal(result.cpu(), walk_tree_reference(want[0], want[1], walked)), replay
