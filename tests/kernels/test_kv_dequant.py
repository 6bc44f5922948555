"""kernels/kv_dequant: the Triton dequantizer against KVType.dequantize (CPU interpreter, in a subprocess)."""

import pytest
import torch

from flashtree.kernels.kv_dequant import dequantize_kv
from flashtree.kernels.kv_quant import kv_type
from tests.kernels import kv_dequant_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_cases("tests.kernels.kv_dequant_cases")


@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernel_equals_reference(interpreter_errors, case):
    # the same float32 decode, rounded once to the output dtype: bit-identical, except that the interpreter
    # rounds float32 -> bfloat16 its own way (seen: 1 ulp; a GPU rounds to nearest even, as torch does)
    assert interpreter_errors[case] <= (1.0 if case.endswith("bfloat16") else 0.0)


@pytest.mark.parametrize("name", ["f16", "q8_0", "tq3_0"])
def test_reference_path_on_cpu(name):
    t = kv_type(name)
    rows = t.quantize(torch.randn(2, 9, 128))
    assert torch.equal(dequantize_kv(rows, t, torch.bfloat16), t.dequantize(rows, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "tq3_0"])
def test_real_sizes_on_gpu(name):
    """27B attention rows (4 KV heads, head_dim 256), a 40K-row window of a larger cache: bit-identical."""
    t = kv_type(name)
    cache = t.quantize(torch.randn(4, 50000, 256, device="cuda"))
    rows = cache[:, 1000:41000]
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(dequantize_kv(rows, t, dtype), t.dequantize(rows, dtype))
