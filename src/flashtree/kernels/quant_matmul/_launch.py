"""Shared pieces of the quantized matmul kernels: launch configuration, the x-times-weight-chunk step,
and the launcher that turns a packed weight into kernel arguments.

Every kernel computes out[M, N] (float32) = x[M, K] @ W[N, K]^T with grid
(M tiles, N tiles, split-K): a program owns BLOCK_N weight rows and BLOCK_M rows of x, walks its
share of the K blocks, dequantizes 16- or 32-value chunks of its rows in float32 and multiplies
them into the accumulator, so each weight byte is read once per M tile (once in total for M <= 64).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SKINNY_MAX_M = 64
_H200_SMS = 132
_PROGRAMS_PER_SM = 24  # measured: M = 1 needs ~20 resident programs/SM to keep loads in flight
_MAX_SPLIT_K = 32
_TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and how a dequantized chunk is multiplied by x (`dot`):
    "fma": float32 multiply-adds into per-lane partial sums (x tiles under 16 rows: tl.dot needs 16);
    "ieee" / "tf32x3": tl.dot in float32, exact FMA or three TF32 tensor-core passes (~float32 error);
    "x_dtype": weights rounded to x's bf16/f16 for plain tensor-core tl.dot (prefill speed)."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    dot: str = "fma"


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _H200_SMS


@functools.cache
def choose_config(m: int, n: int, k_blocks: int, x_dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    """Defaults for an H200; skinny (M <= 64) reads the weights once, prefill tiles M by 64."""
    # the interpreter (triton 3.6) multiplies bf16 tl.dot operands as raw integers
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if m > SKINNY_MAX_M:
        dot = "x_dtype" if x_dtype in _TENSOR_CORE_DTYPES and not interpreted else "tf32x3"
        return LaunchConfig(block_m=64, block_n=64, split_k=1, num_warps=4, dot=dot)
    block_m = triton.next_power_of_2(m)
    block_n = 32 if block_m < 16 else 64
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), triton.cdiv(n, block_n))
    # the largest divisor of the block count up to `wanted` (the kernel loops have constexpr trip counts)
    split_k = max(s for s in range(1, min(wanted, _MAX_SPLIT_K) + 1) if k_blocks % s == 0)
    return LaunchConfig(block_m=block_m, block_n=block_n, split_k=split_k, num_warps=4,
                        dot="fma" if block_m < 16 else "tf32x3")


@triton.jit
def zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, DOT: tl.constexpr):
    """[BLOCK_M, BLOCK_N] accumulator; for "fma" [BLOCK_M, BLOCK_N, CHUNK] per-lane partial sums,
    reduced once in store_tile: a reduction per chunk costs cross-lane shuffles that bound M = 1."""
    if DOT == "fma":
        return tl.zeros((BLOCK_M, BLOCK_N, CHUNK), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def dot_chunk(acc, x_ptr, offs_m, m_mask, k_offs, w, K, BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """acc += x[offs_m, k_offs] @ w^T, w: [BLOCK_N, C] float32 dequantized values (see zero_acc)."""
    x = tl.load(x_ptr + offs_m[:, None] * K + k_offs[None, :], mask=m_mask[:, None], other=0.0)
    if DOT == "x_dtype":
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    elif DOT == "fma":
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    else:
        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision=DOT)
    return acc


@triton.jit
def program_tiles(M, N, K: tl.constexpr, BLOCK_VALUES: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's x rows, weight rows (clamped in range so weight loads need no mask; int64
    because row * row_bytes overflows int32 on big matrices), the blocks per row, and its K range:
    blocks first .. first + per_split - 1 (SPLIT_K divides the block count)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_blocks: tl.constexpr = K // BLOCK_VALUES
    per_split: tl.constexpr = k_blocks // SPLIT_K
    return offs_m, offs_n, rows, k_blocks, tl.program_id(2) * per_split, per_split


@triton.jit
def store_tile(out_ptr, acc, offs_m, offs_n, M, N, SPLIT_K: tl.constexpr, DOT: tl.constexpr):
    if DOT == "fma":
        acc = tl.sum(acc, axis=2)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)


def launch(kernel, x: torch.Tensor, weight_args: tuple, n: int, k: int, block_values: int,
           config: LaunchConfig | None = None) -> torch.Tensor:
    """Run `kernel` on x [M, K]; returns float32 [M, N]."""
    m = x.shape[0]
    config = config or choose_config(m, n, k // block_values, x.dtype, x.device)
    if (k // block_values) % config.split_k:
        raise ValueError(f"split_k={config.split_k} must divide the {k // block_values} blocks of a row")
    alloc = torch.zeros if config.split_k > 1 else torch.empty
    out = alloc(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    kernel[grid](x, *weight_args, out, m, n, k,
                 BLOCK_M=config.block_m, BLOCK_N=config.block_n, SPLIT_K=config.split_k,
                 DOT=config.dot, num_warps=config.num_warps)
    return out
