import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType
from gguf import quants as gguf_quants

from flashtree.errors import FlashtreeError
from flashtree.formats import quants

ROWS, COLS = 6, 512

# byte offsets of the fp16 fields in each block type: random bytes there could be NaN/inf
FP16_FIELDS = {
    QType.Q8_0: (0,),
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
    QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),
    QType.MXFP4: (),
}
PLAIN = (QType.F32, QType.F16, QType.BF16)
# RMS relative error bounds for a standard-normal matrix
ROUND_TRIP_BOUNDS = {
    QType.F32: 0.0,
    QType.F16: 1e-3,
    QType.BF16: 5e-3,
    QType.Q8_0: 0.01,
    QType.Q6_K: 0.02,
    QType.Q5_K: 0.04,
    QType.Q5_0: 0.05,
    QType.Q5_1: 0.05,
    QType.Q4_K: 0.08,
    QType.IQ4_XS: 0.085,
    QType.IQ4_NL: 0.085,
    QType.Q4_0: 0.1,
    QType.Q4_1: 0.1,
    QType.MXFP4: 0.13,
}


def random_bytes(qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """Valid encoded bytes for a [ROWS, COLS] tensor: random, but with finite moderate fp16 scales."""
    if qtype in PLAIN:
        return quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32) * 100, qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (ROWS * COLS // block, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.uniform(-2, 2, blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.reshape(-1, 1).view(np.uint8)
    if qtype == QType.MXFP4:  # cover the subnormal scales and keep 12 * 2^(e-128) finite
        blocks[:, 0] = rng.integers(0, 250, blocks.shape[0])
        blocks[:3, 0] = [0, 1, 2]
    return blocks.reshape(ROWS, -1)


def reference(raw: np.ndarray, qtype: QType) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw, qtype), dtype=np.float32))


def test_supported_types_are_the_engine_set():
    assert quants.SUPPORTED_TYPES == set(FP16_FIELDS) | set(PLAIN)


@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED_TYPES), ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_exactly(qtype):
    raw = random_bytes(qtype, np.random.default_rng(int(qtype)))
    ours = quants.dequantize(torch.from_numpy(raw), qtype, (ROWS, COLS))
    expected = reference(raw, qtype).reshape(ROWS, COLS)
    assert not expected.isnan().any()
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)


def test_dequantize_in_chunks_with_cast_and_any_raw_shape(monkeypatch):
    raw = random_bytes(QType.Q4_K, np.random.default_rng(1))
    expected = reference(raw, QType.Q4_K).reshape(ROWS, COLS)
    monkeypatch.setattr(quants, "_CHUNK_ELEMENTS", 512)
    ours = quants.dequantize(torch.from_numpy(raw.reshape(-1)), QType.Q4_K, (ROWS, COLS), torch.bfloat16)
    assert torch.equal(ours, expected.to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED_TYPES), ids=lambda t: t.name)
def test_dequantize_on_cuda(qtype):
    raw = random_bytes(qtype, np.random.default_rng(int(qtype)))
    ours = quants.dequantize(torch.from_numpy(raw).cuda(), qtype, (ROWS, COLS))
    assert ours.is_cuda and torch.equal(ours.cpu(), reference(raw, qtype).reshape(ROWS, COLS))


@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED_TYPES), ids=lambda t: t.name)
def test_quantize_round_trip(qtype):
    x = np.random.default_rng(7).standard_normal((16, 1024)).astype(np.float32)
    raw = quants.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (16, quants.bytes_for(qtype, (1024,)))
    back = reference(raw, qtype).reshape(x.shape)
    error = np.linalg.norm(back.numpy() - x) / np.linalg.norm(x)
    assert error <= ROUND_TRIP_BOUNDS[qtype]
    assert torch.equal(quants.dequantize(torch.from_numpy(raw), qtype, x.shape), back)


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, QType.IQ4_NL], ids=lambda t: t.name)
def test_quantize_zeros_and_constants(qtype):
    x = np.zeros((3, 256), dtype=np.float32)
    x[1] = 0.5
    x[2, :128] = -3.0
    back = reference(quants.quantize(x, qtype), qtype).reshape(x.shape).numpy()
    np.testing.assert_allclose(back, x, atol=0.05)


def test_unsupported_type_names_it_and_the_supported_ones():
    with pytest.raises(FlashtreeError, match=r"IQ2_XXS.*supported:.*Q4_K"):
        quants.dequantize(torch.zeros(66, dtype=torch.uint8), QType.IQ2_XXS, (256,))
    with pytest.raises(FlashtreeError, match="Q2_K"):
        quants.quantize(np.zeros((1, 256), dtype=np.float32), QType.Q2_K)


def test_wrong_byte_count():
    with pytest.raises(FlashtreeError, match="needs 288 bytes, got 287"):
        quants.dequantize(torch.zeros(287, dtype=torch.uint8), QType.Q4_K, (2, 256))


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q8_0, QType.IQ4_XS], ids=lambda t: t.name)
def test_quantize_rejects_partial_blocks(qtype):
    with pytest.raises(FlashtreeError, match="multiple of"):
        quants.quantize(np.zeros((2, 1000), dtype=np.float32), qtype)


def test_helpers():
    assert quants.type_name(QType.Q6_K) == "Q6_K"
    assert quants.block_size(QType.Q5_K) == 256
    assert quants.bytes_for(QType.Q6_K, (3, 512)) == 3 * 2 * 210
    assert quants.bytes_for(QType.BF16, (4, 5)) == 40


def test_torch_q8_0_quantizer_is_byte_identical_to_gguf():
    x = np.random.default_rng(3).standard_normal((7, 256)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block
    x[2, :32] = np.arange(-16, 16) / 2 * (np.abs(np.arange(-16, 16) / 2).max() / 127)  # halves of the step: ties
    ours = quants.quantize_q8_0(torch.from_numpy(x)).numpy()
    theirs = quants.quantize(x, QType.Q8_0).reshape(ours.shape)
    assert np.array_equal(ours, theirs)
