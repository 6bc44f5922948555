"""Q4_K / Q6_K weights in tensor-core fragment order, and the CUDA kernels that multiply them (mma.cu).

Layout. Rows go in tiles of 16 (N % 16 == 0) and K in 256-value super-blocks; a "tile super-block"
(16 x 256 values) is stored as contiguous pieces, tile-major then super-block:
  quants [tiles, SB, 2048]: the low 4 bits of every value. Lane (g, t) of a warp (lane = 4g + t) reads
      16-byte chunks j = 0..3 at j*512 + lane*16; word w of chunk j is MMA step s = 4j + w (values
      16s .. 16s + 15 of the super-block). Nibble 4p + r of that word is A-fragment register r, half
      p of the m16n8k16 MMA: row g + 8*(r & 1), column 8*(r >> 1) + 2t + p.
  high   [tiles, SB, 1024] (Q6_K): the top 2 bits; word v (chunk v // 4 at (v // 4)*512 + lane*16 +
      (v % 4)*4) holds steps 2v + o (o = 0, 1): the 2 bits of nibble 4p + r at bit 16p + 8o + 2r.
  scales [tiles, SB, 16 rows, 16]: Q4_K the 12 packed scale/min bytes, fp16 d, fp16 dmin; Q6_K the
      16 int8 scales.
  d      [tiles, SB, 16 rows] fp16 (Q6_K).
The bytes are the GGUF bytes rearranged (same count; `from_mma_layout` gives them back exactly).

Kernels are compiled at run time by NVRTC (cuda-python's `cuda.bindings`, an optional GPU
dependency, imported on first use) and cached on disk per GPU architecture.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.kernels import cuda_functions
# arch_of, cache_dir and compile_cubin: the loader and the benchmarks take them from here with the instances
from flashtree.kernels.cuda_functions import arch_of, cache_dir, functions, launch, nvrtc_loads  # noqa: F401
from flashtree.nvrtc import bindings, check, compile_cubin  # noqa: F401

TILE_ROWS = 16
SUPER = 256
MMA_TYPES = (QType.Q4_K, QType.Q6_K)
MAX_M = 32  # rows of x one launch multiplies (four groups of 8 tokens)
MAX_CLUSTER = 8  # CTAs of a portable thread-block cluster (sm_90)
# bytes per tile super-block of each piece, in storage order
PIECES: dict[QType, tuple[tuple[str, int], ...]] = {
    QType.Q4_K: (("quants", 2048), ("scales", 256)),
    QType.Q6_K: (("quants", 2048), ("high", 1024), ("scales", 256), ("d", 32)),
}
_SOURCE = Path(__file__).with_name("mma.cu")
# qmh's float16 x: `prep_x`'s helpers, which a norm that writes that x as well (kernels/add_rms_norm.cu) shares
X_F16_SOURCE = Path(__file__).with_name("x_f16.cuh")


def source() -> str:
    """mma.cu as NVRTC compiles it (the cluster helpers and x_f16.cuh first): an instance is this and its wrapper."""
    return cuda_functions.with_cluster_helpers(_SOURCE, X_F16_SOURCE)


def supports(qtype: QType, shape: tuple[int, int]) -> bool:
    n, k = shape
    return qtype in MMA_TYPES and n % TILE_ROWS == 0 and k % SUPER == 0


# ---------------------------------------------------------------------------------------------
# layout (torch; runs wherever the bytes are)


def _unpack_q4_k(blocks: torch.Tensor, n: int, k: int):
    """GGUF Q4_K blocks [N*SB, 144] -> nibbles [N, K] (0..15) and per-(row, super-block) records [N, SB, 16]."""
    sb = k // SUPER
    qs = blocks[:, 16:144].reshape(n, sb, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, k)  # byte 32g + l: values 64g + l and 64g + 32 + l
    records = torch.cat([blocks[:, 4:16], blocks[:, 0:4]], dim=1).reshape(n, sb, 16)
    return q, records


def _pack_q4_k(q: torch.Tensor, records: torch.Tensor, n: int, k: int) -> torch.Tensor:
    sb = k // SUPER
    q = q.reshape(n, sb, 4, 2, 32)
    qs = q[:, :, :, 0] | (q[:, :, :, 1] << 4)
    records = records.reshape(n * sb, 16)
    return torch.cat([records[:, 12:16], records[:, 0:12], qs.reshape(n * sb, 128)], dim=1)


def _unpack_q6_k(blocks: torch.Tensor, n: int, k: int):
    """GGUF Q6_K blocks [N*SB, 210] -> 6-bit quants [N, K] (0..63), int8-scale bytes [N, SB, 16], d bytes [N, SB, 2]."""
    sb = k // SUPER
    ql = blocks[:, 0:128].reshape(n, sb, 2, 2, 32)  # [half, l // 32, l % 32]
    qh = blocks[:, 128:192].reshape(n, sb, 2, 1, 32)
    low = torch.stack([ql & 15, ql >> 4], dim=3)  # [n, sb, half, nibble, 2 (l//32), 32]
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8, device=blocks.device)  # [nibble, l // 32]
    high = (qh[:, :, :, None] >> shifts[None, None, None, :, :, None]) & 3  # [n, sb, half, nibble, 2, 32]
    q = (low | (high << 4)).reshape(n, k)  # value 128*half + 64*nibble + 32*(l//32) + l%32
    return q, blocks[:, 192:208].reshape(n, sb, 16), blocks[:, 208:210].reshape(n, sb, 2)


def _pack_q6_k(q: torch.Tensor, scales: torch.Tensor, d: torch.Tensor, n: int, k: int) -> torch.Tensor:
    sb = k // SUPER
    q = q.reshape(n, sb, 2, 2, 2, 32)  # [half, nibble, l // 32, l % 32]
    ql = q[:, :, :, 0] & 15 | ((q[:, :, :, 1] & 15) << 4)  # [n, sb, half, 2, 32]
    top = q >> 4
    qh = (top[:, :, :, 0, 0] | (top[:, :, :, 0, 1] << 2) | (top[:, :, :, 1, 0] << 4) | (top[:, :, :, 1, 1] << 6))
    return torch.cat([ql.reshape(n * sb, 128), qh.reshape(n * sb, 64), scales.reshape(n * sb, 16),
                      d.reshape(n * sb, 2)], dim=1)


def _lane_columns(qtype: QType) -> torch.Tensor:
    """For each fragment column c = 16s + 8*half + 2t + pair of a super-block, the value it holds.
    Step s stays inside one scaled sub-block (Q4_K: 32 values = steps 2j, 2j + 1; Q6_K: 16 = one
    step), and within it lane t's B-fragment values are contiguous (Q4_K: 8 values 32j + 8t ..
    for both steps, one 16-byte load of x; Q6_K: 4 values 16s + 4t .., one 8-byte load)."""
    c = torch.arange(SUPER)
    s, half, t, pair = c // 16, (c // 8) % 2, (c // 2) % 4, c % 2
    if qtype == QType.Q4_K:
        return 32 * (s // 2) + 8 * t + 4 * (s % 2) + 2 * half + pair
    return 16 * s + 4 * t + 2 * half + pair


def _to_fragment_columns(values: torch.Tensor, qtype: QType, n: int, k: int) -> torch.Tensor:
    index = _lane_columns(qtype).to(values.device)
    return values.reshape(n, k // SUPER, SUPER)[:, :, index].reshape(n, k)


def _from_fragment_columns(values: torch.Tensor, qtype: QType, n: int, k: int) -> torch.Tensor:
    inverse = torch.argsort(_lane_columns(qtype)).to(values.device)
    return values.reshape(n, k // SUPER, SUPER)[:, :, inverse].reshape(n, k)


def _fragment_view(values: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[N, K] -> [T, h, g, SB, j, w, half, t, pair]: row 16T + 8h + g, column 256sb + 16(4j + w) + 8half + 2t + pair."""
    return values.reshape(n // 16, 2, 8, k // SUPER, 4, 4, 2, 4, 2)


def _nibble_words(q: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Low nibbles of q [N, K] in fragment order: [T, SB, 2048] bytes."""
    f = _fragment_view(q & 15, n, k).permute(0, 3, 4, 2, 7, 5, 8, 6, 1)  # [T, SB, j, g, t, w, pair, half, h]
    packed = f[..., 0] | (f[..., 1] << 4)  # byte 2*pair + half: nibble h=0 low, h=1 high
    return packed.reshape(n // 16, k // SUPER, 2048)


def _from_nibble_words(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    b = words.reshape(n // 16, k // SUPER, 4, 8, 4, 4, 2, 2)  # [T, SB, j, g, t, w, pair, half]
    f = torch.stack([b & 15, b >> 4], dim=-1)  # [..., h]
    return f.permute(0, 8, 3, 1, 2, 5, 7, 4, 6).reshape(n, k)  # back to [T, h, g, SB, j, w, half, t, pair]


def _high_words(q: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Top 2 bits of 6-bit q [N, K]: [T, SB, 1024] bytes (see the module docstring)."""
    top = (q >> 4).reshape(n // 16, 2, 8, k // SUPER, 2, 4, 2, 2, 4, 2)  # s = 2(4jj + ww) + o
    # -> [T, SB, jj, g, t, ww, pair, o, half, h]; byte 2*pair + o, piece r = 2*half + h at bit 2r
    f = top.permute(0, 3, 4, 2, 8, 5, 9, 6, 7, 1).reshape(n // 16, k // SUPER, 2, 8, 4, 4, 2, 2, 4)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=q.device)
    packed = (f << shifts).sum(dim=-1, dtype=torch.uint8)
    return packed.reshape(n // 16, k // SUPER, 1024)


def _from_high_words(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    b = words.reshape(n // 16, k // SUPER, 2, 8, 4, 4, 2, 2)  # [T, SB, jj, g, t, ww, pair, o]
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=words.device)
    f = ((b[..., None] >> shifts) & 3).reshape(*b.shape, 2, 2)  # [..., half, h]
    # [T, SB, jj, g, t, ww, pair, o, half, h] -> [T, h, g, SB, jj, ww, o, half, t, pair]
    return f.permute(0, 9, 3, 1, 2, 5, 7, 8, 4, 6).reshape(n, k)


def _tile_records(records: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Per-(row, super-block) records [N, SB, W] -> [T, SB, 16 rows, W]."""
    return records.reshape(n // 16, 16, k // SUPER, -1).transpose(1, 2)


def _untile_records(tiled: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return tiled.transpose(1, 2).reshape(n, k // SUPER, -1)


_CHUNK_ROWS = 4096  # rows converted at once: bounds the temporaries (~6 bytes per value) on big matrices


def _pieces_for_rows(gguf_rows: torch.Tensor, qtype: QType, n: int, k: int) -> list[torch.Tensor]:
    blocks = gguf_rows.reshape(n * (k // SUPER), GGML_QUANT_SIZES[qtype][1])
    if qtype == QType.Q4_K:
        q, records = _unpack_q4_k(blocks, n, k)
        return [_nibble_words(_to_fragment_columns(q, qtype, n, k), n, k), _tile_records(records, n, k)]
    q, scales, d = _unpack_q6_k(blocks, n, k)
    q = _to_fragment_columns(q, qtype, n, k)
    return [_nibble_words(q, n, k), _high_words(q, n, k), _tile_records(scales, n, k), _tile_records(d, n, k)]


def _row_slice(start: int, count: int, size: int, k: int) -> slice:
    """The bytes of rows [start, start + count) in a piece of `size` bytes per tile super-block (tile-major)."""
    per_row = size * (k // SUPER) // 16
    return slice(start * per_row, (start + count) * per_row)


def to_mma_layout(gguf_rows: torch.Tensor, qtype: QType, n: int, k: int) -> torch.Tensor:
    """GGUF bytes of an [N, K] weight -> the fragment-ordered buffer (uint8, same size), converted in
    row chunks (the layout is tile-major, so each piece of a chunk is a contiguous slice)."""
    check_shape(qtype, n, k)
    rows = gguf_rows.reshape(n, -1)
    out = torch.empty(rows.numel(), dtype=torch.uint8, device=rows.device)
    views = pieces_of(out, qtype, n, k)
    for start in range(0, n, _CHUNK_ROWS):
        count = min(_CHUNK_ROWS, n - start)
        pieces = _pieces_for_rows(rows[start:start + count], qtype, count, k)
        for (name, size), piece in zip(PIECES[qtype], pieces):
            views[name][_row_slice(start, count, size, k)] = piece.reshape(-1)
    return out


def pieces_of(raw: torch.Tensor, qtype: QType, n: int, k: int) -> dict[str, torch.Tensor]:
    """Views of each piece of a fragment-ordered buffer, flat uint8."""
    count = (n // 16) * (k // SUPER)
    views, offset = {}, 0
    for name, size in PIECES[qtype]:
        views[name] = raw[offset:offset + count * size]
        offset += count * size
    return views


def row_pieces(raw: torch.Tensor, qtype: QType, n: int, k: int, start: int, count: int) -> dict[str, torch.Tensor]:
    """`pieces_of` the rows [start, start + count) alone (both multiples of 16): the pieces of a [count, K] weight."""
    if start % TILE_ROWS or count % TILE_ROWS or start < 0 or count < 0 or start + count > n:
        raise FlashtreeError(f"rows [{start}, {start + count}) of a {n}-row weight are not whole tiles of {TILE_ROWS}")
    views = pieces_of(raw, qtype, n, k)
    return {name: views[name][_row_slice(start, count, size, k)] for name, size in PIECES[qtype]}


def from_mma_layout(raw: torch.Tensor, qtype: QType, n: int, k: int) -> torch.Tensor:
    """The GGUF bytes back, uint8 [N, row_bytes], converted in row chunks like `to_mma_layout`."""
    out = torch.empty(n, raw.numel() // n, dtype=torch.uint8, device=raw.device)
    for start in range(0, n, _CHUNK_ROWS):
        count = min(_CHUNK_ROWS, n - start)
        out[start:start + count] = _gguf_rows(row_pieces(raw, qtype, n, k, start, count), qtype, count, k)
    return out


def _gguf_rows(p: dict[str, torch.Tensor], qtype: QType, n: int, k: int) -> torch.Tensor:
    low = _from_nibble_words(p["quants"], n, k)
    scales = _untile_records(p["scales"].reshape(n // 16, k // SUPER, 16, 16), n, k)
    if qtype == QType.Q4_K:
        return _pack_q4_k(_from_fragment_columns(low, qtype, n, k), scales, n, k).reshape(n, -1)
    q = _from_fragment_columns(low | (_from_high_words(p["high"], n, k) << 4), qtype, n, k)
    d = _untile_records(p["d"].reshape(n // 16, k // SUPER, 16, 2), n, k)
    return _pack_q6_k(q, scales, d, n, k).reshape(n, -1)


# ---------------------------------------------------------------------------------------------
# the kernels' arithmetic, emulated in torch (what the tests check the layout and decoding against)


def _lane_words(p: dict[str, torch.Tensor], qtype: QType, tiles: int, sb: int):
    """Each lane's word of low nibbles per MMA step s, and (Q6_K) the word of top bits it takes s's from:
    int64 [T, SB, lane, s] each (the top bits None for Q4_K)."""
    words = p["quants"].view(torch.int32).reshape(tiles, sb, 4, 32, 4).long() & 0xFFFFFFFF  # [T, SB, j, lane, w]
    words = words.permute(0, 1, 3, 2, 4).reshape(tiles, sb, 32, 16)  # [T, SB, lane, s]
    if qtype != QType.Q6_K:
        return words, None
    hi = p["high"].view(torch.int32).reshape(tiles, sb, 2, 32, 4).long() & 0xFFFFFFFF  # [T, SB, jj, lane, ww]
    hi = hi.permute(0, 1, 3, 2, 4).reshape(tiles, sb, 32, 8)  # word v = s // 2
    return words, hi[..., torch.arange(16, device=words.device) // 2]


def _halves(bits: torch.Tensor) -> torch.Tensor:
    """32-bit registers [..., r] -> their two 16-bit halves [..., r, pair] (low half first)."""
    return torch.stack([bits & 0xFFFF, bits >> 16], dim=-1)


def _fragment_rows(values: torch.Tensor) -> torch.Tensor:
    """Per-register values [T, SB, lane, s, r, pair] -> [N, K] in fragment columns (A register r: row g + 8 (r & 1),
    column 16s + 8 (r >> 1) + 2t + pair)."""
    tiles, sb = values.shape[:2]
    v = values.reshape(tiles, sb, 8, 4, 16, 2, 2, 2).permute(0, 6, 2, 1, 4, 5, 3, 7)  # [T, h, g, SB, s, half, t, pair]
    return v.reshape(16 * tiles, sb * SUPER)


def _per_column(records: torch.Tensor) -> torch.Tensor:
    """Per-(row, sub-block) values [T, SB, 16 rows, sub-blocks] -> [N, K] in fragment columns."""
    tiles, sb, _, subs = records.shape
    return records.permute(0, 2, 1, 3).reshape(16 * tiles, sb * subs).repeat_interleave(SUPER // subs, dim=1)


def _decode_emulated(p: dict[str, torch.Tensor], qtype: QType, n: int, k: int) -> torch.Tensor:
    """Every value as the kernel's `decode` + `sub_scale` compute it, float32 [N, K]: read the words,
    build the bf16 bits of 128 + q (Q6_K: q - 32) per A register, scale per sub-block."""
    tiles, sb = n // 16, k // SUPER
    words, hi_word = _lane_words(p, qtype, tiles, sb)
    r = torch.arange(4, device=words.device)
    bits = ((words[..., None] >> (4 * r)) & 0x000F000F) | 0x43004300  # [T, SB, lane, s, r]
    if qtype == QType.Q6_K:
        s = torch.arange(16, device=words.device)
        shift = (8 * (s % 2))[:, None] + 2 * r  # [s, r]
        bits = bits | (((hi_word[..., None] >> shift) & 0x00030003) << 4)
    values = (_halves(bits) << 16).to(torch.int32).view(torch.float32)  # bf16 -> float32 exactly
    if qtype == QType.Q6_K:
        values = values - 160.0
    a, b = _scales_emulated(p, qtype, tiles, sb)  # [T, SB, 16 rows, sub-blocks]
    w = _fragment_rows(values) * _per_column(a) - _per_column(b)
    return _from_fragment_columns(w, qtype, n, k)


# qmh's Q6_K A registers (mma.cu `multiply_half`): per register r, the low nibble's (mask, float16 constant, whether
# the word is shifted right by 8) and the top bits' (mask, float16 constant, word shifted to put them there)
_Q6_K_HALF_LOW = ((0x000F000F, 0x5C00, False), (0x00F000F0, 0x5C00, False),
                  (0x000F000F, 0x5C00, True), (0x00F000F0, 0x5C00, True))
_Q6_K_HALF_TOP = ((0x00C000C0, 0x5400), (0x03000300, 0x5C00), (0x00C000C0, 0x5400), (0x03000300, 0x5C00))
# the top-bit constants' offsets (- (M + 2 f) sc) for rows g and g + 8, and the rows' d factors
_Q6_K_HALF_OFFSET, _Q6_K_HALF_D = (-72.0, -384.0), (4.0, 0.25)


def _float16_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.float16)  # two's complement wrap keeps the 16 bits


def _q6_k_half_emulated(p: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """Every Q6_K value as qmh's two A fragments carry it, float64 [N, K]: the low nibble and the top bits
    OR-ed into float16 constants, each one float16 fused multiply-add with the float16 scale (emulated in
    float64, which holds its exact result, then rounded once), their sum times the row's 4 d or d / 4.
    Equal to the exact dequantization only if every step is exact."""
    tiles, sb = n // 16, k // SUPER
    words, hi_word = _lane_words(p, QType.Q6_K, tiles, sb)  # [T, SB, lane, s]
    odd = (torch.arange(16, device=words.device) % 2).bool()
    top_words = (torch.where(odd, hi_word >> 2, hi_word << 6) & 0xFFFFFFFF,  # registers 0, 1
                 torch.where(odd, hi_word >> 6, hi_word << 2) & 0xFFFFFFFF)  # registers 2, 3
    low = [(((words >> 8) if shifted else words) & mask) | (magic * 0x10001) for mask, magic, shifted in _Q6_K_HALF_LOW]
    top = [(top_words[r // 2] & mask) | (magic * 0x10001) for r, (mask, magic) in enumerate(_Q6_K_HALF_TOP)]
    low, top = (_float16_bits(_halves(torch.stack(regs, dim=-1))).double() for regs in (low, top))  # [.., s, r, pair]
    # the scale of register r: row g + 8 (r & 1) of the lane's g, sub-block s; int8 read as 1152 + sc - 1152
    flipped = (p["scales"].reshape(tiles, sb, 16, 16).long() ^ 0x80) | 0x6400
    sc16 = (_float16_bits(flipped) - 1152).double()  # [T, SB, row, s], exact
    g, h = torch.arange(32, device=words.device) // 4, torch.arange(4, device=words.device) % 2
    sc = sc16[:, :, g[:, None] + 8 * h[None, :]].permute(0, 1, 2, 4, 3)[..., None]  # [T, SB, lane, s, r, 1]
    offset = torch.tensor(_Q6_K_HALF_OFFSET, dtype=torch.float64, device=words.device)[h][:, None]  # [r, 1]
    a1 = (low * sc + (-256.0 * sc).half().double()).half().double()
    a2 = (top * sc + (offset * sc).half().double()).half().double()
    d = p["d"].reshape(tiles, sb, 16, 2).contiguous().view(torch.float16).double()  # [T, SB, 16 rows, 1]
    factor = torch.tensor(_Q6_K_HALF_D, dtype=torch.float64, device=words.device).repeat_interleave(8)
    return _from_fragment_columns(_fragment_rows(a1 + a2) * _per_column(d * factor[:, None]), QType.Q6_K, n, k)


def _scales_emulated(p: dict[str, torch.Tensor], qtype: QType, tiles: int, sb: int):
    rec = p["scales"].reshape(tiles, sb, 16, 16).long()
    if qtype == QType.Q4_K:
        x, y, z = rec[..., 0:4], rec[..., 4:8], rec[..., 8:12]
        sc = torch.cat([x & 63, (z & 15) | ((x >> 6) << 4)], dim=-1).float()
        mn = torch.cat([y & 63, (z >> 4) | ((y >> 6) << 4)], dim=-1).float()
        d = p["scales"].reshape(tiles, sb, 16, 8, 2)[..., 6, :].contiguous().view(torch.float16).float()
        dmin = p["scales"].reshape(tiles, sb, 16, 8, 2)[..., 7, :].contiguous().view(torch.float16).float()
        a = d * sc
        return a, a * 128.0 + dmin * mn
    d = p["d"].reshape(tiles, sb, 16, 2).contiguous().view(torch.float16).float()
    a = d * p["scales"].reshape(tiles, sb, 16, 16).view(torch.int8).float()
    return a, torch.zeros_like(a)


def dequantize_emulated(raw: torch.Tensor, qtype: QType, n: int, k: int) -> torch.Tensor:
    return _decode_emulated(pieces_of(raw, qtype, n, k), qtype, n, k)


def dequantize_half_emulated(raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q6_K's weights as its float16 kernel (qmh) builds them, float64 [N, K]."""
    return _q6_k_half_emulated(pieces_of(raw, QType.Q6_K, n, k), n, k)


# ---------------------------------------------------------------------------------------------
# compiling and launching (CUDA)


@dataclass(frozen=True)
class MMAConfig:
    """rt: 16-row tiles per warp; warps: per CTA (they split K); splits: CTAs per row group (split K);
    chains: accumulators per tile and token group in qmh (its MMAs per super-block split over them);
    min_blocks: CTAs per SM asked of ptxas (`__launch_bounds__`'s second value; 0: none), which caps the
    registers to fit them (sm_90, 4 warps: 3 -> 168, 4 -> 128) at the price of spills; x_ahead: qmh loads x a
    sub-block ahead of its MMAs (1) or just before them (0); own_tiles: qmh's warps own row tiles of their own
    and walk the same super-blocks (x read from L2 once per CTA) instead of splitting K (0; mma.cu `qmh` says what
    1-4 do; 4: x staged by one more warp, `threads`); ring: qmv and qmh
    stage the weights through a shared-memory ring of that many super-blocks per warp (cp.async, ring - 1 in
    flight) instead of two register buffers (0); cluster: own_tiles 2's splits of K add their sums in a
    thread-block cluster (`cluster_splits`) instead of through global partials and a ticket."""

    rt: int
    warps: int
    splits: int
    chains: int = 1
    min_blocks: int = 0
    x_ahead: int = 0
    own_tiles: int = 0
    ring: int = 0
    cluster: bool = False

    def __post_init__(self):
        if self.ring == 1 or self.ring < 0:
            raise FlashtreeError(f"a weight ring needs at least 2 stages (or 0 for none), not {self.ring}")
        if self.own_tiles in (3, 4) and self.splits != 1:
            raise FlashtreeError(f"own_tiles {self.own_tiles} (x resident, or staged by a warp of its own) sums all of "
                                 f"K in one CTA: one split, not {self.splits}")
        if self.cluster and not (self.own_tiles == 2 and self.splits > 1):
            raise FlashtreeError(f"a thread-block cluster adds the splits of own_tiles 2, not own_tiles "
                                 f"{self.own_tiles} with {self.splits} split(s)")
        if self.cluster_splits and self.splits > MAX_CLUSTER:
            raise FlashtreeError(f"own_tiles 2 splits K over a thread-block cluster of at most {MAX_CLUSTER} CTAs, "
                                 f"not {self.splits}")

    @property
    def cluster_splits(self) -> bool:
        """qmh's warps own tiles with x in shared memory (own_tiles 2), K is split and `cluster`: the splits of a
        row group are one thread-block cluster and add their sums through distributed shared memory (mma.cu
        `epilogue_cluster`), with no global partials. (A cluster of 3-8 CTAs of one CTA an SM leaves SMs of a GPC
        idle; without it the splits' float32 partials meet through global memory, the last CTA adding them.)"""
        return self.cluster and self.own_tiles == 2 and self.splits > 1

    @property
    def threads(self) -> int:
        """Threads a CTA launches: its warps, and with own_tiles 4 the warp that stages x (mma.cu `ProducedX`)."""
        return 32 * (self.warps + (self.own_tiles == 4))

    @property
    def rows_per_cta(self) -> int:
        """Output rows one CTA computes: its warps split K (16 rt), or with own_tiles each has rt tiles."""
        return 16 * self.rt * (self.warps if self.own_tiles else 1)

    def grid(self, n: int, sms: int) -> int:
        """CTAs along N: `row_groups`, or for own_tiles 3 (warps walking whole tiles grid-wide, x resident) one CTA an
        SM at most, no more than the tiles need."""
        if self.own_tiles == 3:
            if n % (16 * self.rt):
                raise FlashtreeError(f"{self} needs N % {16 * self.rt} == 0, N = {n}")
            return min(sms, -(-n // self.rows_per_cta))
        return self.row_groups(n)

    def row_groups(self, n: int) -> int:
        """CTAs along N for an [n, k] weight. With own_tiles and one split the last CTA may hold fewer tiles than
        warps (its other warps store nothing, mma.cu `qmh`); any other launch needs N to be whole CTAs."""
        partial_ok = self.own_tiles and self.splits == 1
        if n % (16 * self.rt) or (n % self.rows_per_cta and not partial_ok):
            raise FlashtreeError(f"{self} needs N % {16 * self.rt if partial_ok else self.rows_per_cta} == 0, N = {n}")
        return -(-n // self.rows_per_cta)

    def resident_x_bytes(self, qtype: QType, tg: int, k: int) -> int:
        """own_tiles 3's x in dynamic shared memory (mma.cu `ResidentX`): 8 tg rows of k float16 values, each row
        64 bytes longer, then Q4_K's sums (32 bytes a row and super-block); 0 for the other launches."""
        if self.own_tiles != 3:
            return 0
        rows = 8 * max(tg, 1)
        return rows * (2 * k + 64) + (rows * 32 * (k // SUPER) if qtype == QType.Q4_K else 0)

    def dynamic_shared_bytes(self, qtype: QType, tg: int, k: int) -> int:
        """The launch's dynamic shared memory: the weight rings, then own_tiles 3's resident x."""
        return self.ring_bytes(qtype) + self.resident_x_bytes(qtype, tg, k)

    def ring_bytes(self, qtype: QType) -> int:
        """Dynamic shared memory of the weight ring (mma.cu `RingStage`): per warp and stage the tile super-blocks'
        bytes (Q6_K's d included)."""
        return self.warps * self.ring * self.rt * sum(size for _, size in PIECES[qtype])


ONE_ROW = 0  # `token_groups` of one row of x: the qmv kernel (sub-blocks in the MMA's columns), not qmm


def token_groups(m: int) -> int:
    """Groups of 8 tokens the qmm kernel instance multiplies; ONE_ROW for a single row (decode)."""
    return ONE_ROW if m == 1 else (m + 7) // 8


# Q4_K matrices of at least this many weights take qmh for 2-32 rows; on smaller ones (the 27B's
# 1024x5120 K and V) its x conversion costs more than it saves (sweep of 2026-12-01). Q6_K takes the same
# rule until a sweep of its own (benchmarks/sweep_mma_rows.py) says otherwise.
QMH_MIN_WEIGHTS = 1 << 23


def kernel_for(qtype: QType, tg: int, n: int, k: int) -> str:
    """mma.cu's kernel for `tg` token groups of an [n, k] weight: qmv (one row), qmh (float16: the sub-block
    scales inside the exact float16 weights) or qmm (bf16, each sub-block scaled in float32)."""
    if tg == ONE_ROW:
        return "qmv"
    return "qmh" if n * k >= QMH_MIN_WEIGHTS else "qmm"


# x and output element types a kernel instance takes: bf16 (u16 in mma.cu) or float32 (a bf16 model's
# activations, docs/FIDELITY.md design D); qmh's x is prep_x's float16 either way
_C_TYPES = {torch.bfloat16: "u16", torch.float32: "float"}


def _check_dtypes(*dtypes: torch.dtype) -> None:
    for dtype in dtypes:
        if dtype not in _C_TYPES:
            raise FlashtreeError(f"the MMA kernels take and write bf16 or float32 rows, not {dtype}")


def _dtype_suffix(x_dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    return ("_xf32" if x_dtype == torch.float32 else "") + ("_of32" if out_dtype == torch.float32 else "")


def _instance(qtype: QType, config: MMAConfig, tg: int, kernel: str, x_dtype: torch.dtype = torch.bfloat16,
              out_dtype: torch.dtype = torch.bfloat16, glu: bool = False) -> str:
    c = config
    blocks = f"_b{c.min_blocks}" if c.min_blocks else ""
    ring = f"_g{c.ring}" if c.ring and kernel in ("qmv", "qmh") else ""
    types = _dtype_suffix(torch.bfloat16 if kernel == "qmh" else x_dtype, out_dtype) + ("_glu" if glu else "")
    if kernel == "qmv":
        chains = f"_c{c.chains}" if c.chains > 1 else ""
        return f"qmv_{qtype.name.lower()}_r{c.rt}_w{c.warps}_s{c.splits}{chains}{blocks}{ring}{types}"
    chains = f"_c{c.chains}" if kernel == "qmh" else ""
    ahead = f"_x{c.x_ahead}" if kernel == "qmh" and c.x_ahead else ""
    own = f"_own{c.own_tiles}" if kernel == "qmh" and c.own_tiles else ""
    own += "_cl" if kernel == "qmh" and c.cluster_splits else ""
    return f"{kernel}_{qtype.name.lower()}_r{c.rt}_t{tg}_w{c.warps}_s{c.splits}{chains}{blocks}{ahead}{own}{ring}{types}"


def _dequant_instance(qtype: QType, out: int) -> str:
    return f"dequant_{qtype.name.lower()}_o{out}"


_OUT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# warps per CTA of the dense dequantization: mma.cu's DequantOut<OUT>::WARPS (32 KB of staged rows per CTA)
_DEQUANT_WARPS = {torch.bfloat16: 4, torch.float16: 4, torch.float32: 2}


def _wrapper(name: str, qtype: QType, config: MMAConfig, tg: int, kernel: str, x_dtype: torch.dtype = torch.bfloat16,
             out_dtype: torch.dtype = torch.bfloat16, glu: bool = False) -> str:
    c = config
    _check_glu(glu, kernel, config)
    bounds = f"{c.threads}, {c.min_blocks}" if c.min_blocks else f"{c.threads}"
    cluster = f"__cluster_dims__(1, {c.splits}, 1) " if kernel == "qmh" and c.cluster_splits else ""
    head = f'extern "C" __global__ void {cluster}__launch_bounds__({bounds}) {name}'
    xt, ot = _C_TYPES[x_dtype], _C_TYPES[out_dtype]
    if kernel == "qmh":
        call = (f"qmh<{qtype.name}, {c.rt}, {tg}, {c.warps}, {c.splits}, {c.chains}, {c.x_ahead}, {c.own_tiles}, "
                f"{c.ring}, {int(glu)}, {int(c.cluster_splits)}>")
        tail = f"{ot}* out, float* part, int* tickets, int M, int N, int K"
        if qtype == QType.Q4_K:  # x's sums for the min term; no top bits, d inside the scale records
            return (f"{head}(const u16* xh, const u16* xs, const float* scale, const unsigned char* q, "
                    f"const unsigned char* s, {tail}) {{ {call}(xh, xs, scale, q, nullptr, s, nullptr, out, part, "
                    f"tickets, M, N, K); }}\n")
        return (f"{head}(const u16* xh, const float* scale, const unsigned char* q, const unsigned char* h, "
                f"const unsigned char* s, const u16* d, {tail}) {{ {call}(xh, nullptr, scale, q, h, s, d, out, "
                f"part, tickets, M, N, K); }}\n")
    call = (f"qmv<{qtype.name}, {c.rt}, {c.warps}, {c.splits}, {c.chains}, {c.ring}, {int(glu)}>" if kernel == "qmv"
            else f"qmm<{qtype.name}, {c.rt}, {tg}, {c.warps}, {c.splits}>")
    return (f"{head}(const {xt}* x, const unsigned char* q, const unsigned char* h, const unsigned char* s, "
            f"const u16* d, {ot}* out, float* part, int* tickets, int M, int N, int K) {{ "
            f"{call}(x, q, h, s, d, out, part, tickets, M, N, K); }}\n")


def _check_glu(glu: bool, kernel: str, config: MMAConfig) -> None:
    """The GLU epilogue (mma.cu `epilogue`, `epilogue_own`) is qmv's and qmh's, over finished sums (one split)."""
    if glu and (kernel not in ("qmv", "qmh") or config.splits != 1):
        raise FlashtreeError(f"the GLU epilogue takes qmv or qmh with one split, not {kernel} with {config.splits}")


def glu_config(config: MMAConfig) -> MMAConfig:
    """`config` with K in one split: the GLU epilogue needs each output's gate and up sums in one CTA (a fused
    gate + up matrix has enough row tiles to fill the GPU without splitting K)."""
    return replace(config, splits=1)


def _prep_x_instance(qtype: QType, x_dtype: torch.dtype = torch.bfloat16) -> str:
    types = _dtype_suffix(x_dtype, torch.bfloat16)
    return f"prep_x_f16{types}" if qtype == QType.Q4_K else f"prep_x_f16_{qtype.name.lower()}{types}"


def _prep_x_wrapper(qtype: QType, x_dtype: torch.dtype = torch.bfloat16) -> str:
    """x's conversion for qmh: Q4_K's also writes the sub-block sums of x (its min term), Q6_K's has none."""
    head = (f'extern "C" __global__ void __launch_bounds__(256) {_prep_x_instance(qtype, x_dtype)}'
            f"(const {_C_TYPES[x_dtype]}* x, u16* xh, ")
    if qtype == QType.Q4_K:
        return f"{head}u16* xs, float* scale, int K) {{ prep_x<Q4_K>(x, xh, xs, scale, K); }}\n"
    return f"{head}float* scale, int K) {{ prep_x<Q6_K>(x, xh, nullptr, scale, K); }}\n"


def _dequant_wrapper(name: str, qtype: QType, out: int) -> str:
    return (f'extern "C" __global__ void {name}(const unsigned char* q, const unsigned char* h, const unsigned char* s, '
            f"const u16* d, void* dense, int N, int K) {{ dequant<{qtype.name}, {out}>(q, h, s, d, dense, N, K); }}\n")


def _function(device: torch.device, name: str, wrapper: str):
    """Instance `name` (mma.cu with its `wrapper`) on `device`."""
    return functions(device).function(name, lambda: source() + wrapper)


@functools.cache
def available() -> bool:
    """cuda-python importable and NVRTC loadable (then Q4_K/Q6_K weights on CUDA use this module's
    kernels; otherwise, or with FLASHTREE_MMA=0, the Triton kernels)."""
    if os.environ.get("FLASHTREE_MMA", "1") == "0":
        return False
    return nvrtc_loads()


@functools.cache
def _tickets(device: torch.device, stream: int) -> torch.Tensor:
    """Per-row-group arrival counters of split-K launches, one set per stream (launches on one stream
    run one after another; every launch leaves its counters at zero)."""
    return torch.zeros(1 << 16, dtype=torch.int32, device=device)


_H200_SMS = 132


def choose_config(qtype: QType, m: int, n: int, k: int, sms: int = _H200_SMS, kernel: str | None = None) -> MMAConfig:
    """From the H200 sweeps of 2026-11-30 21:35 UTC (benchmarks/sweep_mma.py) and 2026-12-01 02:05 UTC (qmh,
    benchmarks/sweep_mma_rows.py; docs/PERFORMANCE.md).

    Warps and splits depend on the matrix only, never on M: they fix the order in which a row's K is summed. qmm (small
    matrices) then gives a row the same bits whatever the other rows; qmh does within classes of row counts whose chains
    or K orders differ (they agree within an output rounding): Q4_K 2-16 and 17-32 where the warps own tiles (17-32,
    `own_tiles`: each warp sums all of K), else 2-24 and 25-32; Q6_K 17-32 and 2-16 on the FFN down projections, 9-16 (x
    resident), 17-24 and the rest on the LM head. Loading x a sub-block ahead (`x_ahead`) changes no arithmetic.
    The one-row kernel (decode) sums each sub-block in its own MMA column (Q4_K's MMAs in two chains) and
    adds them per lane, another order: a decode row and a verify row of the same token can differ in the last
    bits (near-ties only; the bench shows the margin where greedy outputs part).
    4 warps per CTA (2 on LM-head-sized matrices); split K only when the row tiles cannot give every
    SM about two CTAs. Two row tiles per warp (x's fragments reused from registers) where the sweeps
    found them faster: qmm Q4_K at 9-16 and 25-32 rows, Q6_K from 17 rows, Q6_K's qmh at 17-24 rows; never
    on matrices with fewer tiles than SMs. qmh splits a tile's 16 MMAs per super-block over two accumulator
    chains with one row tile (a single chain waits on each MMA's latency) and keeps one with two tiles
    (two chains there exceed 255 registers and spill). Q6_K's qmh pairs tiles at 17-24 rows on the LM head
    only, its weights through a shared-memory ring (`_Q6_K_HEAD_VERIFY`; double-buffered in registers two tiles at
    4 token groups spill 72 bytes, sm_90).
    Q4_K's qmh keeps one tile, with 3 CTAs per SM from 17 rows (the sweep of 2026-12-01 08:08 UTC: at 23 rows
    8 % faster than two tiles, at 32 rows within 2 %)."""
    tiles, sb = n // 16, k // SUPER
    tg = token_groups(m)
    half = (kernel or kernel_for(qtype, tg, n, k)) == "qmh"  # `kernel`: the config another kernel would take
    warps = 2 if tiles >= 32 * sms else 4
    resident = _RESIDENT_X_HEAD if half and tg == 2 and warps == 2 and resident_x_enabled() else None
    if resident is not None and resident.dynamic_shared_bytes(qtype, tg, k) <= _SHARED_PER_CTA:
        return resident
    wide_q4_k = half and qtype == QType.Q4_K and tg >= 2 and n % 32 == 0 and tiles >= 5 * sms
    one_cta = _own_tiles_one_cta_an_sm(tiles, tg, sms) if wide_q4_k and one_cta_an_sm_enabled() else None
    if one_cta is not None:
        return one_cta
    ring = _two_tiles_through_a_ring(tiles // 2, tg, warps, sms) if (
        wide_q4_k) else None
    if ring is not None:
        return ring
    # Q6_K's qmh at 17-32 rows on 4-warp matrices (the FFN down projections) and at 17-24 on the LM head (there
    # on 4 warps too): one tile and one chain at 3 CTAs per SM, x a sub-block ahead (eighth session's sweeps: down
    # 5120x17408 at 23 rows 70.0 -> 49.3 us, at 32 rows 123.4 -> 59.1 us; the head at 23 rows 645.6 -> 569.1 us)
    lean_q6_k = half and qtype == QType.Q6_K and (tg == 3 or (tg == 4 and warps == 4))
    if lean_q6_k and warps == 2:  # the LM head at 17-24 rows: the same with two tiles a warp through a weight
        return _Q6_K_HEAD_VERIFY  # ring, the same arithmetic (twenty-first session: 576.1 -> 482.6 us at 23 rows)
    if lean_q6_k:
        warps = 4
    if half:
        pairs = qtype != QType.Q4_K and tg == 3 and not lean_q6_k
    else:
        pairs = tg in ((3, 4) if qtype == QType.Q6_K else (2, 4))
    rt = 2 if pairs and tiles >= sms and n % 32 == 0 else 1
    splits = 1
    while tiles * splits < 1.5 * sms and sb // (splits * 2) >= warps:
        splits *= 2
    # Q4_K's qmh at 17-32 rows: 3 CTAs per SM (at most 168 registers, 16 spilled bytes) hide its latency
    # better than paired tiles (23 rows: 44.6 -> 40.9 us on a gate/up matrix). On matrices with at least a
    # 64-row group per SM (gate/up, q + gate) the CTA's warps own a tile each and share x through shared memory
    # (`own_tiles` 2: 23 rows 41.6 -> 36.1 us, 32 rows 54.2 -> 43.8 us on gate/up); on the others (the FFN down
    # projections: too few groups) x a sub-block ahead at 17-24 rows, and one chain at 25-32 (53.2 -> 47.3 us)
    q4_k_many_rows = half and qtype == QType.Q4_K and tg in (3, 4)
    own_tiles = 2 if q4_k_many_rows and n % 64 == 0 and n // 64 >= sms else 0
    min_blocks = 3 if half and tg in (3, 4) and (qtype == QType.Q4_K or lean_q6_k) else 0
    chains = 1 if lean_q6_k or not half or rt > 1 or (q4_k_many_rows and tg == 4 and not own_tiles) else 2
    if tg == ONE_ROW and qtype == QType.Q4_K:  # qmv: two chains (the sweep of 2026-12-02 01:31 UTC: q + gate
        chains = 2  # 15.3 -> 13.6 us, gate/up 19.1 -> 18.5 us; Q6_K's down no faster, 28.3 -> 28.7 us)
    x_ahead = 1 if lean_q6_k or (q4_k_many_rows and not own_tiles) else 0
    return MMAConfig(rt, warps, splits, chains=chains, min_blocks=min_blocks, x_ahead=x_ahead, own_tiles=own_tiles)


# Q6_K's LM head (248320x5120) at 17-24 rows, the verify's: two row tiles a warp with the weights through a 2-stage
# shared-memory ring, one chain, the 4 warps splitting K, 3 CTAs per SM. The twenty-first session's sweep (docs/
# PERFORMANCE.md, 2026-12-04, call 1) against the one-tile register form (r1w4s1c1b3x1, whose K order and chain it
# keeps, so a row's bits stay those of its class): 23 rows 576.1 -> 482.6 us; on the down projection it lost (49.9
# against 63.6-65.8 us)
_Q6_K_HEAD_VERIFY = MMAConfig(2, 4, 1, chains=1, min_blocks=3, ring=2)

# CTAs per SM the two-tile Q4_K qmh may take per token-group count: its registers allow 4 at 2 groups (126), 3 at
# 3 (162) and 4 (168 with `min_blocks` 3; 2 without, ~200), and its 36 KB weight ring fits 4
_RING_CTAS_PER_SM = {2: (4, 3), 3: (3, 2), 4: (3, 2)}


def _wave_fill(ctas: int, slots: int) -> float:
    """How full the launch's waves are: ctas over whole waves of `slots` resident CTAs (1.0: no partial wave)."""
    return ctas / (slots * -(-ctas // slots))


# The ring pays only where its CTAs fill their waves: the twentieth session's sweep (docs/PERFORMANCE.md,
# 2026-12-04, call 1) found it 7-17 % slower than the register-buffered qmh on the unfused gate/up 17408x5120,
# whose 544 CTAs fill 0.69 of two waves at 3 per SM, and faster or level where the fill is 0.92-0.98
_RING_MIN_WAVE_FILL = 0.9


def _two_tiles_through_a_ring(ctas: int, tg: int, warps: int, sms: int) -> MMAConfig | None:
    """Q4_K's qmh at 9-32 rows on the wide matrices (at least 5 row tiles per SM: the fused gate + up, a DeltaNet
    layer's qkv + z + beta + alpha, q + gate): the weights through a 2-stage shared-memory ring, whose freed
    registers let each warp take two row tiles (x's fragments used twice), one chain, the CTA's warps splitting K;
    the CTAs per SM whose waves are fullest. Sweeps against the register-buffered qmh, nineteenth and twentieth
    sessions (docs/PERFORMANCE.md, 2026-12-04): at 23 rows gate + up 58.4 -> 55.8 us, q + gate 27.9 -> 23.5, qkvz
    40.5 -> 36.5; at 16 rows 56.3 -> 48.8, 23.3 -> 21.2, 31.2 -> 25.1. One arithmetic from 9 to 32 rows: a row's
    bits do not depend on the row count there. None where no CTA count fills its waves (`_RING_MIN_WAVE_FILL`)."""
    per_sm = max(_RING_CTAS_PER_SM[tg], key=lambda c: _wave_fill(ctas, c * sms))
    if _wave_fill(ctas, per_sm * sms) < _RING_MIN_WAVE_FILL:
        return None
    return MMAConfig(2, warps, 1, chains=1, min_blocks=per_sm if per_sm > 2 else 0, ring=2)


# Shared memory of one SM's CTA: the 227 KB an H100/H200 CTA may take
_SHARED_PER_CTA = 227 * 1024
# Weight bytes each SM keeps in flight through its warps' rings: at ~4.1 TB/s and about a microsecond of loaded
# latency an SM needs ~31 KB; twice that for margin
_RING_BYTES_IN_FLIGHT = 64 * 1024
# The most warps of one tile each a CTA of one SM takes: an SM's 4 schedulers each hold a quarter of its 64K
# registers, so 17-20 warps leave a thread 96 (5 warps a scheduler), where qmh at 3 token groups fits with one
# accumulator chain and no stack (offline, sm_90, NVRTC 13); two chains need 13-16 warps or fewer (124 registers)
_ONE_CTA_MAX_WARPS = 20
_ONE_CTA_MAX_WARPS_TWO_CHAINS = 16
# and the fewest: at 6 warps an SM (q + gate, 768 tiles) the launch lost to the two-tile ring by 3-10 % at 16-32 rows
# where 8 (qkvz) and 17 (gate + up) won by 5-25 % (H100, 2026-12-05, docs/runs/h100-2026-12-05-s28/call7-one_cta.txt)
_ONE_CTA_MIN_WARPS = 8


def one_cta_an_sm_enabled() -> bool:
    """Q4_K's qmh on the wide matrices as one CTA an SM (`_own_tiles_one_cta_an_sm`); FLASHTREE_QMH_ONE_CTA=0 keeps
    the two-tile weight-ring launch before it (for A/B timings)."""
    return os.environ.get("FLASHTREE_QMH_ONE_CTA", "1") != "0"


# Q4_K's one-CTA-an-SM qmh stages x by a warp of its own (own_tiles 4, mma.cu `ProducedX`) at 4 token groups (25-32
# rows, where SharedX has 2 stages, not 3) on CTAs of at least this many warps (the fused gate + up), its weights
# through a 2-stage ring. H100, thirty-second session (`sweep_mma_rows.py --one-cta`, two runs): gate + up at 32 rows
# 64.8 -> 59.2 us (65.0 -> 59.1); at 16 and 23 rows and on the 8-warp qkvz the CTA barrier's form was as fast or
# faster (gate + up 16 rows 48.9 against 50.9, qkvz 23 rows 29.1 against 31.9-33.3)
_PRODUCER_MIN_WARPS = 16
_PRODUCER_TOKEN_GROUPS = 4
_PRODUCER_RING = 2


def x_producer_enabled(tg: int, warps: int) -> bool:
    """Whether Q4_K's one-CTA-an-SM qmh of `warps` warps at `tg` token groups stages x by a warp of its own
    (`_PRODUCER_MIN_WARPS`); FLASHTREE_QMH_X_PRODUCER=1 everywhere that launch runs, =0 nowhere (A/B timings)."""
    switch = os.environ.get("FLASHTREE_QMH_X_PRODUCER")
    if switch is not None:
        return switch == "1"
    return tg == _PRODUCER_TOKEN_GROUPS and warps >= _PRODUCER_MIN_WARPS


def _shared_x_bytes(tg: int) -> int:
    """mma.cu `SharedX`'s static shared memory (and `ProducedX`'s, but for its 48 bytes of mbarriers): its stages of
    8 tg rows of x (X_PITCH bytes) and their sums."""
    stages = 3 if tg <= 3 else 2
    return stages * 8 * tg * (576 + 32)


def _own_tiles_one_cta_an_sm(tiles: int, tg: int, sms: int) -> MMAConfig | None:
    """Q4_K's qmh at 9-32 rows on the wide matrices (the fused gate + up, a DeltaNet layer's qkv + z + beta + alpha,
    q + gate): one CTA an SM (one wave, no partial one), each of its warps owning one row tile and walking all of K
    (so a row's sum has one order whatever the launch), the CTA's x staged once a super-block in shared memory
    (mma.cu `SharedX`) and the weights through a ring a warp deep enough for `_RING_BYTES_IN_FLIGHT` an SM.
    The launch it replaces reads x from L2 once per 32 rows: at 23 rows 2.7x the weights' bytes on gate + up, the
    cost the twenty-seventh session's analysis and the twenty-eighth's probe (benchmarks/probe_x_traffic.py: 44.2
    against 26.4 us for the weights alone) put on the verify's matmuls; here x's L2 traffic is one CTA an SM.
    Two accumulator chains where the warps' registers allow them; x staged by a warp of its own where
    `x_producer_enabled`. None where the warps would be fewer than
    `_ONE_CTA_MIN_WARPS` (too few warps an SM to hide the loads' latency) or more than `_ONE_CTA_MAX_WARPS`, or
    the shared memory would not fit."""
    warps = -(-tiles // sms)
    if not _ONE_CTA_MIN_WARPS <= warps <= _ONE_CTA_MAX_WARPS:
        return None
    stage = sum(size for _, size in PIECES[QType.Q4_K])  # one warp's tile super-block
    ring = min(4, max(2, 1 + -(-_RING_BYTES_IN_FLIGHT // (warps * stage))))
    while ring > 2 and _shared_x_bytes(tg) + warps * ring * stage > _SHARED_PER_CTA:
        ring -= 1
    if _shared_x_bytes(tg) + warps * ring * stage > _SHARED_PER_CTA:
        return None
    producer = x_producer_enabled(tg, warps)
    chains = 2 if warps + producer <= _ONE_CTA_MAX_WARPS_TWO_CHAINS else 1  # the producer's registers count too
    ring = _PRODUCER_RING if producer and tg == _PRODUCER_TOKEN_GROUPS else ring
    return MMAConfig(1, warps, 1, chains=chains, own_tiles=4 if producer else 2, ring=ring)


# The LM head (at least 32 row tiles an SM) at 9-16 rows, the draft's and the budget-15 verify's: x resident in shared
# memory (mma.cu `ResidentX`, 161 KB at 16 rows of K 5120, Q6_K) and 16 warps walking whole tiles grid-wide, one CTA
# an SM (128 registers, no stack: offline, sm_90, NVRTC 13). The launch before it read x from L2 once a 16-row tile,
# 2.5 GB at 16 rows against the head's 1.04 GB of weights. H100, thirtieth session (`sweep_mma_rows.py --resident`):
# 16 rows 440.6 -> 402.9 us; at 2 and 8 rows the launch before it stays faster (347.7 / 356.5 against 371.7 / 376.2)
_RESIDENT_X_HEAD = MMAConfig(1, 16, 1, 2, own_tiles=3)


def resident_x_enabled() -> bool:
    """The LM head's qmh at 9-16 rows with x resident in shared memory (`_RESIDENT_X_HEAD`), unless
    FLASHTREE_QMH_RESIDENT_X=0 (the A/B's other side)."""
    return os.environ.get("FLASHTREE_QMH_RESIDENT_X", "1") == "1"


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: QType, n: int, k: int,
           config: MMAConfig | None = None, kernel: str | None = None,
           out_dtype: torch.dtype | None = None, glu: bool = False) -> torch.Tensor:
    """x [M, K] bf16 or float32 @ W^T -> [M, N] in `out_dtype` (bf16 or float32; default x's), W in the fragment
    layout; 32 rows of x per launch (the float16 kernel converts all of x once first). `kernel` overrides
    `kernel_for` (the sweeps time qmm where qmh runs). `glu`: W's rows are a gate and an up projection interleaved
    (`quant_matmul.glu_weight`) and the result is SiLU(gate) * up, [M, N / 2], from qmv or qmh (`glu_takes`)."""
    m = x.shape[0]
    out_dtype = out_dtype or x.dtype
    _check_dtypes(x.dtype, out_dtype)
    if m < 1:
        raise FlashtreeError("the MMA kernel takes at least one row of x")
    kernel = kernel or kernel_for(qtype, token_groups(min(m, MAX_M)), n, k)
    out = torch.empty(m, n // 2 if glu else n, dtype=out_dtype, device=x.device)
    inputs = prepare_x(x, qtype) if kernel == "qmh" else (x,)  # row-major, so a launch takes the same rows of each
    for start in range(0, m, MAX_M):
        part = slice(start, start + MAX_M)
        _launch_matmul(out[part], [t[part] for t in inputs], raw, qtype, n, k, config, kernel, glu)
    return out


def glu_takes(qtype: QType, m: int, n: int, k: int) -> bool:
    """Whether `matmul(..., glu=True)` runs for M rows of an [n, k] weight: the kernel `matmul` takes for them has
    the GLU epilogue (qmv, qmh), not qmm (the small matrices')."""
    return kernel_for(qtype, token_groups(min(m, MAX_M)), n, k) in ("qmv", "qmh")


def prepare_x(x: torch.Tensor, qtype: QType) -> tuple[torch.Tensor, ...]:
    """x [M, K] (bf16 or float32) -> the inputs of `qtype`'s float16 kernel (mma.cu `prep_x`), one launch for all rows:
    Q4_K (float16 x 2^e per row, its sub-block sums [M, K/256, 16] as float16 hi/lo, 2^-e [M]); Q6_K (float16
    x 2^e with each 32 values in the kernel's order, `q6_k_x_order`, and 2^-e). None launched where the kernel that
    wrote x wrote these as well (`remember_x_f16`)."""
    written = _written_x_f16(x, qtype)
    if written is not None:
        return written
    m, k = x.shape
    name = _prep_x_instance(qtype, x.dtype)
    fn = _function(x.device, name, _prep_x_wrapper(qtype, x.dtype))
    xh, *rest = x_f16_buffers(m, k, qtype, x.device)
    launch(fn, (m, 1), 256, [x, xh, *rest, k], x.device)
    return (xh, *rest)


def x_f16_buffers(m: int, k: int, qtype: QType, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Empty tensors for `prepare_x`'s outputs of M rows: xh [M, K] float16, Q4_K's sums [M, K/256, 16], scale [M]."""
    xh = torch.empty(m, k, dtype=torch.float16, device=device)
    sums = (torch.empty(m, k // SUPER, 16, dtype=torch.float16, device=device),) if qtype == QType.Q4_K else ()
    return (xh, *sums, torch.empty(m, dtype=torch.float32, device=device))


# `prepare_x`'s outputs that the kernel which wrote x wrote as well (a norm: kernels/add_rms_norm.cu's _q4_k and
# _q6_k instances), by x's address, shape, strides, dtype and the weight type: the matmul reading x takes them
# instead of converting it again. An entry lives while that x does and holds while x is unchanged: its version, where
# torch counts one (an inference tensor, the engine's, has none; no code writes a norm's output in place).
_written_x: dict[tuple, tuple[weakref.ref, int | None, tuple[torch.Tensor, ...]]] = {}


def _x_key(x: torch.Tensor, qtype: QType) -> tuple:
    return x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device, qtype


def remember_x_f16(x: torch.Tensor, qtype: QType, inputs: tuple[torch.Tensor, ...]) -> None:
    """`inputs` are `prepare_x(x, qtype)`'s outputs, already written (bit for bit what prep_x would write)."""
    key = _x_key(x, qtype)

    def forget(ref: weakref.ref) -> None:
        if _written_x.get(key, (None,))[0] is ref:
            del _written_x[key]

    _written_x[key] = (weakref.ref(x, forget), _version(x), inputs)


def _version(x: torch.Tensor) -> int | None:
    """x's count of in-place writes, or None for an inference tensor (which keeps none)."""
    return None if x.is_inference() else x._version


def _written_x_f16(x: torch.Tensor, qtype: QType) -> tuple[torch.Tensor, ...] | None:
    ref, version, inputs = _written_x.get(_x_key(x, qtype), (None, None, None))
    source = ref() if ref is not None else None
    return inputs if source is not None and _version(source) == version else None


def q6_k_x_order(k: int) -> torch.Tensor:
    """Position p of Q6_K's float16 x holds value `q6_k_x_order(k)[p]` of its row: lane t's values of MMA steps
    2j and 2j + 1 (16 (2j + o) + 4t .. + 3, see `_lane_columns`) side by side, so one 16-byte load takes both."""
    p = torch.arange(k)
    pair, t, o, i = p // 32, (p // 8) % 4, (p // 4) % 2, p % 4
    return 32 * pair + 16 * o + 4 * t + i


def _launch_matmul(out: torch.Tensor, xs: list[torch.Tensor], raw: torch.Tensor, qtype: QType, n: int, k: int,
                   config: MMAConfig | None, kernel: str, glu: bool = False) -> None:
    """One launch: out [M <= 32, N] (GLU: [M, N / 2]) from x's piece(s) `xs` (qmh: `prepare_x`'s)."""
    m = out.shape[0]
    # a short last piece of a long x stays in its kernel, and in the configuration of 2-8 rows
    tg = ONE_ROW if kernel == "qmv" else (m + 7) // 8
    config = config or choose_config(qtype, m if kernel == "qmv" else max(m, 2), n, k, sm_count(out.device))
    config = glu_config(config) if glu else config
    row_groups = config.grid(n, sm_count(out.device))
    x_dtype = xs[0].dtype if kernel != "qmh" else torch.bfloat16
    name = _instance(qtype, config, tg, kernel, x_dtype, out.dtype, glu)
    fn = _function(out.device, name, _wrapper(name, qtype, config, tg, kernel, x_dtype, out.dtype, glu))
    p = pieces_of(raw, qtype, n, k)
    partial = (torch.empty(config.splits, m, n, dtype=torch.float32, device=out.device)
               if config.splits > 1 and not (kernel == "qmh" and config.cluster_splits) else out)
    weights = ([p["quants"], p["scales"]] if kernel == "qmh" and qtype == QType.Q4_K else
               [p["quants"], p.get("high", p["quants"]), p["scales"], p.get("d", p["scales"])])
    tickets = _tickets(out.device, torch.cuda.current_stream(out.device).cuda_stream)
    shared = config.dynamic_shared_bytes(qtype, tg, k) if kernel in ("qmv", "qmh") else 0
    if shared > _SHARED_PER_CTA:
        raise FlashtreeError(f"{config} needs {shared} bytes of shared memory at {m} rows of K {k}; a CTA holds "
                             f"{_SHARED_PER_CTA}")
    if shared:
        cuda_functions.allow_shared(out.device, name, shared)
    launch(fn, (row_groups, config.splits), config.threads,
            [*xs, *weights, out, partial, tickets, m, n, k], out.device, shared)


def dequantize(raw: torch.Tensor, qtype: QType, n: int, k: int, dtype: torch.dtype,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The dense [N, K] weight in `dtype` (bf16, f16, f32), written by the CUDA dequantization kernel; `rows`
    (start, count), both multiples of 16: only those rows, [count, K] (each piece is tile-major, so a tile-aligned
    row range is a contiguous slice of every piece: `row_pieces`)."""
    name = _dequant_instance(qtype, _OUT_CODES[dtype])
    fn = _function(raw.device, name, _dequant_wrapper(name, qtype, _OUT_CODES[dtype]))
    p = pieces_of(raw, qtype, n, k) if rows is None else row_pieces(raw, qtype, n, k, *rows)
    n = n if rows is None else rows[1]
    dense = torch.empty(n, k, dtype=dtype, device=raw.device)
    tiles = (n // 16) * (k // SUPER)  # one warp each
    per_cta = _DEQUANT_WARPS[dtype]
    launch(fn, ((tiles + per_cta - 1) // per_cta, 1), 32 * per_cta,
            [p["quants"], p.get("high", p["quants"]), p["scales"], p.get("d", p["scales"]), dense, n, k], raw.device)
    return dense


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def instances_for(shapes, sms: int, dtype: torch.dtype = torch.bfloat16, glu_shapes=()) -> list[tuple[str, str]]:
    """(name, wrapper) of every launch fragment-ordered weights of these (qtype, n, k) shapes can take in a model
    whose activations are `dtype` (x and out: bf16, or float32 in a bf16 model, docs/FIDELITY.md): one row
    (decode), each count of 8-token groups (verify, short chunks; `choose_config` depends on the matrix and the
    group count only), and the dense dequantization of prefill (bf16 for bf16 x, float16 for float32 x). Shapes
    also in `glu_shapes` (fused gate + up weights, `quant_matmul.GluWeight`) take their GLU instances instead."""
    _check_dtypes(dtype)
    jobs = {}
    for qtype, n, k in shapes:
        glu = (qtype, n, k) in set(glu_shapes)
        for m in (1, 8, 16, 24, 32):
            config, tg = choose_config(qtype, m, n, k, sms), token_groups(m)
            kernel = kernel_for(qtype, tg, n, k)
            glu_here = glu and glu_takes(qtype, m, n, k)
            config = glu_config(config) if glu_here else config
            name = _instance(qtype, config, tg, kernel, dtype, dtype, glu_here)
            jobs[name] = _wrapper(name, qtype, config, tg, kernel, dtype, dtype, glu_here)
            if kernel == "qmh":
                jobs[_prep_x_instance(qtype, dtype)] = _prep_x_wrapper(qtype, dtype)
        out = _OUT_CODES[torch.bfloat16 if dtype == torch.bfloat16 else torch.float16]
        jobs[_dequant_instance(qtype, out)] = _dequant_wrapper(_dequant_instance(qtype, out), qtype, out)
    return list(jobs.items())


def with_source(jobs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(name, wrapper) instances as (name, whole source): mma.cu with the wrapper, what `cuda_functions` compiles."""
    base = source()
    return [(name, base + wrapper) for name, wrapper in jobs]


def uncompiled(jobs: list[tuple[str, str]], arch: str) -> list[tuple[str, str]]:
    """The (name, wrapper) jobs whose cubin is not in the on-disk cache yet."""
    missing = {name for name, _ in cuda_functions.uncompiled(with_source(jobs), arch)}
    return [(name, wrapper) for name, wrapper in jobs if name in missing]


def precompile(jobs: list[tuple[str, str]], arch: str, workers: int | None = None, progress=None) -> None:
    """Compile (name, wrapper) instances into the on-disk cache in parallel processes (NVRTC needs no GPU);
    `progress` is called with each finished name."""
    cuda_functions.precompile(with_source(jobs), arch, workers, progress)


def check_shape(qtype: QType, n: int, k: int) -> None:
    if not supports(qtype, (n, k)):
        raise FlashtreeError(f"{qtype.name} ({n}, {k}) has no fragment layout (needs Q4_K/Q6_K, N % 16, K % 256)")
