"""kernels/host_rows: rows of a table gathered by the GPU from pinned host memory (the token embedding's home on a
GPU model), against `table[index]` (CPU interpreter, in a subprocess), bad input, and on a GPU inside a captured
graph."""

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels.host_rows import gather_rows, gpu_reads_host, pinned
from tests.kernels import host_rows_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases("tests.kernels.host_rows_cases")


@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernel_equals_the_torch_form(interpreter_results, case):
    assert interpreter_results[case] is True


def test_the_torch_form_and_errors_on_the_cpu():
    table = torch.arange(24, dtype=torch.uint8).reshape(4, 6)
    assert torch.equal(gather_rows(table, torch.tensor([3, 1])), table[[3, 1]])
    with pytest.raises(FlashtreeError, match="uint8 \\[V, B\\] table"):
        gather_rows(table.float(), torch.tensor([0]))
    with pytest.raises(FlashtreeError, match="index vector"):
        gather_rows(table, torch.tensor([[0]]))
    assert not gpu_reads_host(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_reads_a_pinned_table_in_place_inside_a_graph():
    """A 27B-wide Q4_K embedding's rows (2880 bytes) gathered from pinned host memory by ids the GPU holds, captured
    once and replayed with other ids: each replay equals the rows indexed on the host."""
    assert gpu_reads_host(torch.device("cuda", torch.cuda.current_device()))
    table = pinned(torch.randint(0, 256, (5000, 2880), dtype=torch.uint8))
    ids = torch.zeros(23, dtype=torch.long, device="cuda")
    gather_rows(table, ids)  # compiled outside the capture
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = gather_rows(table, ids)
    for chosen in (torch.arange(23) * 211, torch.randint(0, 5000, (23,)), torch.full((23,), 4999)):
        ids.copy_(chosen)
        graph.replay()
        assert torch.equal(out.cpu(), table[chosen])
    with pytest.raises(FlashtreeError, match="pinned"):
        gather_rows(torch.zeros(4, 8, dtype=torch.uint8), ids[:2])
