"""A tree verify's attention over TQ3_0 (and Q8_0) rows in CUDA C (kernels/attention_verify.cu): when
`tree_attention` takes it, that its launch fits an SM, that NVRTC compiles it, and on the GPU its output against the
reference over the float16 pair values, against the Triton verify, across splits, trees, masks, query strides and a
CUDA graph."""

import pytest
import torch

from flashtree.kernels import attention_verify
from flashtree.kernels.cuda_functions import target
from flashtree.kernels.kv_quant import kv_type
from flashtree.kernels.tree_attention import _in_cuda
from flashtree.nvrtc import compile_cubin

from tests.kernels import tree_attention_cases as cases
from tests.kernels.tq3_cuda_cases import (caches, error_after_the_start_moved, error_against_triton,
                                          errors_against_exact, nvrtc_available, pair_reference)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_it_takes_a_tree_of_normed_tokens_over_tq3_0_rows():
    k, v = caches()
    q = torch.randn(24, 23, 256)
    assert attention_verify.fits(q, k, v, ("tq3_0", "tq3_0"), 0, True)
    assert attention_verify.fits(q.bfloat16(), k, v, ("tq3_0", "tq3_0"), 0, True)
    assert attention_verify.fits(torch.randn(23, 24, 256).transpose(0, 1), k, v, ("tq3_0", "tq3_0"), 0, True)
    assert attention_verify.fits(torch.randn(24, 32, 256), k, v, ("tq3_0", "tq3_0"), 0, True)  # 192 rows a KV head
    assert not attention_verify.fits(torch.randn(24, 33, 256), k, v, ("tq3_0", "tq3_0"), 0, True)  # 198
    assert not attention_verify.fits(torch.randn(24, 1, 256), k, v, ("tq3_0", "tq3_0"), 0, True)  # a decode
    assert not attention_verify.fits(q.half(), k, v, ("tq3_0", "tq3_0"), 0, True)  # no instance for f16 queries
    assert not attention_verify.fits(q, k, v, ("tq3_0", "q8_0"), 0, True)
    assert not attention_verify.fits(q, k, v, ("tq3_0", "tq3_0"), 1024, True)  # a window
    assert not attention_verify.fits(q, k, v, ("tq3_0", "tq3_0"), 0, False)  # q normed in the kernel
    k128, v128 = caches(d=128)  # 56-byte rows: no whole 16-byte copies
    assert not attention_verify.fits(torch.randn(24, 23, 128), k128, v128, ("tq3_0", "tq3_0"), 0, True)
    assert not attention_verify.fits(q, k[:, :, 2:], v, ("tq3_0", "tq3_0"), 0, True)  # rows off 16-byte alignment
    assert not attention_verify.takes(q, k, v, ("tq3_0", "tq3_0"), 0, True, 1 << 20)  # on the CPU: never


def test_it_takes_q8_0_rows_on_both_sides():
    k, v = caches(kind="q8_0")
    q = torch.randn(24, 23, 256)
    assert attention_verify.fits(q, k, v, ("q8_0", "q8_0"), 0, True)
    assert attention_verify.fits(q.bfloat16(), k, v, ("q8_0", "q8_0"), 0, True)
    assert not attention_verify.fits(q, k, v, ("q8_0", "q4_0"), 0, True)
    assert not attention_verify.fits(q, *caches(kind="q4_0"), ("q4_0", "q4_0"), 0, True)
    assert not attention_verify.fits(q, k, v, ("q8_0", "q8_0"), 0, False)  # q normed in the kernel


def test_a_cta_fits_an_sm_and_the_splits_fill_the_gpu():
    for tail in (False, True):
        for kind in attention_verify.KINDS:
            assert attention_verify.shared_bytes(256, tail, kind) <= 227 * 1024
    assert attention_verify.shared_bytes(256, False, "tq3_0") == 2 * 2 * 64 * 112 + 3 * 64 * 256 * 2 + 128 * 256 * 2
    assert attention_verify.shared_bytes(256, True, "tq3_0") == (2 * 2 * 64 * 112 + 3 * 64 * 256 * 2 + 144 * 256 * 2
                                                                 + 16 * 144 + 8 * 16 * 4)
    # Q8_0's 272-byte rows: two decoded sides, not three
    assert attention_verify.shared_bytes(256, True, "q8_0") == (2 * 2 * 64 * 272 + 2 * 64 * 256 * 2 + 144 * 256 * 2
                                                                + 16 * 144 + 8 * 16 * 4)
    assert not attention_verify.has_tail(128) and attention_verify.has_tail(129) and attention_verify.has_tail(144)
    assert not attention_verify.has_tail(145)  # two CTAs of 128 rows
    assert attention_verify.slices_for(128) == 1 and attention_verify.slices_for(138) == 1  # 23 tokens: one CTA
    assert attention_verify.slices_for(144) == 1 and attention_verify.slices_for(145) == 2
    assert attention_verify.splits_for(262144, 4, 132, 256) == 16  # a CTA an SM over 4 KV heads x 2 slices
    assert attention_verify.splits_for(262144, 4, 132, 256, query_rows=138) == 33  # one slice
    assert attention_verify.splits_for(262144, 1, 132, 256, query_rows=64) == 132
    assert attention_verify.splits_for(1000, 4, 132, 256) == 8  # each split at least 2 chunks of 64 rows
    assert attention_verify.splits_for(5, 4, 132, 256) == 1


