"""kernels/commit_rows: the commit's row moves and conv-window shift against their torch forms (CPU
interpreter, in a subprocess), bad input, and on a GPU inside a captured graph."""

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels.commit_rows import (RowTable, WindowTable, move_rows, move_rows_together, shift_window,
                                           shift_windows_together)
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
    with pytest.raises(FlashtreeError, match="16-byte aligned"):
        RowTable.group([torch.zeros(2, 8, 8, dtype=torch.uint8)[:, :, 1:]])
    table = RowTable.group([torch.zeros(2, 8, 8)])[0]
    with pytest.raises(FlashtreeError, match="move_rows_together takes"):
        move_rows_together(table, torch.arange(3), torch.arange(2))
    with pytest.raises(FlashtreeError, match="window table takes"):
        WindowTable.of([torch.zeros(3, 8)], [torch.zeros(4, 8, dtype=torch.bfloat16)])
    windows = WindowTable.of([torch.zeros(3, 8)], [torch.zeros(4, 8)])
    with pytest.raises(FlashtreeError, match="at most 4 rows"):
        shift_windows_together(windows, torch.arange(5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replays_move_the_rows_of_new_paths():
    """Captured once, replayed with other paths of any length written into the same index buffers (as the
    commit graph is: padded to 6 rows with the root, whose move the padding repeats, the length on the
    device): each replay equals the torch form on that path."""
    cache = torch.randn(4, 96, 256, device="cuda", dtype=torch.bfloat16)
    others = [torch.randint(0, 256, (4, 96, 112), device="cuda", dtype=torch.uint8) for _ in range(3)]  # TQ3_0-wide
    (table,) = RowTable.group(others)
    layer_windows = WindowTable.of([torch.randn(3, 10240, device="cuda") for _ in range(2)],
                                   [torch.randn(32, 10240, device="cuda") for _ in range(2)])
    window, inputs = torch.randn(3, 10240, device="cuda"), torch.randn(23, 10240, device="cuda", dtype=torch.bfloat16)
    rows, source, path = (torch.zeros(6, dtype=torch.long, device="cuda") for _ in range(3))
    count = torch.ones(1, dtype=torch.long, device="cuda")
    move_rows(cache, rows, source)  # compiled and loaded before the capture, which may not load modules
    move_rows_together(table, rows, source)
    shift_window(window, inputs, path, count)
    shift_windows_together(layer_windows, path, count)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        move_rows(cache, rows, source)
        move_rows_together(table, rows, source)
        shift_window(window, inputs, path, count)
        shift_windows_together(layer_windows, path, count)
    for nodes in ([0, 1, 2, 3], [0, 2, 3, 5, 9, 14], [0, 5, 11, 22], [0]):
        n, nodes_t = len(nodes), torch.tensor(nodes, device="cuda")
        path.zero_()[:n] = nodes_t
        count.fill_(n)
        rows.fill_(40)[:n] = 40 + torch.arange(n, device="cuda")
        source.copy_(40 + path)
        want_cache = cache.clone()
        want_cache.index_copy_(1, rows[:n], want_cache.index_select(1, source[:n]))
        want_others = [o.clone().index_copy_(1, rows[:n], o.index_select(1, source[:n])) for o in others]
        want_window = torch.cat([window, inputs[nodes_t].float()])[-3:]
        want_layers = [torch.cat([w, x[nodes_t]])[-3:] for w, x in zip(layer_windows.windows, layer_windows.inputs)]
        graph.replay()
        assert all(torch.equal(w, e) for w, e in zip(layer_windows.windows, want_layers))
        assert torch.equal(cache, want_cache) and torch.equal(window, want_window)
        assert all(torch.equal(o, w) for o, w in zip(others, want_others))
