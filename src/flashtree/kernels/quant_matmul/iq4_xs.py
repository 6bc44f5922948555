"""IQ4_XS: 256-value blocks, eight 32-value sub-blocks with 6-bit scales (low 4 bits in scales_l,
high 2 bits in the u16 scales_h); value = (d * (ls - 32)) * CODEBOOK[nibble].

Quant byte 16*r + l holds element 32*r + l (low nibble) and 32*r + 16 + l (high nibble), so each
[BLOCK_N, 16] byte tile feeds two 16-value chunks. The codebook is a 16-float table in global
memory (cache-resident gather).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.formats.quants import _IQ4_VALUES
from flashtree.kernels.quant_matmul._launch import dot_chunk, launch, program_tiles, store_tile, zero_acc

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
                acc = dot_chunk(acc, x_ptr, offs_m, m_mask, b * 256 + 32 * r + 16 * h + lanes, w, K,
                                BLOCK_M, DOT)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, SPLIT_K, DOT)


def _codebook(device: torch.device) -> torch.Tensor:
    if device not in _codebooks:
        _codebooks[device] = torch.tensor(_IQ4_VALUES, dtype=torch.float32, device=device)
    return _codebooks[device]


def matmul(x, fields, n, k, config=None):
    args = (fields["qs"], fields["scales_l"], fields["scales_h"], fields["d"], _codebook(x.device))
    return launch(_iq4_xs_kernel, x, args, n, k, 256, config)
