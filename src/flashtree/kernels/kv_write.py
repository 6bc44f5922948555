"""New K/V rows quantized straight into a Q8_0 / Q4_0 / TQ3_0 cache, one launch per cache.

`write_rows(x, cache, slots, kv_type)` does what `cache.index_copy_(1, slots, kv_type.quantize(x.transpose(0, 1)))`
does, for x [T, kv_heads, D] float rows and slots [T] (int64, on the device). In torch a quantized write is
15-30 small kernels per cache (TQ3_0: norm, rotation, bucketing, centroid norm, bit packing, byte concat) and
runs in every attention layer of every decode and verify step. Here one program quantizes one (token, head)
row with the same float32 arithmetic as `kv_quant` (IEEE divisions `div_rn`: Triton's `/` and `fdiv` are
approximate on the GPU, round half away, the first largest
magnitude for Q4_0), so Q8_0 and Q4_0 rows are byte-identical to the torch form on the CPU (on CUDA, torch
divides by a Python scalar as a multiply by its reciprocal, so there its Q8_0 scale amax / 127 can differ by
one bit from llama.cpp's and this kernel's division). TQ3_0 sums its norms and the rotation's dot products
in another order than torch's reductions: a value within float32 rounding of a level threshold (or of zero,
for its sign) can take the neighbouring code, and the stored fp16 norm can differ by one unit in the last
place. Float caches (and subclasses of the types, which may store something else), head dims the kernel
cannot tile, and tensors where Triton does not run take the torch form. The launch depends only on shapes,
so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import triton_runs_on
from flashtree.kernels.kv_quant import KV_TYPES, TQ3_THRESHOLDS, KVType, kv_type, rotation_matrix
from flashtree.kernels.tree_attention import supported_head_dim

try:  # the kernel needs triton; the torch form does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

_KINDS = {"q8_0": 1, "q4_0": 2, "tq3_0": 3}  # the kernel's KIND per cache type


def write_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, kv_type_: KVType | str) -> None:
    """cache[:, slots[t]] = kv_type_.quantize(x[t]) for every token t (x [T, kv_heads, D]). The slots must be
    rows of the cache: the kernel does not check them (a graphed step cannot read them back), torch's form does."""
    t = kv_type(kv_type_)
    if x.dim() != 3 or slots.shape != (x.shape[0],) or cache.shape[0] != x.shape[1]:
        raise FlashtreeError(f"write_rows takes x [T, kv_heads, D], slots [T] and a [kv_heads, capacity, row] cache; "
                             f"got {tuple(x.shape)}, {tuple(slots.shape)}, {tuple(cache.shape)}")
    if not _kernel_applies(x, cache, t):
        cache.index_copy_(1, slots, t.quantize(x.transpose(0, 1)))
        return
    n, heads, d = x.shape
    kind = _KINDS[t.name]
    rotation = rotation_matrix(x.device) if kind == 3 else x  # unused unless TQ3_0
    _write_rows_kernel[(n, heads)](
        x, cache, slots, rotation, x.stride(0), x.stride(1), cache.stride(0), cache.stride(1),
        D=d, KIND=kind, num_warps=4, enable_fp_fusion=False)  # torch rounds x * inv before adding 8.5


def _kernel_applies(x: torch.Tensor, cache: torch.Tensor, t: KVType) -> bool:
    builtin = t.name in _KINDS and type(t) is type(KV_TYPES[t.name])  # a subclass may store something else
    return (triton is not None and builtin and supported_head_dim(x.shape[-1], t) and triton_runs_on(x.device)
            and x.stride(-1) == 1 and cache.is_contiguous() and cache.dtype == torch.uint8)


