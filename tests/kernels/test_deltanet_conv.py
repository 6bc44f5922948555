"""kernels/deltanet_conv: the DeltaNet input stage's Triton kernel (conv, q/k/v and the gates) against its
torch references (CPU interpreter, in a subprocess), for a decode token, a run and a tree."""

import pytest
import torch

from flashtree.kernels.deltanet_conv import conv_qkv, conv_qkv_reference
from flashtree.kernels.deltanet_gates import GateInputs, gates_reference
from tests.kernels import deltanet_conv_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_cases("tests.kernels.deltanet_conv_cases")


@pytest.mark.slow  # the Triton interpreter: seconds per case
@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernel_matches_reference(interpreter_errors, case):
    # float32: summation order only; bfloat16: plus a flipped rounding of the conv sum or SiLU somewhere
    assert interpreter_errors[case] <= (1e-5 if case.endswith("float32") else 2e-2)


def test_reference_path_on_cpu_and_tiled_heads():
    """Without Triton the reference runs; value head h takes q/k head h % Hk."""
    gen = torch.Generator().manual_seed(1)
    inputs, state = torch.randn(3, 10 * 8, generator=gen), torch.randn(3, 10 * 8, generator=gen)
    weight = torch.randn(80, 4, generator=gen)
    args = (inputs, torch.tensor([-1, 0, 1]), state, weight, 2, 6, 8)
    gates = GateInputs(torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen), -torch.rand(6), torch.zeros(6))
    q, k, v, g, beta = conv_qkv(*args, gates)
    want = (*conv_qkv_reference(*args), *gates_reference(*gates))
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, g, beta), want))
    assert torch.equal(q[:, 0], q[:, 2]) and torch.equal(k[:, 1], k[:, 5])
    assert torch.allclose(k.norm(dim=-1), torch.ones(3, 6), atol=1e-5)
