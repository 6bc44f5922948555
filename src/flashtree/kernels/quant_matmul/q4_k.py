"""Q4_K: 256-value blocks, eight 32-value sub-blocks with 6-bit scale and min; value = d*sc*q - dmin*mn.

Quant byte 32*g + l holds element 64*g + l (low nibble, sub-block 2g) and 64*g + 32 + l (high
nibble, sub-block 2g + 1). The field-major layout makes a row's quants contiguous across blocks,
so BLOCK_K values are BLOCK_K / 2 contiguous bytes per row.

v1 (chunked): each step loads one [BLOCK_N, 32] byte tile and feeds both nibbles.
v2 (tiled): each step loads the quants as one [BLOCK_N, BLOCK_K / 64, 8] int32 word tile (32
contiguous bytes per 64-value group); byte t's nibble h of every word is one plane (8 planes), and
the x values of the same elements (64*g + 32*h + 4*w + t) come from one contiguous x load split
in registers. Scales and mins are unpacked once per 32-value sub-block into a = 16*d*sc and
c = 16*d*sc + dmin*mn ([BLOCK_N, BLOCK_K / 64] per nibble); each element then costs a shift, one
LOP3 and one FMA (see `_plane_dot`) plus its share of the conversion to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.kernels.quant_matmul._launch import (dot_chunk, launch, program_tiles,
                                                    store_tile, zero_acc)

TILE_VALUES = 64  # v2 BLOCK_K granularity: one 32-byte quant group (two sub-blocks)
MAGIC_ONE = 0x3F800000  # the bits of float32 1.0


@triton.jit
def k_scale_min(scales_ptr, block, sub):
    """6-bit scale and min of sub-block `sub` from the 12 packed bytes, as float32 (block and sub
    broadcast together, so a whole [BLOCK_N, G] tile of sub-blocks unpacks at once).

    Sub-blocks 0-3: low 6 bits of bytes sub and sub + 4; 4-7: nibbles of byte sub + 4 plus the top
    2 bits of bytes sub - 4 and sub. Branch-free: the three bytes at sub % 4 (+4, +8) cover both.
    """
    base = scales_ptr + block * 12 + sub % 4
    first, second, third = tl.load(base), tl.load(base + 4), tl.load(base + 8)
    low = sub < 4
    scale = tl.where(low, first & 63, (third & 0xF) | ((first >> 6) << 4))
    minimum = tl.where(low, second & 63, (third >> 4) | ((second >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _q4_k_kernel(x_ptr, qs_ptr, scales_ptr, d_ptr, dmin_ptr, out_ptr, M, N, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                 DOT: tl.constexpr):
    offs_m, offs_n, rows, k_blocks, first, per_split = program_tiles(M, N, K, 256, BLOCK_M, BLOCK_N, SPLIT_K)
    m_mask = offs_m < M
    lanes = tl.arange(0, 32)
    acc = zero_acc(BLOCK_M, BLOCK_N, 32, DOT)
    for step in range(per_split):
        b = first + step
        block = rows * k_blocks + b
        d = tl.load(d_ptr + block).to(tl.float32)
        dmin = tl.load(dmin_ptr + block).to(tl.float32)
        for g in tl.static_range(4):
            q = tl.load(qs_ptr + block[:, None] * 128 + 32 * g + lanes[None, :])
            for h in tl.static_range(2):
                scale, minimum = k_scale_min(scales_ptr, block, 2 * g + h)
                nibble = ((q >> (4 * h)) & 0xF).to(tl.float32)
                w = (d * scale)[:, None] * nibble - (dmin * minimum)[:, None]
                acc = dot_chunk(acc, x_ptr, offs_m, m_mask, offs_n, N, b * 256 + 64 * g + 32 * h + lanes, w, K,
                                BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


@triton.jit(do_not_specialize=["M"])  # one compile per BLOCK_M, whatever M
def _q4_k_tiled(x_ptr, qs_ptr, scales_ptr, d_ptr, dmin_ptr, MAGIC, out_ptr, M, N, K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, DOT: tl.constexpr):
    offs_m, offs_n, rows, _, first, per_split = program_tiles(M, N, K, BLOCK_K, BLOCK_M, BLOCK_N, SPLIT_K)
    m_mask = offs_m < M
    G: tl.constexpr = BLOCK_K // 64  # 32-byte quant groups per step
    groups = tl.arange(0, G)
    # qs_ptr is int32: a row's K / 2 quant bytes are K / 8 words
    row_words = rows[:, None, None] * (K // 8) + groups[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    # x of byte t of word w of group g, nibble h: element 64*g + 32*h + 4*w + t, as [BLOCK_M, G*8, 2, 2]
    cols = tl.arange(0, G * 8)
    x_offs = (offs_m[:, None, None, None] * K + ((cols // 8) * 64 + (cols % 8) * 4)[None, :, None, None]
              + 2 * tl.arange(0, 2)[None, None, :, None] + tl.arange(0, 2)[None, None, None, :])
    x_mask = m_mask[:, None, None, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(per_split):
        k0 = (first + step) * BLOCK_K
        words = tl.load(qs_ptr + row_words + k0 // 8)  # [BLOCK_N, G, 8]
        group = k0 // 64 + groups  # 64-value group index within the row
        block = rows[:, None] * (K // 256) + (group // 4)[None, :]  # [BLOCK_N, G]
        d = tl.load(d_ptr + block).to(tl.float32)
        dmin = tl.load(dmin_ptr + block).to(tl.float32)
        for h in tl.static_range(2):
            scale, minimum = k_scale_min(scales_ptr, block, (2 * (group % 4) + h)[None, :])
            a16 = (d * scale) * 16.0
            c = a16 + dmin * minimum
            x4 = tl.load(x_ptr + x_offs + k0 + 32 * h, mask=x_mask, other=0.0)
            x02, x13 = tl.split(x4)  # [BLOCK_M, G*8, 2]: bytes (0, 2) and (1, 3)
            x0, x2 = tl.split(x02)
            x1, x3 = tl.split(x13)
            acc = _plane_dot(acc, x0, words, a16, c, 4 * h, MAGIC, DOT)
            acc = _plane_dot(acc, x1, words, a16, c, 8 + 4 * h, MAGIC, DOT)
            acc = _plane_dot(acc, x2, words, a16, c, 16 + 4 * h, MAGIC, DOT)
            acc = _plane_dot(acc, x3, words, a16, c, 24 + 4 * h, MAGIC, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


@triton.jit
def _plane_dot(acc, x, words, a16, c, shift: tl.constexpr, magic, DOT: tl.constexpr):
    """acc += x @ plane^T for the nibble at bit `shift` of every word.

    Each nibble q goes straight into the mantissa of 1 + q/16 (shift, and, or with `magic` =
    0x3F800000, a runtime register so and + or fuse into one LOP3; no int-to-float conversion):
    w = (1 + q/16) * 16*d*sc - (16*d*sc + dmin*mn) = d*sc*q - dmin*mn in one FMA (c's rounding is
    ~1 float32 ulp of 16*d*sc)."""
    if shift <= 19:
        bits = (words << (19 - shift)) & 0x780000
    else:
        bits = (words >> (shift - 19)) & 0x780000
    f = (bits | magic).to(tl.float32, bitcast=True)
    w = f * a16[:, :, None] - c[:, :, None]
    wt = tl.reshape(w, (w.shape[0], w.shape[1] * w.shape[2]))
    if DOT == "x_dtype":
        return tl.dot(x, tl.trans(wt.to(x.dtype)), acc)
    else:
        return tl.dot(x.to(tl.float32), tl.trans(wt), acc, input_precision=DOT)


def matmul(x, fields, n, k, config=None):
    args = (fields["qs"], fields["scales"], fields["d"], fields["dmin"])
    # the tiled kernel reads the quants as int32 words; MAGIC: see _plane_dot
    tiled_args = (fields["qs"].view(torch.int32), *args[1:], MAGIC_ONE)
    return launch(x, args, n, k, 256, _q4_k_kernel, _q4_k_tiled, TILE_VALUES, config, tiled_args=tiled_args)