if triton is not None:
    from flashtree.kernels.tree_attention import TQ3_C0, TQ3_C1, TQ3_C2, TQ3_C3  # (defined where triton is)

    T0, T1, T2 = (tl.constexpr(t) for t in TQ3_THRESHOLDS)

    @triton.jit
    def _write_rows_kernel(x_ptr, cache_ptr, slot_ptr, rot_ptr, stride_xt, stride_xh, stride_ch, stride_cr,
                           D: tl.constexpr, KIND: tl.constexpr):
        tok = tl.program_id(0)
        head = tl.program_id(1)
        src = x_ptr + tok.to(tl.int64) * stride_xt + head.to(tl.int64) * stride_xh
        row = cache_ptr + head.to(tl.int64) * stride_ch + tl.load(slot_ptr + tok).to(tl.int64) * stride_cr
        if KIND == 3:
            for g in tl.static_range(D // 128):
                _tq3_group(src + g * 128, row + g * 4 * 14, rot_ptr)
        else:
            NB: tl.constexpr = D // 32
            j = tl.arange(0, 32)
            blocks = tl.load(src + tl.arange(0, NB)[:, None] * 32 + j[None, :]).to(tl.float32)  # [NB, 32]
            block_bytes: tl.constexpr = 34 if KIND == 1 else 18
            base = row + tl.arange(0, NB) * block_bytes  # [NB]
            if KIND == 1:
                d = tl.div_rn(tl.max(tl.abs(blocks), axis=1), 127.0)
                inv = tl.where(d > 0, tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d), 0.0)
                v = blocks * inv[:, None]
                q = tl.minimum(tl.maximum(_round_away(v), -127.0), 127.0).to(tl.int8)
                tl.store(base[:, None] + 2 + j[None, :], q.to(tl.uint8, bitcast=True))
            else:
                big = tl.argmax(tl.abs(blocks), axis=1, tie_break_left=True)
                # the block's value of largest magnitude, sign included (a max keeps -0.0, a sum would not)
                pick = tl.max(tl.where(j[None, :] == big[:, None], blocks, float("-inf")), axis=1)
                d = tl.div_rn(pick, -8.0)
                inv = tl.where(d != 0, tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d), 0.0)
                q = tl.minimum(tl.maximum(tl.floor(blocks * inv[:, None] + 8.5), 0.0), 15.0).to(tl.int32)
                lo_hi = tl.reshape(q, (NB, 2, 16))  # values j and j + 16 share byte j
                low, high = tl.split(tl.permute(lo_hi, (0, 2, 1)))
                k = tl.arange(0, 16)
                tl.store(base[:, None] + 2 + k[None, :], (low | (high << 4)).to(tl.uint8))
            _store_half(base, d)

    @triton.jit
    def _round_away(x):
        """`kv_quant._round_away`: sign(x) * floor(|x| + 0.5)."""
        r = tl.floor(tl.abs(x) + 0.5)
        return tl.where(x < 0, -r, r)

    @triton.jit
    def _store_half(ptrs, value):
        """value (float32) as fp16 at the 2-byte aligned byte pointers ptrs."""
        tl.store(ptrs.to(tl.pointer_type(tl.float16)), value.to(tl.float16))

    @triton.jit
    def _tq3_group(src, dst, rot_ptr):
        """One 128-value TQ3_0 group (`TQ3_0.codes`, then `quantize`'s packing) into its 4 blocks at dst: each
        block's 32 rotated values r = R u are one [32, 128] product with the unit vector u."""
        i = tl.arange(0, 128)
        g = tl.load(src + i).to(tl.float32)
        n = tl.sqrt_rn(tl.sum(g * g, axis=0))
        u = tl.where(n > 1e-30, tl.div_rn(g, tl.maximum(n, 1e-30)), 0.0)
        j = tl.arange(0, 32)
        centroid_sq = 0.0
        for b in tl.static_range(4):
            r = tl.sum(tl.load(rot_ptr + (b * 32 + j)[:, None] * 128 + i[None, :]) * u[None, :], axis=1)  # [32]
            a = tl.abs(r)
            level = (a > T0).to(tl.int32) + (a > T1).to(tl.int32) + (a > T2).to(tl.int32)
            c = tl.where(level < 2, tl.where(level == 0, TQ3_C0, TQ3_C1), tl.where(level == 2, TQ3_C2, TQ3_C3))
            centroid_sq += tl.sum(c * c, axis=0)
            negative = (r < 0).to(tl.int32)
            qs = tl.sum(tl.reshape(level, (8, 4)) << (2 * tl.arange(0, 4))[None, :], axis=1)  # byte k: values 4k..
            signs = tl.sum(tl.reshape(negative, (4, 8)) << tl.arange(0, 8)[None, :], axis=1)  # byte k: 8k..
            block = dst + b * 14
            tl.store(block + 2 + tl.arange(0, 8), qs.to(tl.uint8))
            tl.store(block + 10 + tl.arange(0, 4), signs.to(tl.uint8))
        stored = tl.div_rn(n, tl.sqrt_rn(centroid_sq))
        _store_half(dst + tl.arange(0, 4) * 14, tl.full((4,), 1.0, tl.float32) * stored)
