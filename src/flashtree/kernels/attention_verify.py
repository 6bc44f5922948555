"""A tree verify's attention over TQ3_0 (or Q8_0) K and V rows in CUDA C (`attention_verify.cu`): the split launch of
`tree_attention` for a verify (2 to `MAX_ROWS` / group tokens) over a long quantized cache, each K/V row decoded once
into shared memory by a producer warpgroup for all the query rows of its KV head (up to 144 in one CTA: two consumer
warpgroups of 64 on wgmma and a tail of 16 on mma.sync), writing the splits' partial rows and log-sum-exps that
`tree_attention`'s combine launch merges (rotating TQ3_0 values back, applying the gate).

Why: Triton's verify took a 128-row and a 10-row query tile over each KV head's rows, each decoding every row in
registers (issue #20's bar: verify-22 at 262K within 1.3x of 1K). H100, thirty-fourth session (kernel and combine,
`sweep_tree_attention.py --compare --cuda-verify-from 0`, the model's call: float32 query, bf16 operands), 23 tokens
over 16K / 64K / 262K TQ3_0 rows: this 53.8 / 135.2 / 439.8 us; the thirty-third session's (two CTAs of 128 rows,
each decoding every row, its warps decoding between their MMAs) 82.6 / 228.0 / 812.2; Triton's 96.4 / 274.7 /
953.9. 21 tokens (128 rows) over 64K / 262K: 111.8 / 358.5 against 136.0 / 417.8. Nsight Compute (64K rows, before
the consumers' softmax and descriptors were trimmed): the producer waited on the consumers, the consumers on their
own instructions (about 1050 a warp a 64-row chunk) and instruction fetch.

`tree_attention` launches this where `takes` says so (2 to `MAX_ROWS` query rows a KV head, TQ3_0 or Q8_0 on both
sides, head dim 256, no window, the query already normed, roped (and rotated), NVRTC and sm_90, at least `MIN_ROWS`
rows, not FLASHTREE_VERIFY_CUDA=0) and the Triton kernel otherwise.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch

from flashtree.kernels.attention_decode import BLOCK_BYTES, KINDS, Q_TYPES, TQ3_TILES, compiles_for, rows_aligned
from flashtree.kernels.cuda_functions import allow_shared, functions, launch, nvrtc_loads

SOURCE = Path(__file__).with_name("attention_verify.cu")
HEAD_DIMS = (256,)  # whole 16-byte copies a row (attention_verify.cu VerifySmem)
WG_ROWS = 128  # query rows of a CTA's two warpgroups of 64 (attention_verify.cu WG_ROWS)
TAIL_ROWS = 16  # and of its mma.sync tail, where the group's rows pass WG_ROWS (TAIL_ROWS)
MAX_ROWS = 192  # a KV head's query rows (23 tokens x 6 heads: 138, one CTA with a tail; 32 x 6: two)
THREADS = 384  # a producer warpgroup (copies, decode) and two consumer warpgroups (MMAs)
# attention_verify.cu VerifySmem::SLOTS: decoded K/V sides in a ring (Q8_0's raw chunks leave room for two)
SLOTS = {"tq3_0": 3, "q8_0": 2}
# the descriptor strides of V, row-major in shared memory and transposed by the tensor cores (MN-major): the byte
# distance between core matrices adjacent along K (8 K/V rows: 128) and along N (8 values: 16 x the chunk's rows)
V_STRIDES = (128, 1024)
STAGES = 2  # attention_verify.cu STAGES: raw chunks in shared memory
CHUNK = 64  # attention_verify.cu VCHUNK
P_PITCH = CHUNK * 2 + 16  # attention_verify.cu P_PITCH
# from this many rows: Triton's verify wins at 4K (above), this one from 16K. Over Q8_0 rows (thirty-sixth session,
# H100, 23 tokens, the query normed apart first), 16K / 64K / 262K: Triton 152.4 / 411.6 / 1404.3 us, this 54.7 /
# 136.8 / 464.2.
MIN_ROWS = 16384
_MIN_CHUNKS_PER_SPLIT = 2


def takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kinds: tuple[str, str], window: int,
          normed: bool, kv_end: int) -> bool:
    """Whether this kernel runs the call: `fits`, on a GPU where it compiles, at least `MIN_ROWS` rows."""
    return (q.is_cuda and kv_end >= MIN_ROWS and fits(q, k_cache, v_cache, kinds, window, normed)
            and _available(q.device))


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kinds: tuple[str, str], window: int,
         normed: bool) -> bool:
    """`takes`' conditions on the call's shapes, types and layouts (any device): q [heads, T, D] with T >= 2 (one
    token: `attention_decode`) and group x T <= `MAX_ROWS`, float32 or bf16, unit stride along D, already normed,
    roped and rotated (`normed`); TQ3_0 or Q8_0 caches, the same on both sides, whose rows start 16-byte aligned; D in
    `HEAD_DIMS`; no window."""
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    return (n >= 2 and kinds[0] == kinds[1] in KINDS and d in HEAD_DIMS and window == 0 and normed
            and q.dtype in Q_TYPES and q.stride(-1) == 1 and heads % kv_heads == 0
            and heads // kv_heads * n <= MAX_ROWS and all(rows_aligned(c, kinds[0], d) for c in (k_cache, v_cache)))


@functools.cache
def _available(device: torch.device) -> bool:
    # warpgroup MMA: sm_90a only (cuda_functions.target), not later architectures
    return (os.environ.get("FLASHTREE_VERIFY_CUDA", "1") != "0" and torch.cuda.get_device_capability(device) == (9, 0)
            and nvrtc_loads())


def has_tail(query_rows: int) -> bool:
    """Whether a KV head's `query_rows` take the instance with a tail: past the warpgroups' 128 rows, within one CTA's
    144. Past those, two CTAs of 128 rows without a tail cost less than two of 144 with one: 32 tokens over 64K rows
    232 us against 301 (H100, thirty-fourth session), where the 144-row CTA takes 1.3x a 128-row one (23 against 21
    tokens over 64K rows: 166 against 129 us, one slice each)."""
    return WG_ROWS < query_rows <= WG_ROWS + TAIL_ROWS


def slice_rows(tail: bool) -> int:
    return WG_ROWS + TAIL_ROWS * tail


def instance(d: int, q_dtype: torch.dtype, tail: bool, kind: str) -> str:
    return (f"{kind.split('_')[0]}_verify_d{d}_{'f32' if q_dtype == torch.float32 else 'bf16'}"
            f"{'_tail' if tail else ''}")


def shared_bytes(d: int, tail: bool, kind: str) -> int:
    """attention_verify.cu `VerifySmem::BYTES`: the raw K and V chunks, the ring of decoded sides and a slice's query
    rows; with a tail, its P rows and the warps' row maxima."""
    raw = CHUNK * (d // 32) * BLOCK_BYTES[kind]
    side = CHUNK * d * 2
    return (STAGES * 2 * raw + SLOTS[kind] * side + slice_rows(tail) * d * 2
            + (TAIL_ROWS * P_PITCH + 8 * TAIL_ROWS * 4 if tail else 0))


def source(d: int, q_dtype: torch.dtype, tail: bool, kind: str) -> str:
    name = instance(d, q_dtype, tail, kind)
    qt = Q_TYPES[q_dtype]
    return TQ3_TILES.read_text() + "\n" + SOURCE.read_text() + (
        f'\nextern "C" __global__ void __launch_bounds__({THREADS}, 1) {name}(const {qt}* q, '
        "const unsigned char* k, const unsigned char* v, const long long* start, const unsigned char* vis, "
        "float* part, float* lse, int stride_qh, int stride_qt, int stride_kh, int stride_kr, int stride_vh, "
        "int stride_vr, int T, int kv_end, int heads, int group, float scale_log2, unsigned table_low, "
        "unsigned table_high, int v_lbo, int v_sbo) {\n"
        f"    quant_verify<{d}, {'true' if tail else 'false'}, {KINDS[kind]}>(q, k, v, start, vis, part, lse, "
        "stride_qh, stride_qt, stride_kh, stride_kr, stride_vh, stride_vr, T, kv_end, heads, group, scale_log2, "
        "table_low, table_high, v_lbo, v_sbo);\n}\n")


def cuda_jobs(device: torch.device, d: int, q_dtype: torch.dtype, kind: str) -> list[tuple[str, str]]:
    """(name, CUDA C source) of the instances a model with head dim `d` and a `q_dtype` query launches on `device` over
    `kind` caches, for the load-time compile; none where it does not run."""
    if not compiles_for(device, d, q_dtype, HEAD_DIMS, _available):
        return []
    return [(instance(d, q_dtype, tail, kind), source(d, q_dtype, tail, kind)) for tail in (False, True)]


def slices_for(query_rows: int) -> int:
    return -(-query_rows // slice_rows(has_tail(query_rows)))  # one with a tail, else slices of 128


def splits_for(kv_end: int, kv_heads: int, sms: int, cap: int, query_rows: int = MAX_ROWS) -> int:
    """CTAs along the rows: one an SM (188-207 KB of shared memory) over the KV heads' slices, in one wave, each
    split at least `_MIN_CHUNKS_PER_SPLIT` chunks, at most `cap` (the combine's)."""
    wanted = sms // (kv_heads * slices_for(query_rows))
    return max(1, min(wanted, math.ceil(kv_end / (_MIN_CHUNKS_PER_SPLIT * CHUNK)), cap))


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kind: str, start_t: torch.Tensor,
           visible_bytes: torch.Tensor, kv_end: int, scale_log2: float, tables: tuple[int, int], sms: int,
           max_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split launch for `takes`' calls over rows of `kind` (both sides) in `splits_for` splits -> (part
    [splits, heads, T, D] float32, each split's normalized rows; lse [splits, heads, T], base 2, scores times
    `scale_log2`); `tables`: TQ3_0's float16 level bytes (low, high) as int32 (unread over Q8_0 rows)."""
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    rows = heads // kv_heads * n
    splits = splits_for(kv_end, kv_heads, sms, max_splits, rows)
    part = torch.empty(splits, heads, n, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, heads, n, dtype=torch.float32, device=q.device)
    tail = has_tail(rows)
    name = instance(d, q.dtype, tail, kind)
    fn = functions(q.device).function(name, lambda: source(d, q.dtype, tail, kind))
    size = shared_bytes(d, tail, kind)
    allow_shared(q.device, name, size)
    launch(fn, (kv_heads * slices_for(rows), splits), THREADS,
           [q, k_cache, v_cache, start_t, visible_bytes, part, lse, q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), n, kv_end, heads, heads // kv_heads,
            float(scale_log2), *tables, *V_STRIDES], q.device, size)
    return part, lse
