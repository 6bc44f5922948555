"""kernels.gemm_layout: CPU weights K-major (the layout MKL's sgemm multiplies 16-23 rows fastest in), the same
products as the row-major weight; a CPU `Linear` and the draft's matrices take it at load."""

import torch

from flashtree.engine.loader import DEMO_DRAFT
from flashtree.kernels import gemm_layout
from flashtree.models.dflash import DFlashDraft
from flashtree.models.layers import Linear


def _k_major(w: torch.Tensor) -> bool:
    return w.t().is_contiguous() and not w.is_contiguous()


def test_a_cpu_weight_goes_k_major_and_multiplies_as_before():
    w = torch.randn(96, 64)
    laid = gemm_layout(w)
    assert _k_major(laid) and torch.equal(laid, w) and gemm_layout(laid) is laid
    for rows in (1, 16, 23):
        x = torch.randn(rows, 64)
        assert torch.allclose(torch.nn.functional.linear(x, laid), torch.nn.functional.linear(x, w), rtol=1e-5,
                              atol=1e-5)


def test_a_k_major_weight_off_the_cpu_is_row_major_again():
    laid = gemm_layout(torch.randn(96, 64)).to("meta")
    assert gemm_layout(laid).is_contiguous()
    row_major = torch.randn(96, 64, device="meta")
    assert gemm_layout(row_major) is row_major


def test_cpu_linears_and_the_drafts_matrices_are_k_major():
    assert _k_major(Linear(torch.randn(32, 16)).weight)
    assert _k_major(Linear(torch.randn(32, 16)).to("cpu").weight)
    draft = DFlashDraft.load(DEMO_DRAFT, device="cpu", dtype=torch.float32)
    linears = [m for m in draft.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(_k_major(m.weight) for m in linears)
