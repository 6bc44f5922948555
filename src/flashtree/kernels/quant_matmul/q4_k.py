"""Q4_K: 256-value blocks, eight 32-value sub-blocks with 6-bit scale and min; value = d*sc*q - dmin*mn.

Quant byte 32*g + l holds element 64*g + l (low nibble, sub-block 2g) and 64*g + 32 + l (high
nibble, sub-block 2g + 1). Each step loads one [BLOCK_N, 32] byte tile and feeds both nibbles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtree.kernels.quant_matmul._launch import dot_chunk, launch, program_tiles, store_tile, zero_acc


@triton.jit
def k_scale_min(scales_ptr, block, sub):
    """6-bit scale and min of sub-block `sub` from the 12 packed bytes, as float32 [BLOCK_N].

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
                acc = dot_chunk(acc, x_ptr, offs_m, m_mask, b * 256 + 64 * g + 32 * h + lanes, w, K,
                                BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, SPLIT_K, DOT)


def matmul(x, fields, n, k, config=None):
    args = (fields["qs"], fields["scales"], fields["d"], fields["dmin"])
    return launch(_q4_k_kernel, x, args, n, k, 256, config)
