"""Q8_0: 32-value blocks of int8 with one fp16 scale; value = d * q.

v1 (chunked): one [BLOCK_N, 32] tile per step. v2 (tiled): the [BLOCK_N, BLOCK_K / 32, 8] int32 word
tile (BLOCK_K contiguous bytes per row); byte t of every word is one plane, dequantized without an
int-to-float conversion (see `_plane_dot`) and dotted with the x values of the same elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.kernels.quant_matmul._launch import (dot_chunk, launch, program_tiles,
                                                    store_tile, zero_acc)

TILE_VALUES = 32
MAGIC_BIASED_ONE = 0x3FC00000  # float32 1.0's bits with mantissa bit 22 set
DEFAULT_BLOCK_K = 128  # at 256 a [64, 256] step takes ~200 registers per thread (ptxas, sm_90)


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
        acc = dot_chunk(acc, x_ptr, offs_m, m_mask, offs_n, N, b * 32 + lanes, w, K, BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


@triton.jit(do_not_specialize=["M"])  # one compile per BLOCK_M, whatever M
def _q8_0_tiled(x_ptr, qs_ptr, d_ptr, MAGIC, out_ptr, M, N, K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, DOT: tl.constexpr):
    offs_m, offs_n, rows, _, first, per_split = program_tiles(M, N, K, BLOCK_K, BLOCK_M, BLOCK_N, SPLIT_K)
    m_mask = offs_m < M
    B: tl.constexpr = BLOCK_K // 32  # blocks per step
    # qs as int32 words: [BLOCK_N, B, 8], byte t of word w is element 32*b + 4*w + t
    qs_offs = (rows[:, None, None] * (K // 4) + tl.arange(0, B)[None, :, None] * 8
               + tl.arange(0, 8)[None, None, :])
    d_offs = rows[:, None] * (K // 32) + tl.arange(0, B)[None, :]
    cols = tl.arange(0, B * 8)
    x_offs = (offs_m[:, None, None, None] * K + (cols * 4)[None, :, None, None]
              + 2 * tl.arange(0, 2)[None, None, :, None] + tl.arange(0, 2)[None, None, None, :])
    x_mask = m_mask[:, None, None, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(per_split):
        k0 = (first + step) * BLOCK_K
        words = tl.load(qs_ptr + qs_offs + k0 // 4)
        d = tl.load(d_ptr + d_offs + k0 // 32).to(tl.float32)
        a256 = (d * 256.0)[:, :, None]
        c = (d * 384.0)[:, :, None]
        x4 = tl.load(x_ptr + x_offs + k0, mask=x_mask, other=0.0)  # [BLOCK_M, B*8, 2, 2]
        x02, x13 = tl.split(x4)
        x0, x2 = tl.split(x02)
        x1, x3 = tl.split(x13)
        acc = _plane_dot(acc, x0, words, a256, c, 0, MAGIC, DOT)
        acc = _plane_dot(acc, x1, words, a256, c, 8, MAGIC, DOT)
        acc = _plane_dot(acc, x2, words, a256, c, 16, MAGIC, DOT)
        acc = _plane_dot(acc, x3, words, a256, c, 24, MAGIC, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


@triton.jit
def _plane_dot(acc, x, words, a256, c, shift: tl.constexpr, magic, DOT: tl.constexpr):
    """acc += x @ plane^T for the int8 quants at bit `shift` of every word.

    q + 128 goes straight into the mantissa of 1 + (q + 128)/256: the byte moves to bits 15-22 and
    one LOP3 masks it and XORs `magic` = 0x3FC00000 (1.0's bits with bit 22 set: flipping the
    byte's sign bit adds 128; a runtime register, so mask and XOR fuse); then
    w = f * 256*d - 384*d = d*q is one FMA."""
    if shift <= 15:
        bits = (words << (15 - shift)) & 0x7F8000
    else:
        bits = (words >> (shift - 15)) & 0x7F8000
    w = (bits ^ magic).to(tl.float32, bitcast=True) * a256 - c
    wt = tl.reshape(w, (w.shape[0], w.shape[1] * w.shape[2]))
    if DOT == "x_dtype":
        return tl.dot(x, tl.trans(wt.to(x.dtype)), acc)
    else:
        return tl.dot(x.to(tl.float32), tl.trans(wt), acc, input_precision=DOT)


def matmul(x, fields, n, k, config=None):
    args = (fields["qs"], fields["d"])
    # the tiled kernel reads the quants as int32 words; MAGIC: see _plane_dot
    tiled_args = (fields["qs"].view(torch.int32), fields["d"], MAGIC_BIASED_ONE)
    return launch(x, args, n, k, 32, _q8_0_kernel, _q8_0_tiled, TILE_VALUES, config, DEFAULT_BLOCK_K,
                  tiled_args=tiled_args)
