"""Decode / tree-verify attention straight from the KV cache (Triton, flash-decoding), graph-safe.

`tree_attention(q, k_cache, v_cache, kv_type_k, kv_type_v, start_t, visible, positions, kv_end, scale,
window=0, split=None)` -> [heads, T, D] in q.dtype, for the rows of a graphed `Step`:

* cache rows r < start (start = `start_t[0]`, a device tensor) are committed: visible to every query;
* row start + j holds new node j: visible to query i iff visible[i, j];
* rows >= start + T (and >= kv_end) are garbage and never read;
* window W > 0: query i (position positions[i]) sees a key at position p only if positions[i] - p < W
  (committed row r has position r, new node j position positions[j]).
The mask is `graphed_mask` (also what `Step` uses for a graphed step). GQA: query head h reads kv head h // (heads //
kv_heads). Caches are [kv_heads, capacity, D] float (f32/f16/bf16) or uint8 [kv_heads, capacity,
row_bytes] Q8_0/Q4_0/TQ3_0 blocks (kv_quant.py); kv types are anything `kv_quant.kv_type` takes (KVType or
name), K and V independently.

One normed query token over TQ3_0 or Q8_0 K and V rows (from `attention_decode.MIN_ROWS` rows, at the launch defaults)
takes `attention_decode`'s CUDA C split launch instead of the Triton kernel below, and the same combine; a tree of up
to `attention_verify.MAX_ROWS` query rows a KV head over them (from `attention_verify.MIN_ROWS` rows)
`attention_verify`'s.

Kernel (flash-decoding): grid (kv_heads, query tiles, splits). A program owns one KV head, a tile of
BLOCK_M query rows of that head's group (row m = local head * T + token, so a group's G*T rows share each
K/V load) and one split of the rows it can see. The row range is computed on the device from `start_t`:
[lo, min(start + T, kv_end)) with lo = 0, or with a window the lowest row any query of the tile can see,
divided evenly (in BLOCK_N multiples) among the splits, so the work spreads over the GPU whatever the
committed length, and the garbage rows past start + T cost nothing. A split walks its whole chunks of
committed rows first, unmasked but for a window (`_committed_chunk`), then the at most ceil(T / BLOCK_N) + 1
chunks holding start and the new rows with the tree mask (`_chunk`). Each BLOCK_N chunk of K/V rows is
loaded once, dequantized in registers (Q8_0: int8 * fp16 d; Q4_0: (nibble - 8) * d; TQ3_0: fp16 group
norm * one of 8 centroids picked by 2 low bits + 1 sign bit, in the rotated domain; each thread decodes whole
32-value blocks from their halfword fields, `_block_values`; a committed chunk's TQ3_0 fields are loaded
while the chunk before it is decoded, `row_fields`), scores go through
tl.dot in float32 (bf16/f16 operands for bf16/f16 queries on GPU), masked, and an online softmax (base 2,
float32 max / sum) accumulates P @ V. Each split writes its normalized partial output and log-sum-exp (for the
launch's own query rows: [splits, kv_heads, rows a KV head]); a second kernel combines the splits per (head,
token). With one split the first kernel writes the output directly. A group's few query rows past its last whole tile may take a second launch in a tile of their
own size (`_tail_rows`: over long quantized rows a 128-row tile costs its decode of every K/V row), with its own
splits and combine. No host reads of device tensors: every shape and launch parameter depends only on the
Python arguments (T, kv_end, heads, D, dtypes), so the calls can be captured in a CUDA graph. (Under
TRITON_INTERPRET=1 the chunk loop runs a fixed trip count with a per-chunk skip instead, since the
interpreter cannot loop to a bound loaded from memory; the loop bodies are the same.)

TQ3_0 values are decoded as `TQ3_0.dequantize` does, in the rotated domain: callers with TQ3_0
keys pass the rotated query (`rotate`). On the GPU with 16-bit operands they decode as float16 pairs
(`_tq3_pairs`: the level's bits picked by a byte permute, the sign OR-ed in, the norm by a half-precision
multiply); elsewhere (the interpreter, float32 operands, or a bf16/f32 cache on the other side) in float32,
exactly. The output stays rotated for TQ3_0 values unless the caller asks
for `unrotate_values`, which the combine launch does (`hadamard`) before the output gate. Head dims the
kernel cannot tile (not a power of two >= 32; for TQ3_0 also not a multiple of 128) use `tree_attention_reference`, which is plain torch and also
graph-safe (but dequantizes all of [0, kv_end) per call). Without CUDA (and without TRITON_INTERPRET=1)
the reference runs too.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import attention_decode, attention_verify, interpreted, triton_runs_on
from flashtree.kernels.activations import gated_heads
from flashtree.kernels.qk_norm_rope import qk_norm_rope
from flashtree.kernels.kv_quant import TQ3_GROUP, TQ3_LEVELS, KVType, kv_type, rotation_signs, unrotate

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch reference serves
    triton = None

_H200_SMS = 132
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 256
MAX_TREE_QUERIES = 128  # tokens per call (a tree of budget <= 127 plus its root, or a short prefill chunk)
_MAX_GROUP = 8
_SWAPPED_ROWS = 8  # a swapped decode's query tile: the MMA's narrowest N side
# `_tail_rows`: at most this many rows past the last whole query tile go to a launch of their own, over at least
# this many K/V rows (shorter ranges: the extra launch and combine cost more than the second tile's decode)
_TAIL_MAX_ROWS = 16
_TAIL_MIN_KV_ROWS = 16384
# from this many K/V rows any tile decodes TQ3_0 rows as float16 pairs (`_tiles`), not only a small decode
_PAIRS_MIN_KV_ROWS = 16384
KV_KINDS = {"f32": 0, "f16": 0, "bf16": 0, "q8_0": 1, "q4_0": 2, "tq3_0": 3}  # kernel's KIND per cache type
TQ3_PAIRS = 4  # KIND of TQ3_0 rows decoded as float16 pairs (`_tq3_pairs`)
_LOG2E = 1.4426950408889634
_TL_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if triton is not None else {}


@functools.cache
def _tq3_f16_byte_tables() -> tuple[int, int]:
    """The 4 TQ3_0 magnitudes in float16 as two int32 byte tables for a byte permute: byte i of the first holds
    level i's low byte, byte i of the second its high byte."""
    bits = torch.tensor(TQ3_LEVELS, dtype=torch.float32).to(torch.float16).view(torch.int16).int() & 0xFFFF
    low = sum(int(b & 0xFF) << (8 * i) for i, b in enumerate(bits))
    high = sum(int(b >> 8) << (8 * i) for i, b in enumerate(bits))
    return tuple(t - 2**32 if t >= 2**31 else t for t in (low, high))


# ------------------------------------------------------------------------------------------------
# reference (plain torch, graph-safe)

def graphed_mask(start_t: torch.Tensor, visible: torch.Tensor, positions: torch.Tensor, kv_end: int,
                 window: int = 0) -> torch.Tensor:
    """bool [T, kv_end] for a graphed step (models/step.py): row r < start is committed, row start + j is new
    token j (seen by query i iff visible[i, j]), later rows are garbage; a window also hides keys
    `window` or more positions behind the query."""
    n = positions.shape[0]
    rows = torch.arange(kv_end, device=positions.device)
    rel = rows - start_t  # the row's index among the new tokens
    new = (rel >= 0) & (rel < n)
    node = rel.clamp(0, n - 1)
    mask = (rows < start_t)[None, :] | (visible[:, node] & new[None, :])
    if window > 0:
        key_pos = torch.where(new, positions[node], rows)  # committed row r holds position r
        mask = mask & (positions[:, None] - key_pos[None, :] < window)
    return mask


