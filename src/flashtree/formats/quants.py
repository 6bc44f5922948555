"""GGUF tensor encodings: torch dequantization of raw block bytes, numpy quantizers.

Dequantization is bit-exact (float32) against ``gguf.quants.dequantize``: every product is formed
in the same order as there, so the rounding matches. Block layouts are in the reference notes,
section 3.2.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType
from gguf import quants as gguf_quants

from flashtree.errors import FlashtreeError

# Elements dequantized per step: bounds the float32/int64 temporaries (a few hundred MiB at most).
_CHUNK_ELEMENTS = 1 << 24

_PLAIN_DTYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}

# IQ4_NL/IQ4_XS codebook (sorted ascending) and MXFP4's doubled E2M1 values.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def type_name(qtype: QType | int) -> str:
    try:
        return QType(qtype).name
    except ValueError:
        return f"unknown type {int(qtype)}"


def block_size(qtype: QType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def bytes_for(qtype: QType, shape: tuple[int, ...]) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    cols = shape[-1] if shape else 1
    if cols % block:
        raise FlashtreeError(
            f"{type_name(qtype)} needs the last dimension to be a multiple of {block}, got shape {tuple(shape)}"
        )
    return math.prod(shape) // block * type_size


# ---------------------------------------------------------------------------------------------
# torch dequantization: each decoder maps uint8 blocks [n, type_size] to float32 [n, block_size]


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as float32 [n, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Within each run of ``group`` bytes, all low nibbles come first, then all high nibbles."""
    runs = qs.reshape(qs.shape[0], -1, group)
    return torch.cat([runs & 0xF, runs >> 4], dim=-1).reshape(qs.shape[0], -1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """Bits of each byte, least significant first: [n, k] -> [n, k, 8]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return (qh.unsqueeze(-1) >> shifts) & 1


@functools.lru_cache(maxsize=None)
def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table, made once per device: creating it copies from the host, which a CUDA
    graph capture forbids (the eager warm-up before a capture fills this cache)."""
    return torch.tensor(values, dtype=dtype, device=device)


def _lookup(values: tuple[int, ...], idx: torch.Tensor) -> torch.Tensor:
    return device_constant(values, torch.float32, idx.device)[idx.long()]


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:], 16).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:], 16).float() + _f16(b, 2)


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    # bit j of the little-endian u32 qh is bit j%8 of byte j//8
    return _nibbles(qs, 16) | (_bits(qh).reshape(qh.shape[0], 32) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_five_bit(b[:, 2:6], b[:, 6:]).float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _five_bit(b[:, 4:8], b[:, 8:]).float() + _f16(b, 2)


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte field of Q4_K/Q5_K into eight 6-bit scales and eight 6-bit mins."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return scales, mins


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * scales.float()).unsqueeze(-1)
    dm = (_f16(b, 2) * mins.float()).unsqueeze(-1)
    return (d * q.reshape(-1, 8, 32).float() - dm).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _nibbles(b[:, 16:], 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # bit j of qh[l] is the 5th bit of element 32*j + l
    high = _bits(b[:, 16:48]).transpose(1, 2).reshape(-1, 256)
    return _k_affine(b, _nibbles(b[:, 48:], 32) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, :128], 64)
    shifts = device_constant((0, 2, 4, 6), torch.uint8, b.device)
    high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts.reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)
    q = (low | (high << 4)).float() - 32
    d = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
    return (d.unsqueeze(-1) * q.reshape(-1, 16, 16)).reshape(-1, 256)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _lookup(IQ4_VALUES, _nibbles(b[:, 2:], 16))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    low = torch.stack([b[:, 4:8] & 0xF, b[:, 4:8] >> 4], dim=-1).reshape(-1, 8)
    shifts = device_constant((0, 2, 4, 6), torch.uint8, b.device)
    high = ((b[:, 2:4].unsqueeze(-1) >> shifts) & 3).reshape(-1, 8)
    dl = (_f16(b, 0) * ((low | (high << 4)).float() - 32)).unsqueeze(-1)
    values = _lookup(IQ4_VALUES, _nibbles(b[:, 8:], 16))
    return (dl * values.reshape(-1, 8, 32)).reshape(-1, 256)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    # E8M0 scale halved (the table is doubled): 2^(e-128), subnormal for e < 2
    e = b[:, :1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32) * _lookup(_MXFP4_VALUES, _nibbles(b[:, 1:], 16))


_DECODERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.IQ4_NL: _iq4_nl,
    QType.IQ4_XS: _iq4_xs,
    QType.MXFP4: _mxfp4,
}

SUPPORTED_TYPES: frozenset[QType] = frozenset(_PLAIN_DTYPES) | frozenset(_DECODERS)


def _check_supported(qtype: QType) -> None:
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise FlashtreeError(f"tensor type {type_name(qtype)} is not supported (supported: {names})")


