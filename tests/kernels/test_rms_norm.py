"""kernels/rms_norm: the Triton kernel against the torch reference (CPU interpreter, in a subprocess); the cluster
add + RMSNorm (add_rms_norm.cu, with and without the quantized matmul's float16 x) compiled offline and checked on a
Hopper GPU."""

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from flashtree.kernels import rms_norm as rms_norm_module
from flashtree.kernels.quant_matmul import mma
from flashtree.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_reference
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


def test_cluster_kernel_compiles_for_sm90_without_a_gpu():
    """add_rms_norm.cu through NVRTC (no GPU needed): Hopper's cluster barriers and distributed shared memory."""
    pytest.importorskip("cuda.bindings")
    from flashtree.nvrtc import compile_cubin

    assert compile_cubin(rms_norm_module.cluster_source(), "sm_90")[:4] == b"\x7fELF"


def test_cluster_kernel_takes_only_few_float32_gpu_rows():
    h, w = torch.zeros(1, 5120), torch.ones(5120)
    assert not rms_norm_module._cluster_kernel_takes(h, w)  # a CPU tensor


cuda_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                                 reason="needs a CUDA GPU with thread-block clusters (sm_90+)")


@pytest.mark.gpu
@cuda_hopper
@pytest.mark.parametrize("dim", [5120, 2048, 256, 4096 + 32, 40960])
def test_cluster_add_rms_norm_on_gpu(dim):
    """The cluster kernel takes float32 rows: total is h + delta exactly, normed within float32 rounding of the
    reference, each row's bits the same whatever rows are beside it (decode and verify rows agree), and the launch
    replays in a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(dim)
    h = torch.randn(64, dim, device="cuda", generator=gen) * 4
    delta = torch.randn(64, dim, device="cuda", generator=gen)
    w = 1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)
    assert rms_norm_module._cluster_kernel_takes(h, w)
    total, normed = add_rms_norm(h, delta, w, 1e-6)
    assert torch.equal(total, h + delta)
    want = rms_norm_reference(h + delta, w, 1e-6)
    assert ((normed - want).abs().max() / want.abs().max()).item() < 1e-6
    for rows in (1, 2, 23):
        sub_total, sub_normed = add_rms_norm(h[:rows].contiguous(), delta[:rows].contiguous(), w, 1e-6)
        assert torch.equal(sub_total, total[:rows]) and torch.equal(sub_normed, normed[:rows]), rows
    x, d = h[:23].clone(), delta[:23].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = add_rms_norm(x, d, w, 1e-6)
    x.copy_(h[23:46])
    d.copy_(delta[23:46])
    graph.replay()
    assert torch.equal(graphed[0], total[23:46]) and torch.equal(graphed[1], normed[23:46])


@pytest.mark.gpu
@cuda_hopper
def test_rows_past_the_cluster_kernel_keep_the_triton_kernel_on_gpu():
    h = torch.randn(rms_norm_module.CLUSTER_MAX_ROWS + 1, 5120, device="cuda")
    w = torch.ones(5120, device="cuda")
    assert not rms_norm_module._cluster_kernel_takes(h, w)
    assert not rms_norm_module._cluster_kernel_takes(h[:4].bfloat16(), w)
    unaligned = h.view(-1)[1:5121].view(1, 5120)  # contiguous, 4 bytes past a 16-byte boundary
    assert not rms_norm_module._cluster_kernel_takes(unaligned, w)
    total, normed = add_rms_norm(h, h, w, 1e-6)
    assert torch.equal(total, h + h)
    want = rms_norm_reference(h + h, w, 1e-6)
    assert ((normed - want).abs().max() / want.abs().max()).item() < 1e-6


@pytest.mark.gpu
@cuda_hopper
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dim", [5120, 256, 4096 + 256, 40960])
def test_the_norm_writes_prep_xs_float16_x_on_gpu(qtype, dim):
    """Asked for a type's float16 x, the cluster kernel writes prep_x's outputs for its normed rows bit for bit (rows
    of ordinary, tiny, huge and zero magnitude; a CTA's columns past its last warp's, K of one super-block and a
    second float4 a thread), total and normed stay the plain launch's, the matmul after it takes the written x, and
    the launch replays in a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(dim)
    magnitudes = torch.tensor([1.0, 1e-30, 1e30, 0.0, 3.0] * 5, device="cuda")[:23, None]
    h = torch.randn(23, dim, device="cuda", generator=gen) * magnitudes
    delta = torch.randn(23, dim, device="cuda", generator=gen) * magnitudes
    w = 1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)
    plain = add_rms_norm(h, delta, w, 1e-6)
    total, normed = add_rms_norm(h, delta, w, 1e-6, x_f16=qtype)
    assert torch.equal(total, plain[0]) and torch.equal(normed, plain[1])
    written = mma._written_x_f16(normed, qtype)
    assert written is not None and mma.prepare_x(normed, qtype) is written
    converted = mma.prepare_x(normed.clone(), qtype)  # prep_x's own launch
    assert len(written) == len(converted)
    for mine, theirs in zip(written, converted):
        assert torch.equal(mine.view(torch.int16 if mine.dtype == torch.float16 else torch.int32),
                           theirs.view(torch.int16 if theirs.dtype == torch.float16 else torch.int32))
    x, d = h[:2].clone(), delta[:2].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = add_rms_norm(x, d, w, 1e-6, x_f16=qtype)
    x.copy_(h[5:7])
    d.copy_(delta[5:7])
    graph.replay()
    replayed = mma._written_x_f16(graphed[1], qtype)
    assert torch.equal(replayed[0], mma.prepare_x(normed[5:7].clone(), qtype)[0])


def test_the_norm_writes_float16_x_only_for_the_float16_kernels_types(monkeypatch):
    assert rms_norm_module._writes_x_f16(QType.Q4_K, 5120) and rms_norm_module._writes_x_f16(QType.Q6_K, 256)
    assert not rms_norm_module._writes_x_f16(None, 5120) and not rms_norm_module._writes_x_f16(QType.Q8_0, 5120)
    assert not rms_norm_module._writes_x_f16(QType.Q4_K, 4096 + 32)  # not whole super-blocks
    monkeypatch.setenv("FLASHTREE_NORM_WRITES_X", "0")
    assert not rms_norm_module._writes_x_f16(QType.Q4_K, 5120)
