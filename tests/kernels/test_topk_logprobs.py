"""kernels/topk_logprobs: the top-k of each row's log-softmax in two launches, against torch's log-softmax + top-k
(CPU interpreter, in a subprocess), bad input, and at the 27B draft's shape on a GPU inside a captured graph."""

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels.topk_logprobs import topk_logprobs, topk_logprobs_reference
from tests.kernels import topk_logprobs_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases("tests.kernels.topk_logprobs_cases")


@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernels_equal_log_softmax_topk(interpreter_results, case):
    """The k largest logits' ids in order, equal logits lower column first; log-probs within float32 rounding
    (logit - logsumexp against torch's (logit - max) - log(sum))."""
    same_ids, difference = interpreter_results[case]
    assert same_ids and difference <= 2e-6


def test_the_torch_form_and_errors_on_the_cpu():
    """CPU tensors take torch unless the kernels are asked for (the interpreter cases above)."""
    logits = torch.randn(3, 50)
    assert all(torch.equal(a, b) for a, b in zip(topk_logprobs(logits, 4), topk_logprobs_reference(logits, 4)))
    assert topk_logprobs(logits, 50)[1].shape == (3, 50)  # any k up to V (torch past the kernels' 32)
    for bad, k in ((logits, 0), (logits, 51), (logits[0], 2)):
        with pytest.raises(FlashtreeError, match="1 <= k <= V"):
            topk_logprobs(bad, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_27b_draft_rows_on_the_gpu_in_a_graph(dtype):
    """[15, 248320] logits, k 8, as the speculative step's graph runs it: captured once, replayed on new logits,
    the ids torch's and the log-probs within float32 rounding."""
    logits = (torch.randn(15, 248320, device="cuda") * 4).to(dtype)
    topk_logprobs(logits, 8)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, ids = topk_logprobs(logits, 8)
    logits.copy_((torch.randn(15, 248320, device="cuda") * 4).to(dtype))
    graph.replay()
    want_ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :8]
    assert torch.equal(ids, want_ids)  # bf16 rows tie: the lower column first
    assert (values - topk_logprobs_reference(logits, 8)[0]).abs().max().item() <= 4e-6
