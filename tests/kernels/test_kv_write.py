"""kernels/kv_write: new rows quantized into the cache by the Triton kernel against the torch form
(`index_copy_` of `KVType.quantize`): CPU interpreter in a subprocess, and the 27B shape on the GPU."""

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels.kv_quant import kv_type
from flashtree.kernels.kv_write import write_rows
from tests.kernels import kv_write_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases("tests.kernels.kv_write_cases")


@pytest.mark.parametrize("case", cases.case_ids())
def test_kernel_writes_what_the_torch_form_writes(interpreter_results, case):
    result = interpreter_results[case]
    if case.startswith("tq3_0"):
        # another summation order of the norms and the rotation: a rotated value on a level threshold (or at
        # zero, where the sign is rounding) may take the neighbouring code, a norm move by one fp16 unit
        assert result["far_codes"] == 0 and result["max_error"] < 2e-3, result
        if case.endswith("random"):  # (the edge rows' rotation cancels to about zero: each sign a coin flip)
            assert result["codes"] <= result["values"] // 1000, result
    else:  # the same float32 operations: byte-identical, edge rows included
        assert result["bytes"] == 0, result


@pytest.mark.parametrize("name", ["f16", "bf16", "q8_0"])
def test_torch_form_where_the_kernel_does_not_run(name):
    """Without the interpreter (plain CPU) and for float caches: exactly the index_copy_ of quantize."""
    t = kv_type(name)
    x = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    slots = torch.tensor([4, 1, 6])
    got = t.allocate(2, 8, 64, "cpu")
    want = got.clone()
    write_rows(x, got, slots, t)
    want.index_copy_(1, slots, t.quantize(x.transpose(0, 1)))
    assert torch.equal(got, want)


def test_mismatched_shapes_name_the_problem():
    t = kv_type("q8_0")
    with pytest.raises(FlashtreeError, match="write_rows takes"):
        write_rows(torch.zeros(3, 2, 64), t.allocate(2, 8, 64, "cpu"), torch.tensor([0, 1]), t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "tq3_0"])
@pytest.mark.parametrize("tokens", [1, 23])
def test_27b_rows_on_gpu(name, tokens):
    """4 KV heads, head_dim 256, a decode row and a verify's 23 rows, in a CUDA graph as the step runs it,
    against the torch form on the CPU: on CUDA, torch divides by a Python scalar as a multiply by its
    reciprocal (Q8_0's amax / 127 can differ by one bit), where the kernel divides as the CPU form does."""
    t = kv_type(name)
    x = (3 * torch.randn(tokens, 4, 256, device="cuda")).to(torch.bfloat16)
    slots = torch.randperm(1000, device="cuda")[:tokens]
    got = t.allocate(4, 1000, 256, "cuda")
    want = got.clone()
    write_rows(x, got, slots, t)  # compile outside the capture
    got.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_rows(x, got, slots, t)
    graph.replay()
    got, want = got.cpu(), want.cpu()
    want.index_copy_(1, slots.cpu(), t.quantize(x.cpu().transpose(0, 1)))
    if name == "tq3_0":
        codes = t.indices(got) != t.indices(want)
        error = (t.dequantize(got) - t.dequantize(want)).abs().max() / x.float().abs().max().cpu()
        assert codes.sum() <= codes.numel() // 1000 and error < 2e-3, (int(codes.sum()), float(error))
    else:
        assert torch.equal(got, want)
