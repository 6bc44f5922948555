"""Quantized matmul: layout round trip, errors, torch paths in-process; Triton kernels through the
interpreter in a subprocess (TRITON_INTERPRET must be set before triton is imported); real sizes on GPU."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.formats import quants
from flashtree.kernels.quant_matmul import (KERNELS, PLAIN_TYPES, QuantWeight, quant_matmul,
                                            quant_matmul_reference, random_quant_weight)

from tests.kernels import quant_matmul_cases as cases
from tests.kernels.interpreter import run_cases

# of max |reference|: float32 x: float32 weights (ieee/tf32x3 dot); float16: weights and the output
# rounded to float16; bfloat16 (a float32 dot in the interpreter): one output rounding
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 8e-3}


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_cases("tests.kernels.quant_matmul_cases")


@pytest.mark.slow  # the Triton interpreter: seconds per case
@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernel_matches_reference(interpreter_errors, case):
    value = interpreter_errors[case]
    if case.endswith("-deterministic"):
        assert value == 1.0  # two split-K calls were bit-identical
    elif case.endswith("-rounded-ulps"):
        # against weights rounded to x's dtype: the final rounding, plus float32 accumulation order where
        # an output sits next to a rounding boundary or near 0 (seen: 2.3 with BLOCK_N 128 > N = 48)
        assert value <= 3.0
    else:
        assert value <= TOLERANCE[case.split("-")[2]]


def test_split_k_reduction_has_no_atomics():
    """Split-K partials are summed in a fixed order (greedy speculative decoding must reproduce)."""
    source = (Path(__file__).resolve().parents[2] / "src/flashtree/kernels/quant_matmul")
    for path in source.glob("*.py"):
        assert "tl.atomic" not in path.read_text(), path.name


def test_choose_config_defaults(monkeypatch):
    pytest.importorskip("triton")
    from flashtree.kernels.quant_matmul._launch import choose_config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    choose_config.cache_clear()
    cuda = torch.device("cpu")  # stands in for an H200 (132 SMs) without asking CUDA
    reduction_orders = set()
    for m in (2, 16, 23, 64):
        config = choose_config(m, 17408, 5120, torch.bfloat16, cuda, 256, 64)
        assert config.tiled and config.dot == "x_dtype" and config.block_m == max(16, 1 << (m - 1).bit_length())
        assert 5120 % (config.block_k * config.split_k) == 0 and config.block_n == 128
        reduction_orders.add((config.block_k, config.split_k))
    assert len(reduction_orders) == 1  # every verify size sums K in one order: bit-identical rows
    decode = choose_config(1, 17408, 5120, torch.bfloat16, cuda, 256, 64)
    assert not decode.tiled and decode.dot == "fma"  # M = 1: v1 measured faster (Q4_K, Q5_K, Q8_0)
    tiled_decode = choose_config(1, 17408, 5120, torch.bfloat16, cuda, 256, 64, tiled_decode=True)
    assert tiled_decode.tiled and (tiled_decode.block_k, tiled_decode.split_k) in reduction_orders  # Q6_K
    assert choose_config(23, 17408, 5120, torch.bfloat16, cuda, 256, 64, tiled_block_n=64).block_n == 64
    assert choose_config(23, 17408, 5120, torch.float32, cuda, 256, 64).dot == "tf32x3"
    assert not choose_config(65, 17408, 5120, torch.bfloat16, cuda, 256, 64).tiled  # prefill: v1
    assert choose_config(1, 17408, 5120, torch.bfloat16, cuda, 256, 0).dot == "fma"  # no v2 kernel
    choose_config.cache_clear()


@pytest.mark.parametrize("qtype", list(KERNELS), ids=lambda t: t.name)
def test_relayout_round_trip_is_bit_exact(qtype):
    w = cases.weight(qtype)
    raw = torch.from_numpy(quants.quantize(np.random.default_rng(1).standard_normal(w.shape).astype(np.float32),
                                           qtype))
    packed = QuantWeight.from_gguf_bytes(raw, qtype, w.shape)
    assert packed.nbytes == raw.numel() and not torch.equal(packed.raw, raw.reshape(-1))
    assert torch.equal(packed.gguf_bytes(), raw)
    assert torch.equal(packed.dequantize(), quants.dequantize(raw, qtype, w.shape))


def test_torch_fallback_without_triton_matches_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = cases.weight(QType.Q4_K)
    x = torch.randn(3, w.shape[1])
    assert torch.allclose(quant_matmul(x, w), quant_matmul_reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", list(PLAIN_TYPES), ids=lambda t: t.name)
def test_plain_types_pass_through_to_torch(qtype):
    values = torch.randn(6, 64).to(PLAIN_TYPES[qtype])
    w = QuantWeight.from_gguf_bytes(values.view(torch.uint8).reshape(-1), qtype, (6, 64))
    x = torch.randn(2, 64)
    assert w.nbytes == values.numel() * values.element_size()
    assert torch.allclose(quant_matmul(x, w), x @ values.float().T, rtol=1e-5, atol=1e-5)
    assert torch.equal(w.dequantize(), values.float())


def test_errors_name_the_problem():
    raw = torch.zeros(2 * 144, dtype=torch.uint8)
    with pytest.raises(FlashtreeError, match="needs 288 bytes, got 287"):
        QuantWeight.from_gguf_bytes(raw[:-1], QType.Q4_K, (2, 256))
    with pytest.raises(FlashtreeError, match="multiple of 256"):
        QuantWeight.from_gguf_bytes(raw, QType.Q4_K, (2, 200))
    with pytest.raises(FlashtreeError, match=r"Q4_0 \(supported: Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS, F32, F16, BF16\)"):
        QuantWeight.from_gguf_bytes(raw, QType.Q4_0, (2, 256))
    with pytest.raises(FlashtreeError, match="uint8"):
        QuantWeight.from_gguf_bytes(raw.float(), QType.Q4_K, (2, 256))
    w = QuantWeight.from_gguf_bytes(raw, QType.Q4_K, (2, 256))
    with pytest.raises(FlashtreeError, match=r"x of shape \[M, 256\]"):
        quant_matmul(torch.zeros(1, 128), w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(5120, 5120), pytest.param((17408, 5120), marks=pytest.mark.slow)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
# the fast GPU subset keeps the two types of the tensor-core path; the full GPU suite (slow) runs all
@pytest.mark.parametrize("qtype", [t if t in (QType.Q4_K, QType.Q6_K) else pytest.param(t, marks=pytest.mark.slow)
                                   for t in KERNELS], ids=lambda t: t.name)
def test_real_sizes_on_gpu(qtype, shape):
    w = random_quant_weight(qtype, *shape, device="cuda")
    dense = w.dequantize()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rounded = {dtype: dense.to(dtype).float() for dtype in (torch.bfloat16, torch.float16)}
    for m in (1, 8, 23, 64, 512):
        x = torch.randn(m, shape[1], generator=gen, device="cuda")
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            xd = x.to(dtype)
            ref = xd.float() @ dense.T
            y = quant_matmul(xd, w)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            # bf16/f16 x multiplies weights rounded to x's dtype on tensor cores, except the fragment-ordered
            # (Q4_K/Q6_K) kernels' bf16 rows, which keep the weights exact: only the output's rounding is left
            exact = w.mma_layout and dtype == torch.bfloat16 and m <= 32
            bound = 1e-4 if dtype == torch.float32 else 2.0 ** -8 if exact else (2e-2 if m > 64 else 1e-2)
            assert err <= bound, (m, name, err)
            if dtype != torch.float32 and m <= 64 and not exact:
                # v2 skinny path: vs weights rounded to x's dtype only accumulation order and the
                # final rounding differ (2 output roundings of slack, relative to the largest output)
                tight = (xd.float() @ rounded[dtype].T)
                err = ((y.float() - tight).abs().max() / tight.abs().max()).item()
                assert err <= 2 * 2.0 ** -(8 if dtype == torch.bfloat16 else 11), (m, name, err)
                assert torch.equal(y, quant_matmul(xd, w)), (m, name)  # deterministic (split-K, no atomics)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.Q8_0])
def test_rows_do_not_depend_on_how_many_rows_there_are(qtype):
    """Verify sizes give each row the same bits within a kernel configuration (2-64 rows; the float16 kernels
    of Q4_K and Q6_K: within classes of row counts, `mma.choose_config`); a decode row (one row) takes a faster
    kernel that sums K in another order (Q4_K/Q6_K: the one-row MMA kernel; Q8_0: the v1 kernel): within
    an output rounding, as across Q4_K's two classes."""
    weight = random_quant_weight(qtype, 5120, 5120, "cuda")
    x = torch.randn(40, 5120, dtype=torch.bfloat16, device="cuda")
    together = quant_matmul(x[:23], weight)
    for i in (0, 7, 21):
        assert torch.equal(quant_matmul(x[i : i + 17], weight)[0], together[i])
        pair, row = quant_matmul(x[i : i + 2], weight)[0].float(), together[i].float()
        if qtype in (QType.Q4_K, QType.Q6_K):
            assert ((pair - row).abs() <= row.abs() * 2.0**-7 + 1e-5 * row.abs().max()).all()
        else:
            assert torch.equal(pair, row)
        alone = quant_matmul(x[i : i + 1], weight)[0].float()
        row = together[i].float()
        assert ((alone - row).abs() <= row.abs() * 2.0**-7 + 1e-5 * row.abs().max()).all()
