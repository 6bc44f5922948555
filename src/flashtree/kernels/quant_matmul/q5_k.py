"""Q5_K: Q4_K plus a fifth bit per value; value = d*sc*q - dmin*mn with q in 0..31.

Bit j of qh[l] is the high bit of element 32*j + l, so one [BLOCK_N, 32] qh tile per block
serves all eight sub-blocks; nibbles are laid out as in Q4_K.

v2 (tiled): as Q4_K's (two nibble planes of a [BLOCK_N, BLOCK_K / 64, 32] byte tile), plus the
[BLOCK_N, BLOCK_K / 64, 32] qh bytes of each 64-value group (shared by the four groups of a block),
whose bit 2*(group % 4) + plane is the fifth bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtree.kernels.quant_matmul._launch import (dot_chunk, launch, program_tiles, small_uint_to_float,
                                                    store_tile, zero_acc)
from flashtree.kernels.quant_matmul.q4_k import TILE_VALUES, k_scale_min

DEFAULT_BLOCK_K = 128  # at 256 a [64, 256] step needs ~255 registers per thread (ptxas, sm_90)
TUNING = {"tiled_block_n": 64}  # choose_config: BLOCK_N 128 was 10-30 % slower for Q5_K (sweep of 2026-11-29)


@triton.jit
def _q5_k_kernel(x_ptr, qs_ptr, qh_ptr, scales_ptr, d_ptr, dmin_ptr, out_ptr, M, N, K: tl.constexpr,
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
        qh = tl.load(qh_ptr + block[:, None] * 32 + lanes[None, :])
        for g in tl.static_range(4):
            q = tl.load(qs_ptr + block[:, None] * 128 + 32 * g + lanes[None, :])
            for h in tl.static_range(2):
                sub = 2 * g + h
                scale, minimum = k_scale_min(scales_ptr, block, sub)
                value = ((q >> (4 * h)) & 0xF) | (((qh >> sub) & 1) << 4)
                w = (d * scale)[:, None] * value.to(tl.float32) - (dmin * minimum)[:, None]
                acc = dot_chunk(acc, x_ptr, offs_m, m_mask, offs_n, N, b * 256 + 32 * sub + lanes, w, K,
                                BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


@triton.jit(do_not_specialize=["M"])  # one compile per BLOCK_M, whatever M
def _q5_k_tiled(x_ptr, qs_ptr, qh_ptr, scales_ptr, d_ptr, dmin_ptr, out_ptr, M, N, K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, DOT: tl.constexpr):
    offs_m, offs_n, rows, _, first, per_split = program_tiles(M, N, K, BLOCK_K, BLOCK_M, BLOCK_N, SPLIT_K)
    m_mask = offs_m < M
    G: tl.constexpr = BLOCK_K // 64
    groups = tl.arange(0, G)
    lanes = tl.arange(0, 32)
    cols = tl.arange(0, G * 32)
    plane_elements = (cols // 32) * 64 + cols % 32
    qs_offs = rows[:, None, None] * (K // 2) + groups[None, :, None] * 32 + lanes[None, None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(per_split):
        k0 = (first + step) * BLOCK_K
        q = tl.load(qs_ptr + qs_offs + k0 // 2).to(tl.int32)
        group = k0 // 64 + groups
        block = rows[:, None] * (K // 256) + (group // 4)[None, :]
        qh = tl.load(qh_ptr + block[:, :, None] * 32 + lanes[None, None, :]).to(tl.int32)
        d = tl.load(d_ptr + block).to(tl.float32)
        dmin = tl.load(dmin_ptr + block).to(tl.float32)
        for h in tl.static_range(2):
            sub = 2 * (group % 4) + h
            scale, minimum = k_scale_min(scales_ptr, block, sub[None, :])
            a, b = d * scale, dmin * minimum
            value = ((q >> (4 * h)) & 0xF) | (((qh >> sub[None, :, None]) & 1) << 4)
            w = small_uint_to_float(value) * a[:, :, None] - b[:, :, None]
            acc = dot_chunk(acc, x_ptr, offs_m, m_mask, offs_n, N, k0 + 32 * h + plane_elements,
                            tl.reshape(w, (BLOCK_N, G * 32)), K, BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


def matmul(x, fields, n, k, config=None):
    args = (fields["qs"], fields["qh"], fields["scales"], fields["d"], fields["dmin"])
    return launch(x, args, n, k, 256, _q5_k_kernel, _q5_k_tiled, TILE_VALUES, config, DEFAULT_BLOCK_K, **TUNING)