@pytest.mark.skipif(not nvrtc_available(), reason="needs cuda-python and NVRTC")
@pytest.mark.parametrize("d", attention_verify.HEAD_DIMS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("kind", attention_verify.KINDS)
def test_every_instance_compiles(d, q_dtype, tail, kind):
    source = attention_verify.source(d, q_dtype, tail, kind)
    assert target(source, "sm_90") == "sm_90a"  # warpgroup MMA
    assert compile_cubin(source, "sm_90a")[:4] == b"\x7fELF"


def _inputs(kv_end, n, q_dtype=torch.float32, seed=0, at_end=False, token_major=False, d=256, kind="tq3_0"):
    """The 27B's heads over random `kind` rows, a random tree of `n` new rows at start, three garbage rows after them;
    `at_end`: kv_end at the last new row; `token_major`: q a [heads, T, D] view of [T, heads, D] rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = kv_type(kind)
    start = kv_end - n - 3
    k = t.quantize(torch.randn(4, kv_end, d, generator=g, device="cuda") * 2)
    v = t.quantize(torch.randn(4, kv_end, d, generator=g, device="cuda"))
    k[:, start + n:] = 255
    v[:, start + n:] = 255
    _, depths, visible = cases.tree(n, seed)
    q = torch.randn(n, 24, d, generator=g, device="cuda").to(q_dtype)
    return dict(q=q.transpose(0, 1) if token_major else q.transpose(0, 1).contiguous(), k_cache=k, v_cache=v,
                kv_type_k=kind, kv_type_v=kind, start_t=torch.tensor([start], device="cuda"),
                visible=visible.cuda(), positions=(start + depths).cuda(), kv_end=start + n if at_end else kv_end,
                scale=d ** -0.5)


def _run(args, q_dtype):
    return _in_cuda(attention_verify, args["q"], args["k_cache"], args["v_cache"], args["kv_type_k"],
                    args["start_t"], args["visible"], args["kv_end"], args["scale"], None, False, q_dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_end, n, seed", [(40, 2, 0), (100, 23, 1), (4100, 5, 2), (70000, 23, 3), (70000, 32, 4),
                                             (20000, 24, 6), (20000, 21, 7), (9000, 22, 8),
                                             pytest.param(262144, 23, 5, marks=pytest.mark.slow)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", attention_verify.KINDS)
def test_the_verify_matches_the_reference_on_gpu(kv_end, n, seed, q_dtype, kind):
    """The CUDA verify against the reference over the float16 pair values: q rounded to float16 at 2^-11, P likewise,
    float32 sums, the output in q's dtype (bf16: 2^-8); over short ranges (one split, one partial chunk), splits with a
    partial last chunk, 2 to 32 tokens (up to 192 query rows a KV head: 21 tokens fill the two warpgroups' 128, 22 to
    24 take the 16-row tail, 32 two CTAs, the last warpgroup's partly padding), random
    trees, garbage rows past them, kv_end at the last new row (odd seeds) or past it, q token-major (seeds 3, 4)."""
    args = _inputs(kv_end, n, q_dtype, seed, at_end=seed % 2 == 1, token_major=seed in (3, 4), kind=kind)
    takes = attention_verify.takes(args["q"], args["k_cache"], args["v_cache"], (kind, kind), 0, True,
                                   args["kv_end"])
    assert takes == (args["kv_end"] >= attention_verify.MIN_ROWS)
    out = _run(args, q_dtype)
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    assert cases.relative_error(out, pair_reference(args)) <= (1e-2 if q_dtype == torch.bfloat16 else 4e-3)


@pytest.mark.gpu
@gpu
def test_gated_and_rotated_back_as_the_triton_verify_on_gpu():
    """The model's call (a float32 query, bf16 operands, the output gate, TQ3_0 values rotated back in the
    combine): the CUDA verify against the Triton one."""
    assert error_against_triton(_inputs(70000, 23, token_major=True)) <= 4e-3


@pytest.mark.gpu
@gpu
def test_the_model_call_over_q8_0_rows_as_the_triton_verify_on_gpu():
    """A bf16 query normed apart (the 27B verify's), the output gate, Q8_0 values (nothing to rotate back): the CUDA
    verify and the Triton one, each against the exact result (Triton's values bf16-rounded, the CUDA verify's
    float16)."""
    cuda, triton_path = errors_against_exact(_inputs(70000, 23, torch.bfloat16, token_major=True, kind="q8_0"))
    assert cuda <= triton_path + 2e-3, (cuda, triton_path)  # no worse than the Triton verify it replaces


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", attention_verify.KINDS)
def test_the_verify_replays_in_a_cuda_graph_on_gpu(kind):
    assert error_after_the_start_moved(_inputs(16400, 23, kind=kind), 9000) <= 4e-3