def tree_attention_reference(q, k_cache, v_cache, kv_type_k, kv_type_v, start_t, visible, positions, kv_end,
                             scale, window=0, split=None):
    """float32 softmax attention over the dequantized rows [0, kv_end) with `graphed_mask`; rows at or past
    start + T are zeroed first (garbage, possibly NaN, must not leak through 0 * NaN). `split` is ignored."""
    tk, tv = kv_type(kv_type_k), kv_type(kv_type_v)
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    keys = tk.dequantize(k_cache[:, :kv_end], torch.float32)
    values = tv.dequantize(v_cache[:, :kv_end], torch.float32)
    rows = torch.arange(kv_end, device=q.device)
    live = (rows < start_t + n)[None, :, None]
    keys = torch.where(live, keys, torch.zeros((), device=q.device))
    values = torch.where(live, values, torch.zeros((), device=q.device))
    mask = graphed_mask(start_t, visible, positions, kv_end, window)
    qf = q.float().reshape(kv_heads, group * n, d)
    scores = (qf @ keys.transpose(1, 2)) * scale  # [kv_heads, group * T, kv_end]
    scores = scores.view(kv_heads, group, n, kv_end).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(kv_heads, group * n, kv_end)
    return (probs @ values).reshape(heads, n, d).to(q.dtype)


def tq3_pair_values(rows: torch.Tensor) -> torch.Tensor:
    """float32 [..., head_dim] of TQ3_0 storage rows as the kernel's float16 pair decode gives them (`_tq3_pairs`,
    in the natural column order): float16(float16(level) * norm), signed. `TQ3_0.dequantize` keeps the float32
    product; the two differ by float16 roundings, about 1e-3 of a value."""
    t = kv_type("tq3_0")
    norm = rows.reshape(*rows.shape[:-1], -1, t.block_bytes)[..., :2].contiguous().view(torch.float16).float()
    index = t.indices(rows)  # [..., blocks, 32]
    levels = torch.tensor(TQ3_LEVELS, device=rows.device).half().float()
    magnitude = (levels[index & 3] * norm).half().float()  # exact product of two float16s, rounded once
    return torch.where(index >= 4, -magnitude, magnitude).reshape(*rows.shape[:-1], -1)


# ------------------------------------------------------------------------------------------------
# Triton kernels

