"""Q5_K: Q4_K plus a fifth bit per value; value = d*sc*q - dmin*mn with q in 0..31.

Bit j of qh[l] is the high bit of element 32*j + l, so one [BLOCK_N, 32] qh tile per block
serves all eight sub-blocks; nibbles are laid out as in Q4_K.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtree.kernels.quant_matmul._launch import dot_chunk, launch, program_tiles, store_tile, zero_acc
from flashtree.kernels.quant_matmul.q4_k import k_scale_min


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
                acc = dot_chunk(acc, x_ptr, offs_m, m_mask, b * 256 + 32 * sub + lanes, w, K,
                                BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, SPLIT_K, DOT)


def matmul(x, fields, n, k, config=None):
    args = (fields["qs"], fields["qh"], fields["scales"], fields["d"], fields["dmin"])
    return launch(_q5_k_kernel, x, args, n, k, 256, config)
