"""One token's attention over TQ3_0 or Q8_0 rows in CUDA C (kernels/attention_decode.cu): when `tree_attention` takes
it, that its launch fits an SM three (TQ3_0) or two (Q8_0) times over, that NVRTC compiles it, and on the GPU its
output against the reference over the float16 values it decodes, against the Triton decode, across splits, masks and
a CUDA graph."""

import pytest
import torch

from flashtree.kernels import attention_decode
from flashtree.kernels.kv_quant import kv_type
from flashtree.kernels.tree_attention import _in_cuda
from flashtree.nvrtc import compile_cubin

from tests.kernels import tree_attention_cases as cases
from tests.kernels.tq3_cuda_cases import (caches, error_after_the_start_moved, error_against_triton,
                                          errors_against_exact, nvrtc_available, pair_reference)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_it_takes_one_normed_token_over_tq3_0_rows_only():
    k, v = caches()
    q = torch.randn(24, 1, 256)
    assert attention_decode.fits(q, k, v, ("tq3_0", "tq3_0"), 0, True)
    assert attention_decode.fits(q.bfloat16(), k, v, ("tq3_0", "tq3_0"), 0, True)
    assert not attention_decode.fits(q.half(), k, v, ("tq3_0", "tq3_0"), 0, True)  # no instance for f16 queries
    assert not attention_decode.fits(torch.randn(24, 2, 256), k, v, ("tq3_0", "tq3_0"), 0, True)  # two tokens
    assert not attention_decode.fits(q, k, v, ("tq3_0", "q8_0"), 0, True)
    assert not attention_decode.fits(q, k, v, ("tq3_0", "tq3_0"), 1024, True)  # a window
    assert not attention_decode.fits(q, k, v, ("tq3_0", "tq3_0"), 0, False)  # q normed in the kernel
    assert not attention_decode.fits(torch.randn(40, 1, 256), k, v, ("tq3_0", "tq3_0"), 0, True)  # 10 a KV head
    k512, v512 = caches(d=512)
    assert not attention_decode.fits(torch.randn(24, 1, 512), k512, v512, ("tq3_0", "tq3_0"), 0, True)
    assert not attention_decode.fits(q, k[:, :, 2:], v, ("tq3_0", "tq3_0"), 0, True)  # rows off 16-byte alignment
    assert not attention_decode.takes(q, k, v, ("tq3_0", "tq3_0"), 0, True, 1 << 20)  # on the CPU: never


def test_it_takes_q8_0_rows_on_both_sides_and_tells_the_kinds_apart():
    k, v = caches(kind="q8_0")
    q = torch.randn(24, 1, 256)
    assert attention_decode.fits(q, k, v, ("q8_0", "q8_0"), 0, True)
    assert not attention_decode.fits(q, k, v, ("q8_0", "q4_0"), 0, True)
    assert not attention_decode.fits(q, k, v, ("q4_0", "q4_0"), 0, True)  # no instance for Q4_0
    assert not attention_decode.fits(q, k, v, ("f16", "f16"), 0, True)
    tq3_k, tq3_v = caches()
    assert not attention_decode.fits(q, tq3_k, tq3_v, ("q8_0", "q8_0"), 0, True)  # rows of another block size


def test_its_ctas_fit_an_sm_and_the_splits_fill_the_gpu():
    assert 3 * attention_decode.shared_bytes(256, "tq3_0") <= 227 * 1024
    assert attention_decode.shared_bytes(256, "tq3_0") == 4 * (2 * 2 * 16 * 112 + 16 * 264 * 2 + 16 * 8 * 2)
    assert 2 * attention_decode.shared_bytes(256, "q8_0") <= 227 * 1024 < 3 * attention_decode.shared_bytes(256, "q8_0")
    assert attention_decode.shared_bytes(256, "q8_0") == 4 * (2 * 2 * 16 * 272 + 16 * 264 * 2 + 16 * 8 * 2)
    assert attention_decode.splits_for(262144, 4, 132, 256, "tq3_0") == 99  # 3 CTAs an SM over 4 KV heads
    assert attention_decode.splits_for(262144, 4, 132, 256, "q8_0") == 66  # 2
    assert attention_decode.splits_for(262144, 1, 132, 256, "tq3_0") == 256  # the combine's cap
    assert attention_decode.splits_for(1000, 4, 132, 256, "tq3_0") == 8  # each warp at least 2 chunks of 16 rows
    assert attention_decode.splits_for(5, 4, 132, 256, "q8_0") == 1


