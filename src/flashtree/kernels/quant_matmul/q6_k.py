"""Q6_K: 256-value blocks, sixteen 16-value sub-blocks with int8 scales; value = (d*sc) * (q - 32).

Element 128*r + 64*h2 + 32*s + l (r, h2, s in {0, 1}, l < 32) takes nibble h2 of
ql[64*r + 32*s + l] and bits 2*(2*h2 + s) of qh[32*r + l]; each [BLOCK_N, 32] ql tile feeds two
32-value chunks, each chunk spanning two scales.

v2 (tiled): a step covers BLOCK_K / 128 half-blocks, read as int32 words (16 ql words and 8 qh
words per half-block). Word-wide shifts and masks first merge each ql word with its qh bits into
two "comb" words (h2 = 0, 1) whose bytes are whole 6-bit quants; byte t of comb h2 is then one
plane (8 planes per step), dequantized as w = (1 + q/64) * 64*d*sc - 96*d*sc with the quant put
straight into the float's mantissa (see `_plane_dot`), d*sc once per 16 values, and dotted with
the x values of the same elements (128*r + 64*h2 + 4*u + t, one contiguous x load split in
registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.kernels.quant_matmul._launch import (dot_chunk, launch, program_tiles,
                                                    store_tile, zero_acc)

TILE_VALUES = 128  # v2 BLOCK_K granularity: one half-block
MAGIC_ONE = 0x3F800000  # the bits of float32 1.0
TUNING = {"tiled_decode": True}  # choose_config: v2 beat v1 at M = 1 for Q6_K (sweep of 2026-11-29)


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
                    acc = dot_chunk(acc, x_ptr, offs_m, m_mask, offs_n, N, b * 256 + start + lanes, w, K,
                                    BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


@triton.jit(do_not_specialize=["M"])  # one compile per BLOCK_M, whatever M
def _q6_k_tiled(x_ptr, ql_ptr, qh_ptr, scales_ptr, d_ptr, MAGIC, out_ptr, M, N, K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, DOT: tl.constexpr):
    offs_m, offs_n, rows, _, first, per_split = program_tiles(M, N, K, BLOCK_K, BLOCK_M, BLOCK_N, SPLIT_K)
    m_mask = offs_m < M
    H: tl.constexpr = BLOCK_K // 128  # half-blocks per step
    # ql / qh as int32 words. A half-block is 16 ql words u = 4*j + v (j = 2*s + v4) and 8 qh words
    # (qh word 4*v4 + v serves ql words u and u + 8, its bits 2*s); tiles are [BLOCK_N, H*4 (j), 4 (v)]
    j = tl.arange(0, H * 4)
    v = tl.arange(0, 4)[None, None, :]
    ql_offs = rows[:, None, None] * (K // 8) + (j * 4)[None, :, None] + v
    qh_offs = rows[:, None, None] * (K // 16) + ((j // 4) * 8 + (j % 2) * 4)[None, :, None] + v
    qh_shift = (2 * ((j % 4) // 2))[None, :, None]
    # x of byte t of ql word u of half-block hb, nibble h2: element 128*hb + 64*h2 + 4*u + t,
    # as [BLOCK_M, H*16, 2, 2]
    cols = tl.arange(0, H * 16)
    x_offs = (offs_m[:, None, None, None] * K + ((cols // 16) * 128 + (cols % 16) * 4)[None, :, None, None]
              + 2 * tl.arange(0, 2)[None, None, :, None] + tl.arange(0, 2)[None, None, None, :])
    x_mask = m_mask[:, None, None, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(per_split):
        k0 = (first + step) * BLOCK_K
        ql = tl.load(ql_ptr + ql_offs + k0 // 8)  # [BLOCK_N, H*4, 4]
        qh = tl.load(qh_ptr + qh_offs + k0 // 16) >> qh_shift  # pair s's bits at 0-1 (h2 = 0), 4-5 (h2 = 1)
        half = k0 // 128 + j // 4  # half-block index within the row, per j
        block = rows[:, None] * (K // 256) + (half // 2)[None, :]  # [BLOCK_N, H*4]
        d = tl.load(d_ptr + block).to(tl.float32)
        # every byte of comb[h2] is one 6-bit quant: nibble h2 of the ql byte | its 2 qh bits << 4
        comb0 = (ql & 0x0F0F0F0F) | ((qh << 4) & 0x30303030)
        comb1 = ((ql >> 4) & 0x0F0F0F0F) | (qh & 0x30303030)
        for h2 in tl.static_range(2):
            # scale group (16 values) of ql word 4*j + v in plane h2: 8*(half % 2) + 4*h2 + j % 4
            group = (8 * (half % 2) + 4 * h2 + j % 4)[None, :]
            a = d * tl.load(scales_ptr + block * 16 + group).to(tl.float32)  # [BLOCK_N, H*4]
            a64 = (a * 64.0)[:, :, None]
            c = (a * 96.0)[:, :, None]
            comb = comb0 if h2 == 0 else comb1
            x4 = tl.load(x_ptr + x_offs + k0 + 64 * h2, mask=x_mask, other=0.0)
            x02, x13 = tl.split(x4)  # [BLOCK_M, H*16, 2]: bytes (0, 2) and (1, 3)
            x0, x2 = tl.split(x02)
            x1, x3 = tl.split(x13)
            acc = _plane_dot(acc, x0, comb, a64, c, 0, MAGIC, DOT)
            acc = _plane_dot(acc, x1, comb, a64, c, 8, MAGIC, DOT)
            acc = _plane_dot(acc, x2, comb, a64, c, 16, MAGIC, DOT)
            acc = _plane_dot(acc, x3, comb, a64, c, 24, MAGIC, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


@triton.jit
def _plane_dot(acc, x, comb, a64, c, shift: tl.constexpr, magic, DOT: tl.constexpr):
    """acc += x @ plane^T for the 6-bit quants at bit `shift` of every comb word.

    q goes straight into the mantissa of 1 + q/64 (shift, and, or with `magic` = 0x3F800000, a
    runtime register so and + or fuse into one LOP3; no int-to-float conversion), so
    w = (1 + q/64) * 64*d*sc - 96*d*sc = d*sc*(q - 32) is one FMA."""
    if shift <= 17:
        bits = (comb << (17 - shift)) & 0x7E0000
    else:
        bits = (comb >> (shift - 17)) & 0x7E0000
    w = (bits | magic).to(tl.float32, bitcast=True) * a64 - c
    wt = tl.reshape(w, (w.shape[0], w.shape[1] * w.shape[2]))
    if DOT == "x_dtype":
        return tl.dot(x, tl.trans(wt.to(x.dtype)), acc)
    else:
        return tl.dot(x.to(tl.float32), tl.trans(wt), acc, input_precision=DOT)


def matmul(x, fields, n, k, config=None):
    args = (fields["ql"], fields["qh"], fields["scales"], fields["d"])
    # the tiled kernel reads ql and qh as int32 words; MAGIC: see _plane_dot
    tiled_args = (fields["ql"].view(torch.int32), fields["qh"].view(torch.int32), *args[2:], MAGIC_ONE)
    return launch(x, args, n, k, 256, _q6_k_kernel, _q6_k_tiled, TILE_VALUES, config, tiled_args=tiled_args,
                  **TUNING)