def dequantize(
    raw: torch.Tensor, qtype: QType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode a tensor's raw GGUF bytes (uint8, any shape, on any device) into ``shape``.

    F16/BF16 to the same dtype (and F32 to float32) come back as views of ``raw``, not copies.
    """
    _check_supported(qtype)
    if raw.dtype != torch.uint8:
        raise FlashtreeError(f"raw tensor bytes must be uint8, got {raw.dtype}")
    expected = bytes_for(qtype, shape)
    if raw.numel() != expected:
        raise FlashtreeError(
            f"{type_name(qtype)} tensor of shape {tuple(shape)} needs {expected} bytes, got {raw.numel()}"
        )
    flat = raw.reshape(-1)
    if qtype in _PLAIN_DTYPES:
        return flat.view(_PLAIN_DTYPES[qtype]).reshape(shape).to(dtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = flat.view(-1, type_size)
    out = torch.empty(blocks.shape[0], block, dtype=dtype, device=raw.device)
    step = max(1, _CHUNK_ELEMENTS // block)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = _DECODERS[qtype](blocks[start : start + step])
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# torch quantizer for weights made on the device (e.g. a Q8_0 draft at load time)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """float [..., K] -> Q8_0 block bytes uint8 [..., K // 32 * 34], byte-identical to gguf's quantizer
    (scale amax/127, round half away from zero), on x's device."""
    if x.shape[-1] % 32:
        raise FlashtreeError(f"Q8_0 needs the last dimension to be a multiple of 32, got shape {tuple(x.shape)}")
    blocks = x.float().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    out = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


# ---------------------------------------------------------------------------------------------
# numpy quantizers (for tests and export). All are vectorized over blocks.

_GGUF_QUANTIZABLE = frozenset(
    {QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.MXFP4}
)
_REFINE_STEPS = 3


def _fp16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _safe_inv(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(x == 0, 0, 1 / x).astype(np.float32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_nibbles(q: np.ndarray, group: int) -> np.ndarray:
    """Inverse of the dequantizer's nibble order: each run of 2*group values -> group bytes."""
    runs = q.astype(np.uint8).reshape(q.shape[0], -1, 2, group)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(q.shape[0], -1)


def _fit_affine(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [n, k]: scale s >= 0 and offset b <= 0 with x ~ s*q + b, q in 0..nmax.

    Starts from the min/max range, then alternates rounding and a least-squares refit
    (each step can only lower the squared error).
    """
    b = np.minimum(x.min(axis=1, keepdims=True), 0)
    s = (x.max(axis=1, keepdims=True) - b) / nmax
    k = x.shape[1]
    for _ in range(_REFINE_STEPS):
        q = np.clip(np.rint((x - b) * _safe_inv(s)), 0, nmax)
        sq, sx = q.sum(1, keepdims=True), x.sum(1, keepdims=True)
        sqq, sxq = (q * q).sum(1, keepdims=True), (x * q).sum(1, keepdims=True)
        det = k * sqq - sq * sq
        fit_s = (k * sxq - sq * sx) * _safe_inv(det)
        fit_b = (sx - fit_s * sq) / k
        # where the free fit wants a positive offset, refit the scale with b pinned at 0
        pinned = fit_b > 0
        fit_s = np.where(pinned, sxq * _safe_inv(sqq), fit_s)
        fit_b = np.where(pinned, 0, fit_b)
        usable = (det > 0) & (fit_s > 0)
        s, b = np.where(usable, fit_s, s), np.where(usable, fit_b, b)
    return s, b


def _fit_symmetric(x: np.ndarray) -> np.ndarray:
    """Per row of x [n, k]: signed scale s with x ~ s*q, q in -32..31 (Q6_K), refined by least squares."""
    # start by sending the largest-magnitude value to -32, the end with the extra step
    s = _peak(x) / -32
    for _ in range(_REFINE_STEPS):
        q = np.clip(np.rint(x * _safe_inv(s)), -32, 31)
        s = np.where(s == 0, 0, (x * q).sum(1, keepdims=True) * _safe_inv((q * q).sum(1, keepdims=True)))
    return s


def _peak(x: np.ndarray) -> np.ndarray:
    """The largest-magnitude value of each row, with its sign: [n, 1]."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1, keepdims=True), axis=1)


def _six_bit(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """values [n, 8] >= 0 -> fp16-exact super-scale [n, 1] and 6-bit multipliers [n, 8]."""
    d = _fp16_round(values.max(axis=1, keepdims=True) / 63)
    return d, np.clip(np.rint(values * _safe_inv(d)), 0, 63).astype(np.uint8)


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    lo = (scales[:, :4] & 63) | ((scales[:, 4:] >> 4) << 6)
    mid = (mins[:, :4] & 63) | ((mins[:, 4:] >> 4) << 6)
    hi = (scales[:, 4:] & 0xF) | ((mins[:, 4:] & 0xF) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def _quantize_k_affine(blocks: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K shared part: header bytes (d, dmin, scales) [n, 16] and quants [n, 256]."""
    sub = blocks.reshape(-1, 32)
    s, b = _fit_affine(sub, nmax)
    d, scales = _six_bit(s.reshape(-1, 8))
    dmin, mins = _six_bit(-b.reshape(-1, 8))
    step = (d * scales).reshape(-1, 1)
    offset = (dmin * mins).reshape(-1, 1)
    q = np.clip(np.rint((sub + offset) * _safe_inv(step)), 0, nmax).astype(np.uint8).reshape(-1, 256)
    header = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(scales, mins)], axis=1)
    return header, q


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    header, q = _quantize_k_affine(blocks, 15)
    return np.concatenate([header, _pack_nibbles(q, 32)], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    header, q = _quantize_k_affine(blocks, 31)
    high = ((q >> 4) & 1).reshape(-1, 8, 32)
    qh = (high << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8)
    return np.concatenate([header, qh, _pack_nibbles(q & 0xF, 32)], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16)
    s = _fit_symmetric(sub).reshape(-1, 16)
    d = _fp16_round(np.abs(s).max(axis=1, keepdims=True) / 127)
    scales = np.clip(np.rint(s * _safe_inv(d)), -128, 127).astype(np.int8)
    step = (d * scales).reshape(-1, 1)
    q = (np.clip(np.rint(sub * _safe_inv(step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = _pack_nibbles(q.reshape(-1, 256) & 0xF, 64)
    qh = ((q >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).sum(axis=2, dtype=np.uint8)
    return np.concatenate([ql, qh.reshape(-1, 64), scales.view(np.uint8), _f16_bytes(d)], axis=1)


def _nearest_iq4(x: np.ndarray) -> np.ndarray:
    """Index of the nearest IQ4 codebook value for every element of x (in codebook units)."""
    values = np.array(IQ4_VALUES, dtype=np.float32)
    return np.searchsorted((values[1:] + values[:-1]) / 2, x).astype(np.uint8)


def _fit_iq4_scale(sub: np.ndarray) -> np.ndarray:
    """Per row of sub [n, 32]: a scale that maps the row onto the codebook, refined by least squares."""
    values = np.array(IQ4_VALUES, dtype=np.float32)
    s = _peak(sub) / values[0]
    for _ in range(_REFINE_STEPS):
        v = values[_nearest_iq4(sub * _safe_inv(s))]
        s = np.where(s == 0, 0, (sub * v).sum(1, keepdims=True) * _safe_inv((v * v).sum(1, keepdims=True)))
    return s


def _quantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    d = _fp16_round(_fit_iq4_scale(blocks))
    q = _nearest_iq4(blocks * _safe_inv(d))
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q, 16)], axis=1)


def _quantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 32)
    s = _fit_iq4_scale(sub).reshape(-1, 8)
    d = _fp16_round(_peak(s) / -32)
    ls = (np.clip(np.rint(s * _safe_inv(d)), -32, 31) + 32).astype(np.uint8)
    q = _nearest_iq4(sub * _safe_inv((d * (ls.astype(np.float32) - 32)).reshape(-1, 1)))
    scales_l = ls[:, 0::2] & 0xF | ((ls[:, 1::2] & 0xF) << 4)
    high = (ls >> 4).astype(np.uint16) << np.arange(0, 16, 2, dtype=np.uint16)
    scales_h = high.sum(axis=1, dtype=np.uint16).reshape(-1, 1).view(np.uint8)
    return np.concatenate([_f16_bytes(d), scales_h, scales_l, _pack_nibbles(q, 16).reshape(-1, 128)], axis=1)


_ENCODERS: dict[QType, Callable[[np.ndarray], np.ndarray]] = {
    QType.Q4_K: _quantize_q4_k,
    QType.Q5_K: _quantize_q5_k,
    QType.Q6_K: _quantize_q6_k,
    QType.IQ4_NL: _quantize_iq4_nl,
    QType.IQ4_XS: _quantize_iq4_xs,
}


def quantize(x: np.ndarray, qtype: QType) -> np.ndarray:
    """Encode float32 x [rows, cols] as GGUF bytes: uint8 [rows, bytes_per_row]."""
    _check_supported(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise FlashtreeError(f"quantize expects a 2-D array, got shape {x.shape}")
    rows, cols = x.shape
    row_bytes = bytes_for(qtype, (cols,))
    if qtype in _GGUF_QUANTIZABLE:
        encoded = np.ascontiguousarray(gguf_quants.quantize(x, qtype))
    else:
        encoded = _ENCODERS[qtype](x.reshape(-1, block_size(qtype)))
    return encoded.view(np.uint8).reshape(rows, row_bytes)