@pytest.mark.skipif(not nvrtc_available(), reason="needs cuda-python and NVRTC")
@pytest.mark.parametrize("d", attention_decode.HEAD_DIMS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", attention_decode.KINDS)
def test_every_instance_compiles(d, q_dtype, kind):
    assert compile_cubin(attention_decode.source(d, q_dtype, kind), "sm_90")[:4] == b"\x7fELF"


def _inputs(kv_end, q_dtype=torch.float32, seed=0, new_row_visible=True, d=256, kind="tq3_0"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = kv_type(kind)
    start = kv_end - 4  # the new row, then three garbage rows
    k = t.quantize(torch.randn(4, kv_end, d, generator=g, device="cuda") * 2)
    v = t.quantize(torch.randn(4, kv_end, d, generator=g, device="cuda"))
    k[:, start + 1:] = 255
    v[:, start + 1:] = 255
    return dict(q=torch.randn(24, 1, d, generator=g, device="cuda").to(q_dtype), k_cache=k, v_cache=v,
                kv_type_k=kind, kv_type_v=kind, start_t=torch.tensor([start], device="cuda"),
                visible=torch.tensor([[new_row_visible]], device="cuda"),
                positions=torch.tensor([start], device="cuda"), kv_end=start + 1 if seed % 2 else kv_end,
                scale=d ** -0.5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_end, seed", [(40, 0), (4100, 1), (70000, 2), pytest.param(262144, 3,
                                                                                      marks=pytest.mark.slow)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_row_visible", [True, False])
@pytest.mark.parametrize("kind", attention_decode.KINDS)
def test_the_decode_matches_the_reference_on_gpu(kv_end, seed, q_dtype, new_row_visible, kind):
    """The CUDA decode (what `tree_attention` runs for these calls from `MIN_ROWS` rows) against the reference over
    the float16 values it decodes (TQ3_0's pairs, Q8_0's q * d): q rounded to float16 at 2^-11, P likewise, float32
    sums, the output in q's dtype (bf16: 2^-8); over short ranges (one split, fewer chunks than warps), split ranges
    with a partial last chunk, the new row masked out or in, garbage rows past it, kv_end at the new row or past it."""
    args = _inputs(kv_end, q_dtype, seed, new_row_visible, kind=kind)
    takes = attention_decode.takes(args["q"], args["k_cache"], args["v_cache"], (kind, kind), 0, True,
                                   args["kv_end"])
    assert takes == (args["kv_end"] >= attention_decode.MIN_ROWS)
    out = _in_cuda(attention_decode, args["q"], args["k_cache"], args["v_cache"], args["kv_type_k"],
                   args["start_t"], args["visible"], args["kv_end"], args["scale"], None, False, q_dtype)
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    assert cases.relative_error(out, pair_reference(args)) <= (1e-2 if q_dtype == torch.bfloat16 else 4e-3)


@pytest.mark.gpu
@gpu
def test_gated_and_rotated_back_as_the_triton_decode_on_gpu():
    """The model's call (a float32 query, bf16 operands, the output gate, TQ3_0 values rotated back in the
    combine): the CUDA decode against the Triton one."""
    assert error_against_triton(_inputs(70000)) <= 4e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", attention_decode.KINDS)
def test_the_decode_replays_in_a_cuda_graph_on_gpu(kind):
    assert error_after_the_start_moved(_inputs(16400, kind=kind), 9000) <= 4e-3


@pytest.mark.gpu
@gpu
def test_the_model_call_over_q8_0_rows_as_the_triton_decode_on_gpu():
    """A float32 query, bf16 operands, the output gate, Q8_0 values (nothing to rotate back): the CUDA decode and the
    Triton one, each against the exact result (the Triton decode's values bf16-rounded, the CUDA one's float16)."""
    cuda, triton_path = errors_against_exact(_inputs(70000, kind="q8_0"))
    assert cuda <= triton_path + 2e-3, (cuda, triton_path)  # no worse than the Triton decode it replaces
