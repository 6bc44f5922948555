"""IQ4_XS: 256-value blocks, eight 32-value sub-blocks with 6-bit scales (low 4 bits in scales_l,
high 2 bits in the u16 scales_h); value = (d * (ls - 32)) * CODEBOOK[nibble].

Quant byte 16*r + l holds element 32*r + l (low nibble) and 32*r + 16 + l (high nibble), so each
[BLOCK_N, 16] byte tile feeds two 16-value chunks. The codebook is a 16-float table in global
memory (cache-resident gather).

v2 (tiled): the [BLOCK_N, BLOCK_K / 32, 16] byte tile (BLOCK_K / 2 contiguous bytes per row) gives
two planes (low nibbles: elements 32*r + l, high: 32*r + 16 + l), both scaled by the per-sub-block
d * (ls - 32) [BLOCK_N, BLOCK_K / 32] unpacked once per step. Its codebook lookup is register
arithmetic, not a gather: the 16 entries + 128 are bytes of four int32 constants (`_CODE_WORDS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.formats.quants import IQ4_VALUES
from flashtree.kernels.quant_matmul._launch import (dot_chunk, launch, program_tiles, small_uint_to_float,
                                                    store_tile, zero_acc)

TILE_VALUES = 32  # one sub-block: 16 quant bytes
DEFAULT_BLOCK_K = 128  # at 256 a [64, 256] step needs ~255 registers per thread (ptxas, sm_90)

# codebook entry c + 128 (all in 1..241) is byte c % 4 of word c // 4
_CODE_WORDS = tuple(sum((v + 128) << (8 * j) for j, v in enumerate(IQ4_VALUES[4 * i:4 * i + 4])) for i in range(4))
_CODE_WORDS = tuple(w - (1 << 32) if w >= 1 << 31 else w for w in _CODE_WORDS)  # as int32
_W0, _W1, _W2, _W3 = (tl.constexpr(w) for w in _CODE_WORDS)

_codebooks: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _iq4_xs_kernel(x_ptr, qs_ptr, scales_l_ptr, scales_h_ptr, d_ptr, codebook_ptr, out_ptr, M, N, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                   DOT: tl.constexpr):
    offs_m, offs_n, rows, k_blocks, first, per_split = program_tiles(M, N, K, 256, BLOCK_M, BLOCK_N, SPLIT_K)
    m_mask = offs_m < M
    lanes = tl.arange(0, 16)
    acc = zero_acc(BLOCK_M, BLOCK_N, 16, DOT)
    for step in range(per_split):
        b = first + step
        block = rows * k_blocks + b
        d = tl.load(d_ptr + block).to(tl.float32)
        for r in tl.static_range(8):
            low = (tl.load(scales_l_ptr + block * 4 + r // 2) >> (4 * (r % 2))) & 0xF
            high = (tl.load(scales_h_ptr + block * 2 + r // 4) >> (2 * (r % 4))) & 3
            dl = d * ((low | (high << 4)).to(tl.float32) - 32)
            q = tl.load(qs_ptr + block[:, None] * 128 + 16 * r + lanes[None, :])
            for h in tl.static_range(2):
                w = dl[:, None] * tl.load(codebook_ptr + ((q >> (4 * h)) & 0xF))
                acc = dot_chunk(acc, x_ptr, offs_m, m_mask, offs_n, N, b * 256 + 32 * r + 16 * h + lanes, w, K,
                                BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


@triton.jit
def _codebook_lookup(nibble, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
    """CODEBOOK[nibble] as exact float32, from the constant words (selects and shifts, no memory)."""
    word = tl.where(nibble < 8, tl.where(nibble < 4, W0, W1), tl.where(nibble < 12, W2, W3))
    return small_uint_to_float((word >> (8 * (nibble & 3))) & 0xFF) - 128.0


@triton.jit(do_not_specialize=["M"])  # one compile per BLOCK_M, whatever M
def _iq4_xs_tiled(x_ptr, qs_ptr, scales_l_ptr, scales_h_ptr, d_ptr, codebook_ptr, out_ptr, M, N,
                  K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, DOT: tl.constexpr):
    offs_m, offs_n, rows, _, first, per_split = program_tiles(M, N, K, BLOCK_K, BLOCK_M, BLOCK_N, SPLIT_K)
    m_mask = offs_m < M
    R: tl.constexpr = BLOCK_K // 32  # sub-blocks per step
    subs = tl.arange(0, R)
    cols = tl.arange(0, R * 16)
    plane_elements = (cols // 16) * 32 + cols % 16  # + 16 * nibble
    qs_offs = rows[:, None, None] * (K // 2) + subs[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(per_split):
        k0 = (first + step) * BLOCK_K
        q = tl.load(qs_ptr + qs_offs + k0 // 2).to(tl.int32)
        sub = k0 // 32 + subs  # sub-block index within the row
        r = (sub % 8)[None, :]
        block = rows[:, None] * (K // 256) + (sub // 8)[None, :]  # [BLOCK_N, R]
        low = (tl.load(scales_l_ptr + block * 4 + r // 2) >> (4 * (r % 2))) & 0xF
        high = (tl.load(scales_h_ptr + block * 2 + r // 4) >> (2 * (r % 4))) & 3
        dl = tl.load(d_ptr + block).to(tl.float32) * ((low | (high << 4)).to(tl.float32) - 32)
        for h in tl.static_range(2):
            value = _codebook_lookup((q >> (4 * h)) & 0xF, _W0, _W1, _W2, _W3)
            w = dl[:, :, None] * value
            acc = dot_chunk(acc, x_ptr, offs_m, m_mask, offs_n, N, k0 + 16 * h + plane_elements,
                            tl.reshape(w, (BLOCK_N, R * 16)), K, BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT)


def _codebook(device: torch.device) -> torch.Tensor:
    if device not in _codebooks:
        _codebooks[device] = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)
    return _codebooks[device]


def matmul(x, fields, n, k, config=None):
    args = (fields["qs"], fields["scales_l"], fields["scales_h"], fields["d"], _codebook(x.device))
    return launch(x, args, n, k, 256, _iq4_xs_kernel, _iq4_xs_tiled, TILE_VALUES, config, DEFAULT_BLOCK_K)
