"""Q8_0: 32-value blocks of int8 with one fp16 scale; value = d * q. One [BLOCK_N, 32] tile per step."""

from __future__ import annotations

import triton
import triton.language as tl

from flashtree.kernels.quant_matmul._launch import dot_chunk, launch, program_tiles, store_tile, zero_acc


@triton.jit
def _q8_0_kernel(x_ptr, qs_ptr, d_ptr, out_ptr, M, N, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                 DOT: tl.constexpr):
    offs_m, offs_n, rows, k_blocks, first, per_split = program_tiles(M, N, K, 32, BLOCK_M, BLOCK_N, SPLIT_K)
    m_mask = offs_m < M
    lanes = tl.arange(0, 32)
    acc = zero_acc(BLOCK_M, BLOCK_N, 32, DOT)
    for step in range(per_split):
        b = first + step
        block = rows * k_blocks + b
        d = tl.load(d_ptr + block).to(tl.float32)
        q = tl.load(qs_ptr + block[:, None] * 32 + lanes[None, :])
        w = d[:, None] * q.to(tl.float32)
        acc = dot_chunk(acc, x_ptr, offs_m, m_mask, b * 32 + lanes, w, K, BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, SPLIT_K, DOT)


def matmul(x, fields, n, k, config=None):
    return launch(_q8_0_kernel, x, (fields["qs"], fields["d"]), n, k, 32, config)