if triton is not None:
    from flashtree.kernels.hadamard import rotate_row  # (defined where triton is)
    from flashtree.kernels.qk_norm_rope import norm_rope_tile

    # TQ3_0 centroid magnitudes (index & 3), as float32 constants exactly as `TQ3_0._centroids` builds them
    TQ3_C0, TQ3_C1, TQ3_C2, TQ3_C3 = (tl.constexpr(level) for level in TQ3_LEVELS)
    # the same magnitudes in float16, as a byte permute's table: low bytes of levels 0-3, then their high bytes
    TQ3_F16_LOW, TQ3_F16_HIGH = (tl.constexpr(table) for table in _tq3_f16_byte_tables())
    _HALF_SIGNS = tl.constexpr(0x80008000 - 2**32)  # the sign bits of both halves, as an int32
    _PAIRS_KIND = tl.constexpr(TQ3_PAIRS)
    _PTX = tl.constexpr(not interpreted())  # byte_perm is PTX's prmt; the interpreter runs `_byte_perm_emulated`

    @triton.jit
    def load_rows(base, rows, row_ok, stride_r, D: tl.constexpr, KIND: tl.constexpr, OP: tl.constexpr):
        """[BLOCK_N, D] values of cache rows `rows` (zeros where not row_ok), in the dot operand dtype OP.
        KIND 0: float rows; 1: Q8_0 (34-byte blocks: fp16 d, 32 int8); 2: Q4_0 (18-byte blocks: fp16 d,
        16 bytes, byte j = q[j] | q[j + 16] << 4, value (q - 8) * d); 3: TQ3_0 (14-byte blocks: fp16 group
        norm, qs[8] low index bits 2(j%4) of byte j/4, signs[4] high bit j%8 of byte j/8; value = norm *
        C[low | hi << 2], C = +levels then -levels, exactly `TQ3_0.dequantize`: rotated domain, no rotation here);
        TQ3_PAIRS: TQ3_0 in float16 (`_tq3_pairs`).
        The loads (`row_fields`) and the decode (`row_values`) can be apart (`_committed_fields`)."""
        return row_values(row_fields(base, rows, row_ok, stride_r, D, KIND, True), D, KIND, OP, True)

    @triton.jit
    def row_fields(base, rows, row_ok, stride_r, D: tl.constexpr, KIND: tl.constexpr, AHEAD: tl.constexpr):
        """What `row_values` decodes rows from, so that a loop can load the next chunk's fields while it
        decodes this one's: TQ3_0 rows' `_block_halfwords` (loaded here), other rows' pointers and mask (the
        load stays with its use: float rows are streamed to shared memory by Triton's pipeliner, and Q8_0's 17
        halfwords a block held one chunk ahead spilled the verify's registers; H200 sweep, 2026-12-02:
        ahead, TQ3_0 verify of 23 tokens over 262K rows 1318 -> 1166 us, Q8_0's over 64K 465 -> 591). Without
        AHEAD TQ3_0 rows take the pointers too (a 1-warp decode then fits its registers)."""
        row_ptrs = base + rows.to(tl.int64)[:, None] * stride_r
        if KIND >= 3 and AHEAD:
            fields = _block_halfwords(row_ptrs, row_ok, D, KIND)
        else:
            fields = (row_ptrs, row_ok)
        return fields

    @triton.jit
    def _block_halfwords(row_ptrs, row_ok, D: tl.constexpr, KIND: tl.constexpr):
        """Each block's fields as [rows, blocks, 1] halfwords (every field of a 34-, 18- or 14-byte block starts at
        an even byte): the scale, then Q8_0's 16 value halfwords, Q4_0's 8, or TQ3_0's 4 index and 2 sign
        halfwords. Loaded as one flat run of (row, block) pairs, a row's blocks adjacent: a thread then holds whole
        rows' blocks in order and the decoded values reach shared memory 16 bytes a store at any warp count (with
        [blocks, rows] loads a 1-warp program held rows first and stored 2 bytes at a time: 2237 instructions a
        chunk where this takes 1840; sm_90 offline, triton 3.6 and 3.9)."""
        BN: tl.constexpr = row_ptrs.shape[0]
        NB: tl.constexpr = D // 32
        block_bytes: tl.constexpr = 34 if KIND == 1 else 18 if KIND == 2 else 14
        flat = tl.arange(0, BN * NB)
        ok = tl.reshape(tl.broadcast_to(row_ok[:, None], (BN, NB)), (BN * NB,))
        blocks = tl.reshape(tl.broadcast_to(row_ptrs, (BN, NB)), (BN * NB,)) + (flat % NB) * block_bytes
        halfwords: tl.constexpr = 16 if KIND == 1 else 8 if KIND == 2 else 6
        fields = (tl.reshape(_halfword(blocks, ok), (BN, NB, 1)),)
        for i in tl.static_range(halfwords):
            fields = fields + (tl.reshape(_halfword(blocks + 2 + 2 * i, ok), (BN, NB, 1)),)
        return fields

    @triton.jit
    def _halfword(ptrs, ok):
        """uint16 at the (2-byte aligned) byte pointers `ptrs` of uint8 rows, as int32."""
        return tl.load(ptrs.to(tl.pointer_type(tl.uint16)), mask=ok, other=0).to(tl.int32)

    @triton.jit
    def row_values(fields, D: tl.constexpr, KIND: tl.constexpr, OP: tl.constexpr, AHEAD: tl.constexpr):
        """[BLOCK_N, D] values in OP of the rows whose `row_fields` these are."""
        if KIND == 0:
            row_ptrs, row_ok = fields
            x = tl.load(row_ptrs + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        elif KIND >= 3 and AHEAD:
            x = _block_values(fields, D, KIND)
        else:
            row_ptrs, row_ok = fields
            x = _block_values(_block_halfwords(row_ptrs, row_ok, D, KIND), D, KIND)
        return x.to(OP)

    @triton.jit
    def _block_values(fields, D: tl.constexpr, KIND: tl.constexpr):
        """float32 [BLOCK_N, D] of quantized rows' `_block_halfwords`. A block's 32 values, broadcast along the
        fields' last axis, sit in the thread that loaded the block: the scale is converted once per block, and
        the choice of halfword, shift and mask for each value is a constant of its register."""
        NB: tl.constexpr = D // 32
        BN: tl.constexpr = fields[0].shape[0]
        scale = fields[0].to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)  # [rows, NB, 1]
        j = tl.arange(0, 32)[None, None, :]
        if KIND == _PAIRS_KIND:
            x = _tq3_pairs(fields)
        elif KIND == 1:  # value j: byte j % 2 of halfword j // 2, signed
            hw = tl.zeros((BN, NB, 32), tl.int32)
            for i in tl.static_range(16):
                hw = tl.where(j // 2 == i, fields[1 + i], hw)
            x = ((hw << (24 - 8 * (j % 2))) >> 24).to(tl.float32) * scale
        elif KIND == 2:  # value j: nibble j // 16 of byte j % 16, i.e. of halfword (j % 16) // 2 at bit 8 (j % 2)
            hw = tl.zeros((BN, NB, 32), tl.int32)
            for i in tl.static_range(8):
                hw = tl.where((j % 16) // 2 == i, fields[1 + i], hw)
            x = (((hw >> (8 * (j % 2) + 4 * (j // 16))) & 15).to(tl.float32) - 8.0) * scale
        else:  # TQ3_0, value j: index bits 2 (j % 8) of qs halfword j // 8, sign bit j % 16 of sign halfword j // 16
            qs = tl.zeros((BN, NB, 32), tl.int32)
            for i in tl.static_range(4):
                qs = tl.where(j // 8 == i, fields[1 + i], qs)
            sg = tl.where(j < 16, fields[5], fields[6])
            x = _tq3_values((qs >> (2 * (j % 8))) & 3, (sg >> (j % 16)) & 1) * scale
        return tl.reshape(x, (BN, D))

    @triton.jit
    def _tq3_pairs(fields):
        """float16 [BN, NB, 32] of TQ3_0 rows' `_block_halfwords`, two neighbouring values a 32-bit register. Per
        pair: one byte permute brings the two 2-bit indices into bytes 0 and 1 (from four masked copies of each
        index word, one per bit offset), one multiply-add spreads them into the selector of a second permute
        that picks each index's float16 low and high byte from the magnitude table, one shift and one AND-OR set
        both signs (from sign words with each odd value's bit 15 places above its even neighbour's), one
        two-lane half-precision multiply applies the norm. The 27B decode launch's chunk loop: 610 instructions
        a warp where the float32 decode's select trees take 771 (sm_90 offline, triton 3.6 as on the device).
        Built per value j, not as a join of the pairs' halves: a join made the MMA operands take 4-wide k
        fragments (register moves and 64-bit shared loads around every MMA)."""
        j = tl.arange(0, 32)[None, None, :]
        k = j // 2  # value j's pair: values 2k, 2k + 1 (each pair's work is done once for both, by the compiler)
        low = fields[1] | (fields[2] << 16)  # values 0-15, value j's index bits at 2j
        high = fields[3] | (fields[4] << 16)  # values 16-31
        word = tl.where(k < 8, low, high)
        half = k % 8  # the pair within its word: values 4 m + r and 4 m + r + 1 with m = half // 2, r = 2 (half % 2)
        first = (word >> (4 * (half % 2))) & 0x03030303  # byte m: value 4 m + r
        second = (word >> (4 * (half % 2) + 2)) & 0x03030303  # byte m: value 4 m + r + 1
        quarter = half // 2
        indices = _byte_perm(first, second, quarter | (quarter + 4) << 4)  # bytes 0, 1: the pair's two indices
        # selector nibbles (i, i + 4, i', i' + 4): level i's low byte from the first table, its high byte from the
        # second; the permute reads the selector's low 16 bits only
        magnitudes = _byte_perm(TQ3_F16_LOW, TQ3_F16_HIGH, indices * 0x11 + 0x4040)
        signs = tl.where(k < 8, fields[5], fields[6])  # 16 values' signs, value 2 half + i's at bit 2 half + i
        spread = (signs & 0x5555) | ((signs & 0xAAAA) << 15)  # odd values' signs 15 places up: 16 above the even's
        pair = _half_pairs_times(magnitudes | ((spread << (15 - 2 * half)) & _HALF_SIGNS), fields[0])
        return _half(pair >> (16 * (j % 2)))  # value j: its half of the pair

    @triton.jit
    def _half_pairs_times(pair, scale_bits):
        """The int32 `pair` of two float16 values, each times the float16 whose bits are `scale_bits`: one two-lane
        multiply in PTX (as float16 tensors, the compiler swapped each register's halves before and after)."""
        scales = scale_bits | (scale_bits << 16)
        if _PTX:
            out = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [pair, scales], dtype=tl.int32,
                                            is_pure=True, pack=1)
        else:
            out = _half_pairs_product(pair, scales)
        return out

    @triton.jit
    def _half_pairs_product(a, b):
        """`_half_pairs_times`' multiply in float16 arithmetic, for the interpreter."""
        low = _half(a) * _half(b)
        high = _half(a >> 16) * _half(b >> 16)
        return low.to(tl.uint16, bitcast=True).to(tl.int32) | (high.to(tl.uint16, bitcast=True).to(tl.int32) << 16)

    @triton.jit
    def _half(bits):
        """The float16 in the low 16 bits of int32 `bits`."""
        return bits.to(tl.uint16).to(tl.float16, bitcast=True)

    @triton.jit
    def _byte_perm(a, b, selector):
        """PTX prmt.b32 (default mode): byte k of the result is byte (selector >> 4k) & 7 of the 8 bytes b:a."""
        if _PTX:  # (libdevice's byte_perm masks the selector with 0x7777 first: an instruction more each)
            out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, selector], dtype=tl.int32,
                                            is_pure=True, pack=1)
        else:
            out = _byte_perm_emulated(a, b, selector)
        return out

    @triton.jit
    def _byte_perm_emulated(a, b, selector):
        """`_byte_perm` in integer arithmetic, for the interpreter (which runs no PTX); the sign-replicating
        selector bit (8) is not used here and not emulated."""
        out = tl.zeros_like(selector + a + b)
        for k in tl.static_range(4):
            pick = (selector >> (4 * k)) & 7
            byte = (tl.where(pick >= 4, b, a) >> (8 * (pick & 3))) & 0xFF
            out = out | (byte << (8 * k))
        return out

    @triton.jit
    def _tq3_values(low, neg):
        """The unit-norm TQ3_0 value of 2 index bits `low` and a sign bit `neg`."""
        odd = (low & 1) != 0  # a two-level select tree: a linear where-chain spilled registers on sm_90
        level = tl.where((low & 2) != 0, tl.where(odd, TQ3_C3, TQ3_C2), tl.where(odd, TQ3_C1, TQ3_C0))
        return tl.where(neg != 0, -level, level)

    @triton.jit
    def _chunk(q, k_base, v_base, vis_ptr, pos_ptr, r0, my_hi, start, T, window, tok, qpos, m_ok, m_i, l_i, acc,
               stride_kr, stride_vr, scale_log2, D: tl.constexpr, KIND_K: tl.constexpr, KIND_V: tl.constexpr,
               OP: tl.constexpr, PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
               SWAP: tl.constexpr):
        """One BLOCK_N chunk of rows [r0, min(r0 + BLOCK_N, my_hi)) that may hold new rows or end the range:
        scores, the full mask (tree visibility from `vis_ptr`), online-softmax update."""
        rows = r0 + tl.arange(0, BLOCK_N)
        row_ok = rows < my_hi
        k = load_rows(k_base, rows, row_ok, stride_kr, D, KIND_K, OP)
        s = _scores(q, k, PRECISION, SWAP) * scale_log2  # [BLOCK_M, BLOCK_N]
        rel = rows - start
        new = (rel >= 0) & row_ok
        node = tl.minimum(tl.maximum(rel, 0), T - 1)
        vis = tl.load(vis_ptr + tok[:, None] * T + node[None, :], mask=m_ok[:, None] & new[None, :], other=0)
        ok = ((rows < start) & row_ok)[None, :] | (vis != 0)
        if HAS_WINDOW:
            key_pos = tl.where(new, tl.load(pos_ptr + node, mask=new, other=0).to(tl.int32), rows)
            ok = ok & ((qpos[:, None] - key_pos[None, :]) < window)
        ok = ok & m_ok[:, None]
        v = load_rows(v_base, rows, row_ok, stride_vr, D, KIND_V, OP)
        return _softmax_update(tl.where(ok, s, float("-inf")), v, m_i, l_i, acc, OP, PRECISION, SWAP)

    @triton.jit
    def _committed_fields(k_base, v_base, r0, committed_hi, stride_kr, stride_vr, D: tl.constexpr,
                          KIND_K: tl.constexpr, KIND_V: tl.constexpr, BLOCK_N: tl.constexpr, AHEAD: tl.constexpr):
        """`row_fields` of the K and V rows of the committed chunk at r0 (none past committed_hi)."""
        rows = r0 + tl.arange(0, BLOCK_N)
        live = rows < committed_hi
        return (row_fields(k_base, rows, live, stride_kr, D, KIND_K, AHEAD),
                row_fields(v_base, rows, live, stride_vr, D, KIND_V, AHEAD))

    @triton.jit
    def _committed_chunk(q, k_fields, v_fields, r0, window, qpos, m_i, l_i, acc, scale_log2, D: tl.constexpr,
                         KIND_K: tl.constexpr, KIND_V: tl.constexpr, OP: tl.constexpr, PRECISION: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, AHEAD: tl.constexpr, SWAP: tl.constexpr):
        """`_chunk` for a whole chunk of committed rows (all below start and inside the split), from its K/V
        `row_fields` (loaded one chunk ahead, `_committed_fields`): every query sees every row, so no tree-mask
        gather (a [BLOCK_M, BLOCK_N] byte load whose layout conversions went through shared memory with
        several barriers per chunk) and no row bounds; only a window, whose mask comes from positions already
        in registers. Query rows past the tile's end get finite scores (q is zero there) and are never stored."""
        k = row_values(k_fields, D, KIND_K, OP, AHEAD)
        s = _scores(q, k, PRECISION, SWAP) * scale_log2
        if HAS_WINDOW:
            rows = r0 + tl.arange(0, BLOCK_N)
            s = tl.where((qpos[:, None] - rows[None, :]) < window, s, float("-inf"))
        v = row_values(v_fields, D, KIND_V, OP, AHEAD)
        return _softmax_update(s, v, m_i, l_i, acc, OP, PRECISION, SWAP)

    @triton.jit
    def _scores(q, k, PRECISION: tl.constexpr, SWAP: tl.constexpr):
        """[BLOCK_M, BLOCK_N] q @ k^T; with SWAP, q is held transposed ([D, BLOCK_M]) and the product is taken as
        (k @ q^T)^T: the K rows are the MMA's M side, so a decode's few query rows need only its 8-wide N side."""
        if SWAP:
            s = tl.trans(tl.dot(k, q, input_precision=PRECISION))
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        return s

    @triton.jit
    def _softmax_update(s, v, m_i, l_i, acc, OP: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr):
        """Online softmax (base 2, float32) of a chunk's masked scores s [BLOCK_M, BLOCK_N] and values v: new
        running max, sum and P @ V accumulator ([BLOCK_M, D], or with SWAP [D, BLOCK_M] = V^T @ P^T: a decode's
        accumulator then takes half the registers). A row with every score masked so far keeps max -inf (its
        exponents use 0 instead, so no inf - inf)."""
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SWAP:
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v), tl.trans(p.to(OP)), input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(OP), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, start_ptr, vis_ptr, pos_ptr, out_ptr, part_ptr, lse_ptr,
                               gate_ptr, stride_gt, stride_gh, qn_w_ptr, cos_ptr, sin_ptr, qn_eps,
                               stride_qh, stride_qt, stride_kh, stride_kr, stride_vh, stride_vr,
                               T, kv_end, heads, scale_log2, window, m_base, m_rows,
                               G: tl.constexpr, D: tl.constexpr, KIND_K: tl.constexpr, KIND_V: tl.constexpr,
                               OP: tl.constexpr, PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                               FIXED_TRIPS: tl.constexpr, TRIPS: tl.constexpr, TAIL_TRIPS: tl.constexpr,
                               GATED: tl.constexpr, NORM_Q: tl.constexpr, ROT: tl.constexpr,
                               FIELDS_AHEAD: tl.constexpr, SWAP: tl.constexpr):
        kvh = tl.program_id(0)
        split = tl.program_id(2)
        offs_m = m_base + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < G * T
        m_safe = tl.where(m_ok, offs_m, 0)
        head = kvh * G + m_safe // T
        tok = m_safe % T
        d = tl.arange(0, D)
        q_rows = q_ptr + head.to(tl.int64)[:, None] * stride_qh + tok[:, None] * stride_qt
        if NORM_Q:  # q arrives raw from its projection: per-head RMSNorm and RoPE here (`qk_norm_rope`)
            q = _query_operand(norm_rope_tile(q_rows, qn_w_ptr, cos_ptr, sin_ptr, tok, d, m_ok, qn_eps, D, ROT), OP)
        else:
            q = _query_operand(tl.load(q_rows + d[None, :], mask=m_ok[:, None], other=0.0), OP)
        if SWAP:
            q = tl.trans(q)

        start = tl.load(start_ptr).to(tl.int32)
        end = tl.minimum(start + T, kv_end)
        qpos = tl.load(pos_ptr + tok).to(tl.int32)
        lo = 0
        if HAS_WINDOW:  # the lowest committed row some query of this tile can see; new rows always count
            min_pos = tl.min(tl.where(m_ok, qpos, 2147483647), axis=0)
            lo = tl.maximum(tl.minimum(min_pos - window + 1, start), 0)
        chunk = tl.cdiv(tl.cdiv(tl.maximum(end - lo, 0), SPLITS), BLOCK_N) * BLOCK_N
        my_lo = lo + split * chunk
        my_hi = tl.minimum(my_lo + chunk, end)

        k_base = k_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + kvh.to(tl.int64) * stride_vh
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        if SWAP:
            acc = tl.zeros((D, BLOCK_M), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, D), tl.float32)
        # whole chunks of committed rows first (no tree mask), then the rest: at most the chunk straddling
        # start and the new rows, ceil(T / BLOCK_N) + 1 chunks
        committed_hi = my_lo + tl.maximum(tl.minimum(start, my_hi) - my_lo, 0) // BLOCK_N * BLOCK_N
        # each committed chunk's `row_fields` are taken while the chunk before it is decoded (TQ3_0 rows go
        # through registers, out of reach of Triton's pipeliner)
        k_fields, v_fields = _committed_fields(k_base, v_base, my_lo, committed_hi, stride_kr, stride_vr, D, KIND_K,
                                               KIND_V, BLOCK_N, FIELDS_AHEAD)
        if FIXED_TRIPS:  # the interpreter cannot loop to a loaded bound: walk the longest range, skip the rest
            for i in range(0, TRIPS):
                r0 = my_lo + i * BLOCK_N
                if r0 < committed_hi:
                    next_k, next_v = _committed_fields(k_base, v_base, r0 + BLOCK_N, committed_hi, stride_kr,
                                                       stride_vr, D, KIND_K, KIND_V, BLOCK_N, FIELDS_AHEAD)
                    m_i, l_i, acc = _committed_chunk(q, k_fields, v_fields, r0, window, qpos, m_i, l_i, acc,
                                                     scale_log2, D, KIND_K, KIND_V, OP, PRECISION, HAS_WINDOW, BLOCK_N,
                                                     FIELDS_AHEAD, SWAP)
                    k_fields, v_fields = next_k, next_v
            for i in range(0, TAIL_TRIPS):
                r0 = committed_hi + i * BLOCK_N
                if r0 < my_hi:
                    m_i, l_i, acc = _chunk(q, k_base, v_base, vis_ptr, pos_ptr, r0, my_hi, start, T, window, tok, qpos,
                                           m_ok, m_i, l_i, acc, stride_kr, stride_vr, scale_log2, D, KIND_K, KIND_V,
                                           OP, PRECISION, HAS_WINDOW, BLOCK_N, SWAP)
        else:
            for r0 in range(my_lo, committed_hi, BLOCK_N):
                next_k, next_v = _committed_fields(k_base, v_base, r0 + BLOCK_N, committed_hi, stride_kr, stride_vr, D,
                                                   KIND_K, KIND_V, BLOCK_N, FIELDS_AHEAD)
                m_i, l_i, acc = _committed_chunk(q, k_fields, v_fields, r0, window, qpos, m_i, l_i, acc, scale_log2,
                                                 D, KIND_K, KIND_V, OP, PRECISION, HAS_WINDOW, BLOCK_N, FIELDS_AHEAD,
                                                 SWAP)
                k_fields, v_fields = next_k, next_v
            for r0 in range(committed_hi, my_hi, BLOCK_N):
                m_i, l_i, acc = _chunk(q, k_base, v_base, vis_ptr, pos_ptr, r0, my_hi, start, T, window, tok, qpos,
                                       m_ok, m_i, l_i, acc, stride_kr, stride_vr, scale_log2, D, KIND_K, KIND_V,
                                       OP, PRECISION, HAS_WINDOW, BLOCK_N, SWAP)

        if SWAP:
            acc = tl.trans(acc)
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        row = head.to(tl.int64) * T + tok  # (head, token) index in [heads * T]
        if SPLITS == 1:
            if GATED:
                _store_gated(out_ptr, gate_ptr, ((tok * heads + head) * D).to(tl.int64)[:, None] + d[None, :],
                             (tok * stride_gt + head * stride_gh).to(tl.int64)[:, None] + d[None, :], o, m_ok[:, None])
            else:
                tl.store(out_ptr + row[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
        else:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            # this launch's rows only: [splits, kv_heads, m_rows] (a tail launch's 10 rows a KV head, not all heads x T)
            base = (split.to(tl.int64) * tl.num_programs(0) + kvh) * m_rows + (offs_m - m_base)
            tl.store(part_ptr + base[:, None] * D + d[None, :], o, mask=m_ok[:, None])
            tl.store(lse_ptr + base, lse, mask=m_ok)

    @triton.jit
    def _query_operand(q, OP: tl.constexpr):
        """q as the score dot's operand. A bf16 or float32 query for f16 operands is clamped to +-65280,
        the largest bf16 value f16 holds: a query beyond it would turn inf and the scores NaN. (Clamped in
        bf16: a float32 copy of the [BLOCK_M, D] tile spilled registers.)"""
        if OP == tl.float16 and q.dtype != tl.float16:
            q = tl.minimum(tl.maximum(q, -65280.0), 65280.0)
        return q.to(OP)

    @triton.jit
    def _store_gated(out_ptr, gate_ptr, out_offs, gate_offs, o, mask):
        """Attention's output gate at the store (`activations.gated_heads`), at token-major offsets of
        [T, heads * D]: the output rounded to its dtype, times sigmoid(gate) rounded to it, rounded again."""
        dtype = out_ptr.dtype.element_ty
        g = tl.load(gate_ptr + gate_offs, mask=mask, other=0.0)
        gated = o.to(dtype).to(tl.float32) * tl.sigmoid(g.to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(out_ptr + out_offs, gated.to(dtype), mask=mask)

    @triton.jit
    def _combine_kernel(part_ptr, lse_ptr, out_ptr, gate_ptr, stride_gt, stride_gh, signs_ptr, T, heads,
                        group_rows, m_base, m_rows, D: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                        GATED: tl.constexpr, UNROTATE: tl.constexpr):
        """The splits' partial rows merged by their log-sum-exps, a program a row: rows [m_base, m_base + m_rows)
        of each KV head's `group_rows` (the rows one launch of `_tree_attention_kernel` covered, its partials
        [SPLITS, kv_heads, m_rows, D] and log-sum-exps [SPLITS, kv_heads, m_rows]); with UNROTATE
        (TQ3_0 values) the row, rounded to the output dtype as `unrotate` of the kernel's output would take it,
        rotated back (R^T) first."""
        pid = tl.program_id(0)  # = kv head * m_rows + the row's index in the launch, the partials' row
        rows_total = tl.num_programs(0)  # kv_heads * m_rows: a split's partial rows
        row = ((pid // m_rows) * group_rows + m_base + pid % m_rows).to(tl.int64)  # = head * T + token
        sp = tl.arange(0, SPLITS_P2)
        lse = tl.load(lse_ptr + sp * rows_total + pid, mask=sp < SPLITS, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        den = tl.sum(tl.exp2(lse - mx), axis=0)
        d = tl.arange(0, D)
        acc = tl.zeros((D,), tl.float32)
        for s in range(SPLITS):
            w = tl.exp2(tl.load(lse_ptr + s * rows_total + pid) - mx)
            acc += w * tl.load(part_ptr + (s * rows_total + pid).to(tl.int64) * D + d)
        o = acc / tl.where(den > 0, den, 1.0)
        if UNROTATE:
            o = rotate_row(o.to(out_ptr.dtype.element_ty).to(tl.float32), signs_ptr, D, True)
        if GATED:  # row = head * T + token
            head, tok = row // T, row % T
            _store_gated(out_ptr, gate_ptr, (tok * heads + head) * D + d, tok * stride_gt + head * stride_gh + d, o,
                         d < D)
        else:
            tl.store(out_ptr + row * D + d, o.to(out_ptr.dtype.element_ty))


# ------------------------------------------------------------------------------------------------
# launch

@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _H200_SMS


def programs_per_sm(quantized: bool, m_tiles: int, warps: int = 4) -> int:
    """Resident programs an SM that the split count aims for. A decode over quantized rows (one query tile):
    8 of one or two warps each (H200, 2026-12-05, sweep_tree_attention.py --compare: 1 token over 262K TQ3_0 rows
    334.2 us in swapped 2-warp programs, 365.5 in 1-warp ones, at twice the splits of 4 an SM), or 4 of 4 warps
    capped at 128 registers a thread (2026-12-02: 132 splits instead of 66 took 462 instead of 648 us over 262K
    TQ3_0 rows)."""
    if quantized and m_tiles == 1:
        return 8 if warps <= 2 else 4
    return _PROGRAMS_PER_SM


def choose_splits(kv_end: int, kv_heads: int, m_tiles: int, sms: int = _H200_SMS, block_rows: int = 64,
                  programs_per_sm: int = _PROGRAMS_PER_SM, min_chunks: int = 4) -> int:
    """Splits of the row range: enough programs (kv_heads * m_tiles * splits) for ~`programs_per_sm` per SM,
    each split at least `min_chunks` chunks long (a swapped decode: 2; H200, 2026-12-05, 1 token over 1K TQ3_0 rows
    8.9 us in 34 splits, 10.2 in 17). Short rows ranges are latency-bound (a chain of dependent chunk steps per
    program), so they split as finely too: 23 tokens over 1K rows took 61 us in one split per query tile (12 programs
    on 132 SMs, 66 chunks each, H200 2026-12-01), when a split had to be 8 x the query rows long (to keep
    the float32 partials small next to the K/V they summarize; they stay in L2 at these sizes)."""
    wanted = math.ceil(programs_per_sm * sms / (kv_heads * m_tiles))
    return max(1, min(wanted, math.ceil(kv_end / (min_chunks * block_rows)), _MAX_SPLITS))


def supported_head_dim(d: int, t: KVType) -> bool:
    """`load_rows` takes a whole row as one tl.arange(0, D) tile, so D must be a power of two (>= 32, the
    Q8_0/Q4_0 block); TQ3_0 rows also need whole 128-value groups (D = 128, 256, 512, ...)."""
    return d >= 32 and d & (d - 1) == 0 and not (t.name == "tq3_0" and d % TQ3_GROUP)


def _tq3_pairs_by_default(tk: KVType, tv: KVType, operands: torch.dtype, interpreter: bool) -> bool:
    """TQ3_0 rows decode as float16 pairs where the MMAs take 16-bit operands anyway (the GPU), unless the other
    side is a bf16 or f32 float cache, whose values may lie beyond f16's range."""
    return (not interpreter and operands in (torch.bfloat16, torch.float16)
            and not any(t.name in ("bf16", "f32") for t in (tk, tv)))


def _triton_supports(q, tk: KVType, tv: KVType) -> bool:
    """Other head dims (e.g. 96, 384), unknown kv types, and CPU tensors without the interpreter go to the
    torch reference."""
    d = q.shape[-1]
    return (triton is not None and triton_runs_on(q.device) and tk.name in KV_KINDS and tv.name in KV_KINDS
            and supported_head_dim(d, tk) and supported_head_dim(d, tv))


def _check(q, k_cache, v_cache, tk, tv, start_t, visible, positions, kv_end):
    if q.dim() != 3:
        raise FlashtreeError(f"tree_attention needs q [heads, T, D], got {tuple(q.shape)}")
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    if heads % kv_heads or v_cache.shape[0] != kv_heads:
        raise FlashtreeError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if heads // kv_heads > _MAX_GROUP or n > MAX_TREE_QUERIES:
        raise FlashtreeError(f"tree_attention handles T <= {MAX_TREE_QUERIES} and GQA groups <= {_MAX_GROUP}, "
                             f"got T={n}, group={heads // kv_heads}")
    for name, cache, t in (("k", k_cache, tk), ("v", v_cache, tv)):
        dtype, width = (t.dtype, d) if hasattr(t, "dtype") else (torch.uint8, t.row_bytes(d))
        if cache.dim() != 3 or cache.dtype != dtype or cache.shape[-1] != width:
            raise FlashtreeError(f"{name} cache {tuple(cache.shape)} {cache.dtype} does not hold {t.name} rows of "
                                 f"head_dim {d} ([kv_heads, capacity, {width}] {dtype})")
        if cache.shape[1] < kv_end:
            raise FlashtreeError(f"kv_end {kv_end} is past the {name} cache capacity {cache.shape[1]}")
    if tuple(visible.shape) != (n, n) or tuple(positions.shape) != (n,) or start_t.numel() != 1:
        raise FlashtreeError(f"visible must be [T, T], positions [T] and start_t [1] (T={n})")


class Launch(NamedTuple):
    """A launch's shape: query rows a program (BLOCK_M), K/V rows a chunk (BLOCK_N), warps, pipeline stages (None:
    Triton's), a thread's register cap (None: none), and whether the MMAs' sides are swapped (`_scores`)."""
    block_m: int
    block_n: int
    warps: int
    stages: int | None = None
    max_registers: int | None = None
    swap: bool = False


def _launch_defaults(query_rows: int, d: int, quantized: bool, windowed: bool = False, exact: bool = False,
                     tq3: bool = False) -> Launch:
    """The `Launch` for a KV head's `query_rows` (GQA group x T). Float rows: head_dim 256 with a full query tile
    takes short row chunks and 4 warps, which keep the [64, 256] accumulator out of local memory (H200 sweep,
    benchmarks/sweep_tree_attention.py: 545 -> 332 us for 23 tokens at 64K rows). Quantized rows:
    `_block_values` gives each thread one block of 32 values, so a chunk is as many rows as the CTA's threads
    cover (1024 / d per warp; a longer chunk repeats rows in a thread's registers, and the values then reach
    shared memory 2 bytes per store); past one 64-row query tile, 128-row tiles of 8 warps decode each K/V row
    for fewer tiles (H200 sweep at 262K TQ3_0 rows, 2026-12-02: 23 tokens 1345 us against 1546 with 64-row
    tiles). A decode (at most 8 query rows: one token's head group) over TQ3_0 rows (`tq3`) swaps the MMAs' sides
    (the K rows the M side, the query rows the 8-wide N side: a [D, 8] accumulator, 128 registers a thread) on 2
    warps, 8 programs an SM (`programs_per_sm`; H200, 2026-12-05, 1 token, main's 4-warp 16-row tile -> this: 1K
    9.4 -> 8.9 us, 64K 119.8 -> 101.1, 262K 428.5 -> 334.2), except with a window (its mask spilled in 128
    registers). Its registers are capped at 128, so that the 8 programs fit an SM's 64K registers: uncapped, the
    launch taking `m_base` compiled to 153 (6 an SM), and 1 token over 64K / 262K TQ3_0 rows took 144.6 / 442.8 us
    (H200, 2026-12-05; main's kernel at 128 registers: 107.9 / 345.3 in the twenty-fourth session; capped, on another
    H200: 122.6 / 363.2 against the 3421ff9 kernel's 123.4 / 432.0; offline sm_90, triton 3.6). 9-16
    such rows (two tokens, or a verify's rows past its 128-row tile, `_tail_rows`) swap too, on 4
    warps (offline sm_90, triton 3.6, TQ3_0 pairs at use: 553 loop instructions a warp a 16-row chunk, 112 registers,
    no stack, against 826 for the 16-row tile's float32 decode; H200, 2026-12-05: 2 tokens over 64K rows 125.7 us
    against 121.5 for the old 16-row tile). Q8_0 / Q4_0 rows keep 4 warps capped
    at 128 registers on a 16-row tile: the swapped 2-warp decode
    took them 14.1 / 157.2 / 506.4 us at 1K / 64K / 262K Q8_0 rows against 12.6 / 150.0 / 538.2.
    `exact` (float32 operands: a float32 model) takes 16-row query tiles of 4 warps and the shortest chunks:
    its dots are FMA loops, and the quantized rows' 128-row tile compiled to 57K instructions with 10 KB of
    stack a thread in 26 s (offline sm_90, 2026-12-04), the small tile to 5K in 4-6 s."""
    if exact:
        return Launch(16, max(16, 4 * 1024 // d) if quantized else 16, 4)
    block_m = min(64, max(16, triton.next_power_of_2(query_rows)))
    if quantized:
        if query_rows <= _SWAPPED_ROWS and tq3 and not windowed:
            return Launch(_SWAPPED_ROWS, max(16, 2 * max(1, 1024 // d)), 2, max_registers=128, swap=True)
        if query_rows <= 2 * _SWAPPED_ROWS and tq3 and not windowed:
            return Launch(2 * _SWAPPED_ROWS, max(16, 4 * max(1, 1024 // d)), 4, max_registers=128, swap=True)
        wide = query_rows > 64
        warps = 8 if wide else 4
        rows = max(16, warps * max(1, 1024 // d))  # tl.dot takes 16 rows at least (head_dim 512 and up repeat rows)
        cap = 128 if block_m == 16 and not windowed else None
        return Launch(128, rows, warps, 2) if wide else Launch(block_m, rows, warps, max_registers=cap)
    wide = d >= 256 and block_m >= 64
    return Launch(block_m, 64 if d <= 128 else 16 if wide else 32, 4 if block_m * d <= 16 * 256 or wide else 8)


def _query_in_operands(q: torch.Tensor, operands: torch.dtype) -> torch.Tensor:
    """A float32 query rounded to the MMAs' operand type before the launch, as `_query_operand` rounds it in the
    kernel (clamped to f16's range for f16 operands): a wide query tile loading float32 rows spilled 536 bytes a
    thread, 10 spill loads and stores a chunk (the 128-row TQ3_0 verify tile, offline sm_90, triton 3.6; 112 bytes
    and none in the loop from 16-bit rows), which a bf16 model's float32 activations brought (6a45de0) after
    the sixteenth session's 262K verify at 33.06 ms (37.55 ms in the twenty-fourth)."""
    if operands == torch.float16:
        q = q.clamp(-65280.0, 65280.0)
    return q.to(operands)


def _tail_rows(query_rows: int, block_m: int, kv_end: int, quantized: bool) -> int:
    """Query rows of a KV head's group that a launch of their own takes (0: none): the few rows past the last
    whole query tile, over long quantized rows. A 128-row tile decodes every K/V row it reads, so a verify's
    138 rows (23 tokens x 6 heads) in two such tiles decode the cache twice, the second time for 10 rows and 118
    of padding in its MMAs; a 16-row tile (`_launch_defaults` of the tail) decodes it for them at a decode's
    cost (H200, 2026-12-05, 23 tokens, tail / no tail: 262K TQ3_0 rows 1032 / 1185 us, Q8_0 1430 / 1778; 16K TQ3_0
    102 / 99)."""
    rest = query_rows % block_m
    wide = block_m >= 4 * _TAIL_MAX_ROWS  # a small tile (a float32 model's 16 rows) has nothing to save
    if not (quantized and wide and query_rows > block_m and kv_end >= _TAIL_MIN_KV_ROWS and 0 < rest <= _TAIL_MAX_ROWS):
        return 0
    return rest


class _Tiles(NamedTuple):
    """One launch of `_tree_attention_kernel`: query rows [m_base, m_base + rows) of each KV head's group, in
    `launch`'s tiles, over `splits` of the K/V rows, with these operands, K / V decode kinds and field loads."""
    m_base: int
    rows: int
    launch: Launch
    splits: int
    operands: torch.dtype
    kinds: tuple[int, int]
    fields_ahead: bool


def _tiles(m_base: int, rows: int, launch: Launch, split_tiles: int, quantized: bool, tk: KVType, tv: KVType,
           operands: torch.dtype, interpreter: bool, tq3_pairs: bool | None, fields_ahead: bool | None,
           split: int | None, kv_end: int, kv_heads: int, sms: int) -> _Tiles:
    """The settings of a launch over `rows` query rows in `launch`'s tiles; its splits chosen as for
    `split_tiles` query tiles (or `split`)."""
    # a decode of few registers (2 warps, or its query rows the MMAs' N side): pairs, no fields ahead; a wide tile
    # over long rows: pairs with its fields ahead (H200, 2026-12-05, 23 tokens over 16K / 64K / 262K TQ3_0 rows
    # 102.1 -> 99.5, 296.0 -> 281.0, 1032.2 -> 977.4 us; over 1K rows 22.2 -> 23.2)
    small_decode = quantized and rows <= launch.block_m and (launch.warps <= 2 or launch.swap)
    pairs = "tq3_0" in (tk.name, tv.name) and (
        (small_decode or kv_end >= _PAIRS_MIN_KV_ROWS) and _tq3_pairs_by_default(tk, tv, operands, interpreter)
        if tq3_pairs is None else tq3_pairs)
    if pairs and operands != torch.float32:
        operands = torch.float16  # the pairs are float16: f16 holds them, and q and P more finely than bf16
    kinds = tuple(TQ3_PAIRS if pairs and t.name == "tq3_0" else KV_KINDS[t.name] for t in (tk, tv))
    splits = split or choose_splits(kv_end, kv_heads, split_tiles, sms, launch.block_n,
                                    programs_per_sm(quantized, split_tiles, launch.warps),
                                    min_chunks=2 if launch.swap else 4)
    return _Tiles(m_base, rows, launch, splits, operands, kinds,
                  not small_decode if fields_ahead is None else fields_ahead)


def _plan(rows: int, d: int, main: Launch, tail: bool | None, windowed: bool, quantized: bool, tk: KVType,
          tv: KVType, operands: torch.dtype, interpreter: bool, tq3_pairs: bool | None, fields_ahead: bool | None,
          split: int | None, kv_end: int, kv_heads: int, sms: int) -> list[_Tiles]:
    """The launches over a KV head group's `rows` query rows: `main`'s tiles, and the rows past its last whole tile
    in a tile of their own (`tail`; None: `_tail_rows`), `_launch_defaults` of their count. The main launch keeps
    the splits it would take with those rows as one more of its tiles."""
    tail_rows = (_tail_rows(rows, main.block_m, kv_end, quantized) if tail is None
                 else rows % main.block_m if tail and rows > main.block_m else 0)
    full_tiles = -(-(rows - tail_rows) // main.block_m)
    settings = (quantized, tk, tv, operands, interpreter, tq3_pairs, fields_ahead, split, kv_end, kv_heads, sms)
    tiles = [_tiles(0, rows - tail_rows, main, full_tiles + (tail_rows > 0), *settings)]
    if tail_rows:
        launch = _launch_defaults(tail_rows, d, quantized, windowed, exact=operands == torch.float32,
                                  tq3="tq3_0" in (tk.name, tv.name))
        tiles.append(_tiles(rows - tail_rows, tail_rows, launch, 1, *settings))
    return tiles


def tree_attention(q, k_cache, v_cache, kv_type_k, kv_type_v, start_t, visible, positions, kv_end, scale,
                   window=0, split=None, *, gate=None, q_norm=None, unrotate_values=False, block_rows=None,
                   block_m=None, num_warps=None, num_stages=None, operands=None, max_registers=None, tq3_pairs=None,
                   fields_ahead=None, swap=None, tail=None, out_dtype=None):
    """Attention of q [heads, T, D] (after RoPE) over cache rows [0, kv_end) of a graphed step; see the
    module docstring for the mask. -> [heads, T, D] in q.dtype; with `gate` [T, heads, D] (any strides, the
    last unit) `activations.gated_heads(result, gate)` instead, [T, heads * D], the gate applied at the store.
    With `q_norm` = (weight, eps, cos, sin), q is the raw projection (any strides, the last unit) and gets
    `qk_norm_rope(q, weight, eps, cos, sin)` at its load. With `unrotate_values` and TQ3_0 values the result
    is in the values' original domain (`unrotate` of the rotated one, before the gate): in the splits' combine
    launch, or in torch when one split runs. `split` forces the number of splits,
    `block_rows` (BLOCK_N, K/V rows per step), `block_m` (query rows per program), `num_warps` and
    `num_stages` (software pipelining of the row loop) and `max_registers` (a thread's register cap, for more
    programs an SM) override the launch defaults; `operands`
    (torch.bfloat16 / torch.float16) overrides the tensor-core operand type, q's by default (a bf16 model's float32
    q takes its model's type; and a sweep
    candidate: f16 operands over an f16 cache feed the K/V rows to the MMAs straight from shared memory,
    where bf16 ones convert them in registers and store them back first, 104 fewer instructions and two
    fewer barriers per chunk in the offline SASS; but the fused q norm's prologue then spills 960 bytes per
    thread instead of 336. f16 holds f16 rows exactly and probabilities more finely than bf16; a bf16
    query is clamped to f16's range, `_query_operand`). `tq3_pairs` decodes TQ3_0 rows as float16 pairs
    (`_tq3_pairs`; f16 operands on the GPU); by default in a decode of one or two warps or a swapped one, and in any
    tile over 16K rows or more (`_PAIRS_MIN_KV_ROWS`), on the GPU with 16-bit operands unless the other side is a bf16 or f32 float cache (`_tq3_pairs_by_default`; H200,
    2026-12-05: 1 token over 262K rows in 4-warp programs 438.4 -> 423.3 us, but 23 tokens 1158.5 -> 1237.4, a
    verify tile spilling more); True in the interpreter runs the pair decode there (its byte permutes emulated).
    `fields_ahead` loads TQ3_0 rows' fields a chunk ahead (`row_fields`; by default except in a decode of one or two
    warps or a swapped one, whose registers they overfill). `swap` takes the MMAs with their sides swapped
    (`_scores`: q held as [D, BLOCK_M]), by default in a decode of up to 16 query rows over TQ3_0 rows
    (`_launch_defaults`). `tail` gives the query rows past the last whole tile a launch of their own in a tile sized
    to them (by default over long quantized rows, `_tail_rows`). `out_dtype` (q's by default): the result's dtype (a
    query normed apart into the operands' dtype whose output stays in the activations'). A decode over TQ3_0 or Q8_0
    rows with none of the launch settings given runs `attention_decode` where it takes the call, a tree over them
    `attention_verify` (`_in_cuda`).
    Falls back to `tree_attention_reference` where the Triton path does not apply."""
    tk, tv = kv_type(kv_type_k), kv_type(kv_type_v)
    _check(q, k_cache, v_cache, tk, tv, start_t, visible, positions, kv_end)
    unrotating = unrotate_values and tv.rotated
    rot = q_norm[2].shape[-1] if q_norm is not None else 0
    if (not _triton_supports(q, tk, tv) or (gate is not None and gate.stride(-1) != 1)
            or (q_norm is not None and (rot % 2 or rot > q.shape[-1]))):
        if q_norm is not None:
            q = qk_norm_rope(q.transpose(0, 1), *q_norm).transpose(0, 1)
        # in out_dtype from the start (a bf16 query's float32 output is not rounded to bf16 on the way)
        out = tree_attention_reference(q.to(out_dtype or q.dtype), k_cache, v_cache, tk, tv, start_t, visible,
                                       positions, kv_end, scale, window)
        out = unrotate(out) if unrotating else out
        return out if gate is None else gated_heads(out, gate)
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise FlashtreeError("tree_attention needs unit stride along head_dim (q and both caches)")
    launch_chosen = any(a is not None for a in (split, block_rows, block_m, num_warps, num_stages, max_registers,
                                                 tq3_pairs, fields_ahead, swap, tail))
    if not launch_chosen and (operands or q.dtype) in (torch.bfloat16, torch.float16):  # not a float32 model's
        for kernel in (attention_decode, attention_verify):
            if kernel.takes(q, k_cache, v_cache, (tk.name, tv.name), window, q_norm is None, kv_end):
                return _in_cuda(kernel, q, k_cache, v_cache, tk.name, start_t, visible, kv_end, scale, gate,
                                unrotating, out_dtype or q.dtype)
    quantized = KV_KINDS[tk.name] > 0 or KV_KINDS[tv.name] > 0
    interpreter = interpreted()
    operands = operands or q.dtype  # a float32 q (a bf16 model's activations) may feed bf16 operands
    defaults = _launch_defaults(group * n, d, quantized, window > 0, exact=operands == torch.float32,
                                tq3="tq3_0" in (tk.name, tv.name))
    main = Launch(block_m or defaults.block_m, block_rows or defaults.block_n, num_warps or defaults.warps,
                  num_stages or defaults.stages, max_registers or defaults.max_registers,
                  defaults.swap if swap is None else swap)
    tiles = _plan(group * n, d, main, tail, window > 0, quantized, tk, tv, operands, interpreter, tq3_pairs,
                  fields_ahead, split, kv_end, kv_heads, _sm_count(q.device))

    out_dtype = out_dtype or q.dtype
    # a split launch stores the rotated rows unless its combine unrotates them: then torch unrotates them all
    in_combine = unrotating and all(t.splits > 1 for t in tiles)
    gated = gate is not None and (in_combine or not unrotating)
    out = torch.empty(*((n, heads * d) if gated else (heads, n, d)), dtype=out_dtype, device=q.device)
    gate_args = (gate, gate.stride(0), gate.stride(1)) if gated else (out, 0, 0)
    weight, eps, cos, sin = q_norm if q_norm is not None else (out, 0.0, out, out)  # unused without NORM_Q
    norm_args = (weight, cos.contiguous(), sin.contiguous(), float(eps))
    signs = rotation_signs(q.device) if in_combine else out  # unused unless UNROTATE
    rows = group * n
    visible_bytes = visible.contiguous().view(torch.uint8)
    for t in tiles:
        low_precision = t.operands in (torch.bfloat16, torch.float16) and not interpreter
        q_t = q
        if q.dtype == torch.float32 and low_precision and q_norm is None and t.launch.block_m >= 64:
            q_t = _query_in_operands(q, t.operands)
        if t.splits > 1:
            part = torch.empty(t.splits, kv_heads, t.rows, d, dtype=torch.float32, device=q.device)
            lse = torch.empty(t.splits, kv_heads, t.rows, dtype=torch.float32, device=q.device)
        else:
            part = lse = out  # unused
        block_n = t.launch.block_n
        _tree_attention_kernel[(kv_heads, triton.cdiv(t.rows, t.launch.block_m), t.splits)](
            q_t, k_cache, v_cache, start_t, visible_bytes, positions, out, part, lse, *gate_args, *norm_args,
            q_t.stride(0), q_t.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            n, kv_end, heads, float(scale) * _LOG2E, int(window), t.m_base, t.rows,
            G=group, D=d, KIND_K=t.kinds[0], KIND_V=t.kinds[1],
            OP=_TL_TYPES[t.operands] if low_precision else tl.float32,
            PRECISION=None if low_precision else "ieee",  # float32: exact FMA dots (bf16/f16: tensor cores)
            HAS_WINDOW=window > 0, BLOCK_M=t.launch.block_m, BLOCK_N=block_n, SPLITS=t.splits,
            FIXED_TRIPS=interpreter, TRIPS=triton.cdiv(triton.cdiv(kv_end, t.splits), block_n) if interpreter else 0,
            TAIL_TRIPS=triton.cdiv(n, block_n) + 1 if interpreter else 0,
            GATED=gated, NORM_Q=q_norm is not None, ROT=max(rot, 2), FIELDS_AHEAD=t.fields_ahead,
            SWAP=t.launch.swap, num_warps=t.launch.warps,
            **({} if t.launch.stages is None else {"num_stages": t.launch.stages}),
            **({} if t.launch.max_registers is None else {"maxnreg": t.launch.max_registers}))
        if t.splits > 1:
            _combine(part, lse, out, gate_args, signs, n, heads, kv_heads, rows, t.m_base, t.rows, t.splits, gated,
                     in_combine)
    if unrotating and not in_combine:
        out = unrotate(out)
        return out if gate is None else gated_heads(out, gate)
    return out


def _combine(part, lse, out, gate_args, signs, n, heads, kv_heads, group_rows, m_base, m_rows, splits, gated,
             unrotate) -> None:
    """`_combine_kernel` over query rows [m_base, m_base + m_rows) of each KV head's `group_rows`: `part` [splits,
    kv_heads, m_rows, D] and `lse` [splits, kv_heads, m_rows]."""
    d = part.shape[-1]
    _combine_kernel[(kv_heads * m_rows,)](part, lse, out, *gate_args, signs, n, heads, group_rows, m_base, m_rows,
                                          D=d, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
                                          GATED=gated, UNROTATE=unrotate, num_warps=4 if d >= 128 else 1)


def _in_cuda(kernel, q, k_cache, v_cache, kind, start_t, visible, kv_end, scale, gate, unrotating, out_dtype):
    """`kernel`'s split launch (`attention_decode`: one token, `attention_verify`: a tree, over rows of `kind`, TQ3_0 or
    Q8_0), then the combine (values rotated back where `unrotating`, the gate applied where given), as the Triton
    path's split launches end."""
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    part, lse = kernel.attend(q, k_cache, v_cache, kind, start_t, visible.contiguous().view(torch.uint8), kv_end,
                              float(scale) * _LOG2E, _tq3_f16_byte_tables(), _sm_count(q.device), _MAX_SPLITS)
    gated = gate is not None
    out = torch.empty(*((n, heads * d) if gated else (heads, n, d)), dtype=out_dtype, device=q.device)
    gate_args = (gate, gate.stride(0), gate.stride(1)) if gated else (out, 0, 0)
    signs = rotation_signs(q.device) if unrotating else out  # unused unless UNROTATE
    group_rows = heads // kv_heads * n
    _combine(part, lse, out, gate_args, signs, n, heads, kv_heads, group_rows, 0, group_rows, part.shape[0], gated,
             unrotating)
    return out
