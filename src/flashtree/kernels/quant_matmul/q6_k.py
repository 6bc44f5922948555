"""Q6_K: 256-value blocks, sixteen 16-value sub-blocks with int8 scales; value = (d*sc) * (q - 32).

Element 128*r + 64*h2 + 32*s + l (r, h2, s in {0, 1}, l < 32) takes nibble h2 of
ql[64*r + 32*s + l] and bits 2*(2*h2 + s) of qh[32*r + l]; each [BLOCK_N, 32] ql tile feeds two
32-value chunks, each chunk spanning two scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtree.kernels.quant_matmul._launch import dot_chunk, launch, program_tiles, store_tile, zero_acc


@triton.jit
def _q6_k_kernel(x_ptr, ql_ptr, qh_ptr, scales_ptr, d_ptr, out_ptr, M, N, K: tl.constexpr,
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
        for r in tl.static_range(2):
            qh = tl.load(qh_ptr + block[:, None] * 64 + 32 * r + lanes[None, :])
            for s in tl.static_range(2):
                ql = tl.load(ql_ptr + block[:, None] * 128 + 64 * r + 32 * s + lanes[None, :])
                for h2 in tl.static_range(2):
                    start = 128 * r + 64 * h2 + 32 * s
                    q = ((ql >> (4 * h2)) & 0xF) | (((qh >> (2 * (2 * h2 + s))) & 3) << 4)
                    scale = tl.load(scales_ptr + block[:, None] * 16 + start // 16 + lanes[None, :] // 16)
                    w = (d[:, None] * scale.to(tl.float32)) * (q.to(tl.float32) - 32)
                    acc = dot_chunk(acc, x_ptr, offs_m, m_mask, b * 256 + start + lanes, w, K,
                                    BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, SPLIT_K, DOT)


def matmul(x, fields, n, k, config=None):
    args = (fields["ql"], fields["qh"], fields["scales"], fields["d"])
    return launch(_q6_k_kernel, x, args, n, k, 256, config)
