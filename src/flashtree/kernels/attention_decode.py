"""One token's attention over TQ3_0 (or Q8_0) K and V rows in CUDA C (`attention_decode.cu`): the split launch of
`tree_attention`'s flash-decoding for a decode over a long quantized cache, writing the splits' partial rows and
log-sum-exps that `tree_attention`'s combine launch merges (rotating TQ3_0 values back and applying the gate).

Why: the Triton decode issued on about a third of the cycles, 1754 warp instructions a 16-row chunk (345 us over
262K TQ3_0 rows on an H100, 5x the K/V bytes' time: issue #20's bar is 1.25x the 1K step). `tree_attention` launches
this where `takes` says so (one query token, TQ3_0 or Q8_0 on both sides, head dim 256, a KV head's group of at
most 8 query heads, no window, the query already normed, roped and rotated, NVRTC and sm_80+, not
FLASHTREE_DECODE_CUDA=0) and the Triton kernel otherwise.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch

from flashtree.kernels.cuda_functions import allow_shared, functions, launch, nvrtc_loads

SOURCE = Path(__file__).with_name("attention_decode.cu")
TQ3_TILES = Path(__file__).with_name("tq3_tiles.cuh")  # the TQ3_0 helpers both attention kernels share
HEAD_DIMS = (256,)  # rows of whole 16-byte copies (tq3_tiles.cuh copy_kv_rows: a 128-value row is 56 bytes)
MAX_GROUP = 8  # query heads a KV head (attention_decode.cu HEADS_MAX)
WARPS = 4
STAGES = 2  # raw chunks a warp's ring holds (one in flight while one is decoded)
# a cache type -> the kernel's block format (attention_decode.cu KIND_*, tree_attention.KV_KINDS), its block bytes
# and CTAs an SM (at most 168 registers a thread; head dim 256: TQ3_0 3 x 63.5 KB of shared memory, Q8_0 2 x 102 KB)
KINDS = {"tq3_0": 3, "q8_0": 1}
BLOCK_BYTES = {"tq3_0": 14, "q8_0": 34}
CTAS_PER_SM = {"tq3_0": 3, "q8_0": 2}
CHUNK = 16
# from this many rows; below, the Triton decode's shorter chains win. H100, thirty-second session (kernel and combine,
# `sweep_tree_attention.py --compare --cuda-decode-from 0`), 1 token over 1K / 4K / 8K / 16K / 64K / 262K TQ3_0 rows:
# Triton 9.7 / 21.5 / 47.0 / 55.7 / 121.5 / 360.8 us, this 12.2 / 14.8 / 21.9 / 32.2 / 63.3 / 178.4. Over Q8_0 rows
# (thirty-sixth session, the model's call: the query normed apart first), 4K / 16K / 64K / 262K rows: Triton 19.4 /
# 50.6 / 149.0 / 523.1 us, this 16.0 / 29.6 / 79.1 / 255.1.
MIN_ROWS = 4096
_MIN_CHUNKS_PER_WARP = 2
Q_TYPES = {torch.float32: "float", torch.bfloat16: "u16"}  # the query's dtype -> its CUDA C type


def takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kinds: tuple[str, str], window: int,
          normed: bool, kv_end: int) -> bool:
    """Whether this kernel runs the call: q [heads, 1, D] (float32 or bf16, unit stride along D) already normed,
    roped (and rotated over TQ3_0 keys: `normed`), TQ3_0 or Q8_0 caches, the same on both sides (`kinds`), whose rows
    start 16-byte aligned, D in `HEAD_DIMS`, at most `MAX_GROUP` query heads a KV head, no window, at least `MIN_ROWS`
    rows."""
    return (q.is_cuda and kv_end >= MIN_ROWS and fits(q, k_cache, v_cache, kinds, window, normed)
            and _available(q.device))


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kinds: tuple[str, str], window: int,
         normed: bool) -> bool:
    """`takes`' conditions on the call's shapes, types and layouts (any device)."""
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    return (n == 1 and kinds[0] == kinds[1] in KINDS and d in HEAD_DIMS and window == 0 and normed
            and q.dtype in Q_TYPES and q.stride(-1) == 1 and heads % kv_heads == 0
            and heads // kv_heads <= MAX_GROUP and all(rows_aligned(c, kinds[0], d) for c in (k_cache, v_cache)))


def rows_aligned(cache: torch.Tensor, kind: str, d: int) -> bool:
    """A uint8 cache of `kind` blocks, `d` values a row, whose rows start 16-byte aligned (cp.async's 16-byte
    copies)."""
    return (cache.dtype == torch.uint8 and cache.shape[-1] * 32 == d * BLOCK_BYTES[kind] and cache.stride(-1) == 1
            and cache.stride(1) % 16 == 0 and cache.stride(0) % 16 == 0 and cache.data_ptr() % 16 == 0)


def compiles_for(device: torch.device, d: int, q_dtype: torch.dtype, head_dims: tuple[int, ...], available) -> bool:
    """Whether a model with head dim `d` and `q_dtype` queries launches a CUDA attention kernel (head dims
    `head_dims`, `available(device)` on the device) on `device`: the load-time compile's guard."""
    device = torch.device(device)
    return device.type == "cuda" and d in head_dims and q_dtype in Q_TYPES and available(device)


