"""kernels/commit_rows: the commit's row moves and conv-window shift against their torch forms (CPU
interpreter, in a subprocess), bad input, and on a GPU inside a captured graph."""

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels.commit_rows import move_rows, shift_window
from tests.kernels import commit_rows_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases("tests.kernels.commit_rows_cases")


@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernels_equal_the_torch_forms(interpreter_results, case):
    assert interpreter_results[case] is True  # copies and one cast: bit for bit


def test_errors_name_the_problem():
    with pytest.raises(FlashtreeError, match="move_rows takes"):
        move_rows(torch.zeros(2, 8), torch.arange(2), torch.arange(2))
    with pytest.raises(FlashtreeError, match="move_rows takes"):
        move_rows(torch.zeros(1, 80, 4), torch.arange(65), torch.arange(65))
    with pytest.raises(FlashtreeError, match="shift_window takes"):
        shift_window(torch.zeros(3, 8), torch.zeros(4, 9), torch.arange(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replays_move_the_rows_of_new_paths():
    """Captured once, replayed with other paths written into the same index buffers (as the commit graph
    is): each replay equals the torch form on that path."""
    cache = torch.randn(4, 96, 256, device="cuda", dtype=torch.bfloat16)
    window, inputs = torch.randn(3, 10240, device="cuda"), torch.randn(23, 10240, device="cuda", dtype=torch.bfloat16)
    rows, source, path = (torch.zeros(4, dtype=torch.long, device="cuda") for _ in range(3))
    move_rows(cache, rows, source)  # compiled and loaded before the capture, which may not load modules
    shift_window(window, inputs, path)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        move_rows(cache, rows, source)
        shift_window(window, inputs, path)
    for nodes in ([0, 1, 2, 3], [0, 2, 3, 5], [0, 5, 11, 22]):
        nodes_t = torch.tensor(nodes, device="cuda")
        path.copy_(nodes_t)
        rows.copy_(40 + torch.arange(4, device="cuda"))
        source.copy_(40 + nodes_t)
        want_cache = cache.clone()
        want_cache.index_copy_(1, rows, want_cache.index_select(1, source))
        want_window = torch.cat([window, inputs[nodes_t].float()])[-3:]
        graph.replay()
        assert torch.equal(cache, want_cache) and torch.equal(window, want_window)
