"""Shared pieces of the quantized matmul kernels: launch configuration, the x-times-weight step,
and the launcher that turns a packed weight into kernel arguments.

Every kernel computes out[M, N] = x[M, K] @ W[N, K]^T with grid (M tiles, N tiles, split-K): a
program owns BLOCK_N weight rows and BLOCK_M rows of x and walks its share of K, so each weight
byte is read once per M tile (once in total for M <= 64). Two kernel shapes per type:

* v2, "tiled" (`LaunchConfig.block_k > 0`, the default for 2-64 rows): each step loads BLOCK_K values of
  every row as a few wide contiguous byte tiles ("planes", e.g. Q4_K's low and high nibbles),
  dequantizes each tile ONCE, with the scales unpacked once per 16/32-value sub-block, and feeds
  it to `tl.dot` against the x tile padded to BLOCK_M >= 16 rows. Where it pays (Q4_K, Q6_K,
  Q8_0) the quants are read as int32 words, each byte position of a word is its own plane (x is
  split to match, in registers) and a quant is put straight into a float's mantissa (1 + q/2^b,
  one LOP3 with a register-held constant) so that dequantization is a shift, a LOP3 and one FMA
  per value: no int-to-float conversions, no per-value scale lookups. With bf16/f16 x the weights are
  rounded to x's dtype (what a dense bf16/f16 model does anyway) and multiplied on tensor cores
  with float32 accumulation, so the cost is flat in M up to BLOCK_M; float32 x keeps float32
  weights (tf32x3 or ieee dot).
* v1, "chunked" (`block_k == 0`): 16/32-value chunks dequantized in float32, multiplied by
  per-lane FMAs ("fma", the measured-fastest decode kernel for one row) or tl.dot (prefill chunks of
  65-511 rows); in DOT "store" mode it writes the dequantized weight instead (`dequantize_dense`,
  for prefill chunks of DENSE_MIN_M rows and more, which then multiply with cuBLAS).

Split-K is deterministic: each split writes float32 partials to a [split, M, N] scratch and
`_sum_splits` adds them in split order (no atomics), so a call's result is bit-identical run to run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtree.kernels import interpreted
from flashtree.kernels.quant_matmul import DENSE_MIN_M

SKINNY_MAX_M = 64
_H200_SMS = 132
_PROGRAMS_PER_SM = 24  # v1, measured: M = 1 needs ~20 resident programs/SM to keep loads in flight
_TILED_PROGRAMS_PER_SM = 8  # v2, measured (sweep of 2026-11-29): ~8 programs/SM, split-K at most 8
_MAX_SPLIT_K = 32
_TILED_MAX_SPLIT_K = 8

_TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)
DOTS = ("fma", "ieee", "tf32", "tf32x3", "x_dtype")


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes, kernel shape and how dequantized weights are multiplied by x (`dot`):
    "fma": float32 multiply-adds into per-lane partial sums (v1 only; x tiles under 16 rows);
    "ieee" / "tf32x3" / "tf32": tl.dot in float32 (x upcast), exact FMA, three TF32 passes (~float32
    error) or one; "x_dtype": weights rounded to x's bf16/f16 for plain tensor-core tl.dot.

    block_k: values of each weight row per inner step; 0 selects the v1 chunked kernel, > 0 the v2
    tiled kernel (a power of two, a multiple of the type's `TILE_VALUES`, block_m >= 16).
    num_stages: Triton's software-pipelining depth (None: Triton's default)."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    dot: str = "fma"
    block_k: int = 0
    num_stages: int | None = None

    @property
    def tiled(self) -> bool:
        return self.block_k > 0


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _H200_SMS


def _largest_divisor(count: int, limit: int) -> int:
    return max(s for s in range(1, max(1, min(limit, count)) + 1) if count % s == 0)


def split_for(n: int, block_n: int, steps: int, programs: int, limit: int) -> int:
    """The largest split-K dividing `steps` (the kernel loops have constexpr trip counts) that brings
    the grid up to about `programs` programs, at most `limit`."""
    wanted = triton.cdiv(programs, triton.cdiv(n, block_n))
    return _largest_divisor(steps, min(wanted, limit))


def default_block_k(k: int, tile_values: int, cap: int = 256) -> int:
    """The largest power of two <= cap that divides K (and is a multiple of the type's tile)."""
    block_k = cap
    while block_k > tile_values and k % block_k:
        block_k //= 2
    return block_k


@functools.cache
def choose_config(m: int, n: int, k: int, x_dtype: torch.dtype, device: torch.device,
                  block_values: int, tile_values: int = 0, block_k: int = 256, tiled_block_n: int = 128,
                  tiled_decode: bool = False) -> LaunchConfig:
    """Defaults for an H200, from the sweep of 2026-11-29 (benchmarks/sweep_quant_matmul.py, in
    docs/PERFORMANCE.md). tile_values = 0: the type has no v2 kernel; block_k: the type's default
    BLOCK_K; tiled_block_n: the type's best v2 BLOCK_N (Q5_K 64, others 128); tiled_decode: v2 also
    for M = 1 (Q6_K, where it beat v1; for Q4_K/Q5_K/Q8_0 v1's fma kernel was 1.5-2x faster).

    M > 64 (prefill): v1, 64 x 64 tiles, tensor-core dot in x's dtype (tf32x3 for float32 x); long
    prompts' chunks (M >= DENSE_MIN_M) skip this: see `launch`.
    2 <= M <= 64 with a v2 kernel: v2, BLOCK_M = max(16, next power of two of M) so the weights are
    read and dequantized once; BLOCK_K 128 and split-K (~8 programs per SM, at most 8) independent of
    M, so every verify size sums K in one order; 3 pipeline stages; dot in x's dtype for bf16/f16,
    tf32x3 for float32 x. M = 1 (decode) sums K in another order than verify: greedy speculative
    output may then differ from greedy AR output at near-ties (docs/PERFORMANCE.md).
    Otherwise (v1 skinny): fma for M < 16, tf32x3 from 16, split-K up to ~24 programs per SM.
    The interpreter (triton 3.6) multiplies bf16 tl.dot operands as raw integers: there bf16 x gets
    a float32 dot instead (float16 x keeps the x_dtype dot).
    """
    interpreter = interpreted()
    tensor_core = x_dtype == torch.float16 or (x_dtype == torch.bfloat16 and not interpreter)
    if m > SKINNY_MAX_M:
        dot = "x_dtype" if tensor_core else "tf32x3"
        return LaunchConfig(block_m=64, block_n=64, split_k=1, num_warps=4, dot=dot)
    if tile_values and k % tile_values == 0 and (m > 1 or tiled_decode):
        block_m = max(16, triton.next_power_of_2(m))
        # BLOCK_K 256 would take ~200-250 registers per thread at BLOCK_M 32 (ptxas, sm_90) and spill
        block_k = default_block_k(k, tile_values, min(block_k, 128))
        split_k = split_for(n, tiled_block_n, k // block_k, _TILED_PROGRAMS_PER_SM * _sm_count(device),
                            _TILED_MAX_SPLIT_K)
        dot = "x_dtype" if tensor_core else ("ieee" if interpreter else "tf32x3")
        return LaunchConfig(block_m=block_m, block_n=tiled_block_n, split_k=split_k, num_warps=4, dot=dot,
                            block_k=block_k, num_stages=3)
    block_m = triton.next_power_of_2(m)
    block_n = 32 if block_m < 16 else 64
    split_k = split_for(n, block_n, k // block_values, _PROGRAMS_PER_SM * _sm_count(device), _MAX_SPLIT_K)
    return LaunchConfig(block_m=block_m, block_n=block_n, split_k=split_k, num_warps=4,
                        dot="fma" if block_m < 16 else "tf32x3")


def dequantize_dense(weight_args: tuple, n: int, k: int, block_values: int, chunked,
                     dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The dense [N, K] weight in `dtype`, written by the type's v1 kernel in DOT "store" mode (the
    values its tensor-core dot would multiply): one program per 32 rows and quant block."""
    out = torch.empty(n, k, dtype=dtype, device=device)
    block_n, k_blocks = 32, k // block_values
    chunked[(1, triton.cdiv(n, block_n), k_blocks)](out, *weight_args, out, 0, n, k, BLOCK_M=16, BLOCK_N=block_n,
                                                    SPLIT_K=k_blocks, DOT="store", num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# pieces shared by the kernels


@triton.jit
def zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, DOT: tl.constexpr):
    """[BLOCK_M, BLOCK_N] accumulator; for "fma" [BLOCK_M, BLOCK_N, CHUNK] per-lane partial sums,
    reduced once in store_tile: a reduction per chunk costs cross-lane shuffles that bound M = 1."""
    if DOT == "fma":
        return tl.zeros((BLOCK_M, BLOCK_N, CHUNK), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def dot_chunk(acc, x_ptr, offs_m, m_mask, offs_n, N, k_offs, w, K, BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """acc += x[offs_m, k_offs] @ w^T, w: [BLOCK_N, C] float32 dequantized values (see zero_acc).
    k_offs may be any permutation-like gather of K: the tiled kernels pair each plane's columns
    with the x values of the same elements. DOT "store" (`dequantize_dense`): x_ptr is a dense
    [N, K] output and w is written to its rows offs_n, columns k_offs, in that tensor's dtype."""
    if DOT == "store":
        dense = x_ptr + offs_n[:, None].to(tl.int64) * K + k_offs[None, :]
        tl.store(dense, w.to(x_ptr.dtype.element_ty), mask=(offs_n < N)[:, None])
    else:
        x = tl.load(x_ptr + offs_m[:, None] * K + k_offs[None, :], mask=m_mask[:, None], other=0.0)
        if DOT == "x_dtype":
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        elif DOT == "fma":
            acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision=DOT)
    return acc


@triton.jit
def small_uint_to_float(v):
    """Exact float32 of integers 0 <= v < 2**23 without an int-to-float conversion instruction
    (a quarter-rate op on recent GPUs): the bits 0x4B000000 | v are the float 2**23 + v."""
    return (v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def program_tiles(M, N, K: tl.constexpr, BLOCK_VALUES: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's x rows, weight rows (clamped in range so weight loads need no mask; int64
    because row * row_bytes overflows int32 on big matrices), the steps per row, and its K range:
    steps first .. first + per_split - 1 of BLOCK_VALUES values each (SPLIT_K divides the steps)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_blocks: tl.constexpr = K // BLOCK_VALUES
    per_split: tl.constexpr = k_blocks // SPLIT_K
    return offs_m, offs_n, rows, k_blocks, tl.program_id(2) * per_split, per_split


@triton.jit
def store_tile(out_ptr, acc, offs_m, offs_n, M, N, DOT: tl.constexpr):
    """Store into out_ptr's dtype; split s (program_id 2) writes slice s of a [split, M, N] buffer
    (nothing for DOT "store": dot_chunk wrote the dequantized weights)."""
    if DOT != "store":
        if DOT == "fma":
            acc = tl.sum(acc, axis=2)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        base = out_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(base + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _sum_splits(part_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over s of part[s], always in order s = 0, 1, ... (deterministic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    total = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        total += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total, mask=mask)


def check_config(config: LaunchConfig, k: int, block_values: int, tile_values: int) -> None:
    if config.dot not in DOTS:
        raise ValueError(f"dot={config.dot!r} is not one of {DOTS}")
    if config.tiled:
        if not tile_values:
            raise ValueError("this type has no tiled (block_k > 0) kernel")
        bk = config.block_k
        if bk & (bk - 1) or bk % tile_values:
            raise ValueError(f"block_k={bk} must be a power of two and a multiple of {tile_values}")
        if config.dot == "fma" or config.block_m < 16:
            raise ValueError("the tiled kernel multiplies with tl.dot: dot != 'fma' and block_m >= 16")
        if k % (bk * config.split_k):
            raise ValueError(f"block_k * split_k = {bk * config.split_k} must divide K = {k}")
    elif (k // block_values) % config.split_k:
        raise ValueError(f"split_k={config.split_k} must divide the {k // block_values} blocks of a row")


def launch(x: torch.Tensor, weight_args: tuple, n: int, k: int, block_values: int, chunked,
           tiled=None, tile_values: int = 0, config: LaunchConfig | None = None,
           block_k: int = 256, tiled_args: tuple | None = None, **tuning) -> torch.Tensor:
    """Run the type's kernel on x [M, K]: `chunked` (v1) or `tiled` (v2) per the config
    (default: `choose_config`, with `block_k` the type's default BLOCK_K and `tuning` its other
    per-type defaults). `weight_args` go to the v1 kernel, `tiled_args` (default: the same) to v2. Without a config,
    a prefill chunk of bf16/f16 x with M >= DENSE_MIN_M goes through `dequantize_dense` and
    cuBLAS. Returns [M, N] in x's dtype."""
    m = x.shape[0]
    if tiled is None:
        tile_values = 0
    if config is None and m >= DENSE_MIN_M and x.dtype in _TENSOR_CORE_DTYPES:
        return x @ dequantize_dense(weight_args, n, k, block_values, chunked, x.dtype, x.device).T
    config = config or choose_config(m, n, k, x.dtype, x.device, block_values, tile_values, block_k, **tuning)
    check_config(config, k, block_values, tile_values)
    if config.tiled and tiled_args is not None:
        weight_args = tiled_args
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dest = out if config.split_k == 1 else torch.empty(config.split_k, m, n, dtype=torch.float32,
                                                       device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    options = {"num_warps": config.num_warps}
    if config.num_stages is not None:
        options["num_stages"] = config.num_stages
    if config.tiled:
        tiled[grid](x, *weight_args, dest, m, n, k, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                    BLOCK_K=config.block_k, SPLIT_K=config.split_k, DOT=config.dot, **options)
    else:
        chunked[grid](x, *weight_args, dest, m, n, k, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                      SPLIT_K=config.split_k, DOT=config.dot, **options)
    if config.split_k > 1:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](dest, out, m * n, SPLIT_K=config.split_k, BLOCK=block)
    return out
