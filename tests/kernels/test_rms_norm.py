"""kernels/rms_norm: the Triton kernel against the torch reference (CPU interpreter, in a subprocess)."""

import pytest
import torch

from flashtree.kernels.rms_norm import rms_norm, rms_norm_reference
from tests.kernels import rms_norm_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_ulps():
    return run_cases("tests.kernels.rms_norm_cases")


@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernel_matches_reference(interpreter_ulps, case):
    # both work in float32: summation order and the last bits of rsqrt and sigmoid (seen: 3 and 4 float32
    # ulps), then for bf16/f16 outputs at most the final rounding
    assert interpreter_ulps[case] <= (8.0 if case.endswith("float32") else 1.0)


def test_torch_path_is_the_reference_on_cpu():
    x = torch.randn(3, 4, 128, dtype=torch.bfloat16)
    w = torch.rand(128)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