@functools.cache
def _available(device: torch.device) -> bool:
    # cp.async and ldmatrix: sm_80; griddepcontrol (a no-op without the launch attribute) compiles for sm_90 only
    return (os.environ.get("FLASHTREE_DECODE_CUDA", "1") != "0" and torch.cuda.get_device_capability(device)[0] >= 9
            and nvrtc_loads())


def instance(d: int, q_dtype: torch.dtype, kind: str) -> str:
    return f"{kind.split('_')[0]}_decode_d{d}_w{WARPS}_s{STAGES}_{'f32' if q_dtype == torch.float32 else 'bf16'}"


def shared_bytes(d: int, kind: str) -> int:
    """attention_decode.cu `WarpSmem::BYTES` for each warp: its ring of raw K and V chunks, the decoded chunk and P."""
    raw = CHUNK * (d // 32) * BLOCK_BYTES[kind]
    return WARPS * (STAGES * 2 * raw + CHUNK * (d + 8) * 2 + CHUNK * MAX_GROUP * 2)


def source(d: int, q_dtype: torch.dtype, kind: str) -> str:
    name = instance(d, q_dtype, kind)
    qt = Q_TYPES[q_dtype]
    return TQ3_TILES.read_text() + "\n" + SOURCE.read_text() + (
        f'\nextern "C" __global__ void __launch_bounds__({32 * WARPS}, {CTAS_PER_SM[kind]}) {name}(const {qt}* q, '
        "const unsigned char* k, const unsigned char* v, const long long* start, const unsigned char* vis, "
        "float* part, float* lse, int stride_qh, int stride_kh, int stride_kr, int stride_vh, int stride_vr, "
        "int kv_end, int heads, int group, float scale_log2, unsigned table_low, unsigned table_high) {\n"
        f"    quant_decode<{d}, {WARPS}, {STAGES}, {KINDS[kind]}>(q, k, v, start, vis, part, lse, stride_qh, "
        "stride_kh, stride_kr, stride_vh, stride_vr, kv_end, heads, group, scale_log2, table_low, table_high);\n}\n")


def cuda_jobs(device: torch.device, d: int, q_dtype: torch.dtype, kind: str) -> list[tuple[str, str]]:
    """(name, CUDA C source) of the instance a model with head dim `d` and `q_dtype` activations launches on
    `device` over `kind` caches, for the load-time compile; none where it does not run."""
    if not compiles_for(device, d, q_dtype, HEAD_DIMS, _available):
        return []
    return [(instance(d, q_dtype, kind), source(d, q_dtype, kind))]


def splits_for(kv_end: int, kv_heads: int, sms: int, cap: int, kind: str) -> int:
    """CTAs along the rows: `CTAS_PER_SM` an SM over the KV heads, each warp at least `_MIN_CHUNKS_PER_WARP` chunks,
    at most `cap` (the combine's)."""
    wanted = math.ceil(CTAS_PER_SM[kind] * sms / kv_heads)
    return max(1, min(wanted, math.ceil(kv_end / (_MIN_CHUNKS_PER_WARP * WARPS * CHUNK)), cap))


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kind: str, start_t: torch.Tensor,
           visible_bytes: torch.Tensor, kv_end: int, scale_log2: float, tables: tuple[int, int], sms: int,
           max_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split launch for `takes`' calls over rows of `kind` (both sides) in `splits_for` splits -> (part
    [splits, heads, 1, D] float32, each split's normalized rows; lse [splits, heads, 1], base 2, scores times
    `scale_log2`); `tables`: TQ3_0's float16 level bytes (low, high) as int32 (unread over Q8_0 rows)."""
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    splits = splits_for(kv_end, kv_heads, sms, max_splits, kind)
    part = torch.empty(splits, heads, n, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, heads, n, dtype=torch.float32, device=q.device)
    name = instance(d, q.dtype, kind)
    fn = functions(q.device).function(name, lambda: source(d, q.dtype, kind))
    size = shared_bytes(d, kind)
    allow_shared(q.device, name, size)
    launch(fn, (kv_heads, splits), 32 * WARPS,
           [q, k_cache, v_cache, start_t, visible_bytes, part, lse, q.stride(0), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), kv_end, heads, heads // kv_heads, float(scale_log2), *tables],
           q.device, size)
    return part, lse
