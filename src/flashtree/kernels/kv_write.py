"""New K/V rows quantized straight into Q8_0 / Q4_0 / TQ3_0 caches: one launch for a layer's K and V.

`write_rows(x, cache, slots, kv_type)` does what `cache.index_copy_(1, slots, kv_type.quantize(x.transpose(0, 1)))`
does, for x [T, kv_heads, D] float rows and slots [T] (int64, on the device). `write_kv` writes a layer's
keys and values in one launch, the keys' `qk_norm_rope` included. In torch a quantized write is 15-30 small
kernels per cache (TQ3_0: norm, rotation, bucketing, centroid norm, bit packing, byte concat) and runs in
every attention layer of every decode and verify step. Here one program quantizes one (token, head) row
with the same float32 arithmetic as `kv_quant` (IEEE divisions `div_rn`: Triton's `/` and `fdiv` are
approximate on the GPU, round half away, the first largest magnitude for Q4_0), so Q8_0 and Q4_0 rows are
byte-identical to the torch form on the CPU (on CUDA, torch divides by a Python scalar as a multiply by its
reciprocal, so there its Q8_0 scale amax / 127 can differ by one bit from llama.cpp's and this kernel's
division). TQ3_0 rotates by a Walsh-Hadamard transform (`hadamard`) where torch multiplies by the matrix,
and sums its norms in another order than torch's reductions: a value within float32 rounding of a level
threshold (or of zero, for its sign) can take the neighbouring code, and the stored fp16 norm can differ by
one unit in the last place. Float caches (and subclasses of the types, which may store something else),
head dims the kernel cannot tile, and tensors where Triton does not run take the torch form. The launch
depends only on shapes, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import triton_runs_on
from flashtree.kernels.kv_quant import KV_TYPES, TQ3_THRESHOLDS, KVType, kv_type, rotation_signs
from flashtree.kernels.qk_norm_rope import qk_norm_rope
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
    _check("write_rows", x, cache, slots)
    if not _kernel_applies(x, cache, t):
        cache.index_copy_(1, slots, t.quantize(x.transpose(0, 1)))
        return
    _launch(x, x, cache, cache, slots, t, t, None, planes=1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             type_k: KVType | str, type_v: KVType | str, k_norm: tuple | None = None) -> None:
    """`write_rows` of the keys and of the values, in one launch where the kernel applies to both caches. With
    `k_norm` = (weight, eps, cos, sin) the keys are the raw projection (any strides, the last unit) and are
    written as `qk_norm_rope(k, *k_norm)` (RMSNorm and RoPE in the same launch)."""
    tk, tv = kv_type(type_k), kv_type(type_v)
    _check("write_kv", k, k_cache, slots)
    _check("write_kv", v, v_cache, slots)
    rot = k_norm[2].shape[-1] if k_norm is not None else 2
    if not (_kernel_applies(k, k_cache, tk) and _kernel_applies(v, v_cache, tv) and rot % 2 == 0
            and rot <= k.shape[-1]):
        write_rows(qk_norm_rope(k, *k_norm) if k_norm is not None else k, k_cache, slots, tk)
        write_rows(v, v_cache, slots, tv)
        return
    _launch(k, v, k_cache, v_cache, slots, tk, tv, k_norm, planes=2)


def _check(name: str, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    if x.dim() != 3 or slots.shape != (x.shape[0],) or cache.dim() != 3 or cache.shape[0] != x.shape[1]:
        raise FlashtreeError(f"{name} takes rows [T, kv_heads, D], slots [T] and a [kv_heads, capacity, row] "
                             f"cache; got {tuple(x.shape)}, {tuple(slots.shape)}, {tuple(cache.shape)}")


def _kernel_applies(x: torch.Tensor, cache: torch.Tensor, t: KVType) -> bool:
    builtin = t.name in _KINDS and type(t) is type(KV_TYPES[t.name])  # a subclass may store something else
    return (triton is not None and builtin and supported_head_dim(x.shape[-1], t) and triton_runs_on(x.device)
            and x.stride(-1) == 1 and cache.is_contiguous() and cache.dtype == torch.uint8)


def _launch(k, v, k_cache, v_cache, slots, tk: KVType, tv: KVType, k_norm, planes: int) -> None:
    """Grid (T, kv_heads, planes): plane 0 writes k into k_cache, plane 1 v into v_cache."""
    n, heads, d = k.shape
    weight, eps, cos, sin = k_norm if k_norm is not None else (k, 0.0, k, k)  # unused without NORM_K
    signs = rotation_signs(k.device) if "tq3_0" in (tk.name, tv.name) else k  # unused unless TQ3_0
    _write_kernel[(n, heads, planes)](
        k, v, k_cache, v_cache, slots, signs, weight, cos.contiguous(), sin.contiguous(), float(eps),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), D=d, KIND_K=_KINDS[tk.name], KIND_V=_KINDS[tv.name],
        NORM_K=k_norm is not None, ROT=cos.shape[-1] if k_norm is not None else 2,
        num_warps=4, enable_fp_fusion=False)  # torch rounds x * inv before adding 8.5


if triton is not None:
    from flashtree.kernels.hadamard import rotate_groups  # (defined where triton is)
    from flashtree.kernels.qk_norm_rope import norm_rope_tile
    from flashtree.kernels.tree_attention import TQ3_C0, TQ3_C1, TQ3_C2, TQ3_C3

    T0, T1, T2 = (tl.constexpr(t) for t in TQ3_THRESHOLDS)

    @triton.jit
    def _write_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_ptr, signs_ptr, w_ptr, cos_ptr, sin_ptr, eps,
                      stride_kt, stride_kh, stride_vt, stride_vh, stride_kch, stride_kcr, stride_vch, stride_vcr,
                      D: tl.constexpr, KIND_K: tl.constexpr, KIND_V: tl.constexpr, NORM_K: tl.constexpr,
                      ROT: tl.constexpr):
        tok = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        d = tl.arange(0, D)
        if tl.program_id(2) == 0:
            src = k_ptr + tok.to(tl.int64) * stride_kt + head * stride_kh
            if NORM_K:  # as a one-row tile of the attention kernel's fused q norm
                one = tl.zeros((1,), tl.int32)
                x = tl.reshape(norm_rope_tile(src + one, w_ptr, cos_ptr, sin_ptr, tok + one, d, one == 0, eps, D,
                                              ROT), (D,))
            else:
                x = tl.load(src + d)
            _write_row(x.to(tl.float32), k_cache + head * stride_kch + slot * stride_kcr, signs_ptr, D, KIND_K)
        else:
            x = tl.load(v_ptr + tok.to(tl.int64) * stride_vt + head * stride_vh + d)
            _write_row(x.to(tl.float32), v_cache + head * stride_vch + slot * stride_vcr, signs_ptr, D, KIND_V)

    @triton.jit
    def _write_row(x, row, signs_ptr, D: tl.constexpr, KIND: tl.constexpr):
        """One row x [D] (float32) quantized into its cache row's bytes at `row`."""
        if KIND == 3:
            _tq3_row(x, row, signs_ptr, D // 128)
        else:
            NB: tl.constexpr = D // 32
            blocks = tl.reshape(x, (NB, 32))
            j = tl.arange(0, 32)
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
    def _tq3_row(x, dst, signs_ptr, G: tl.constexpr):
        """A row's G 128-value TQ3_0 groups (`TQ3_0.codes`, then `quantize`'s packing) into its 4 G blocks at
        dst: each group's unit vector u rotated, r = R u, then bucketed by |r| and packed with r's signs."""
        NB: tl.constexpr = 4 * G
        g = tl.reshape(x, (G, 128))
        n = tl.sqrt_rn(tl.sum(g * g, axis=1))  # [G]
        u = tl.where(n[:, None] > 1e-30, tl.div_rn(g, tl.maximum(n, 1e-30)[:, None]), 0.0)
        r = tl.reshape(rotate_groups(u, signs_ptr, G, False), (NB, 32))  # one row a block
        a = tl.abs(r)
        level = (a > T0).to(tl.int32) + (a > T1).to(tl.int32) + (a > T2).to(tl.int32)
        c = tl.where(level < 2, tl.where(level == 0, TQ3_C0, TQ3_C1), tl.where(level == 2, TQ3_C2, TQ3_C3))
        centroid_sq = tl.sum(tl.reshape(c * c, (G, 128)), axis=1)  # [G]
        negative = (r < 0).to(tl.int32)
        qs = tl.sum(tl.reshape(level, (NB, 8, 4)) << (2 * tl.arange(0, 4))[None, None, :], axis=2)  # byte k: 4k..
        signs = tl.sum(tl.reshape(negative, (NB, 4, 8)) << tl.arange(0, 8)[None, None, :], axis=2)  # byte k: 8k..
        block = dst + tl.arange(0, NB) * 14
        tl.store(block[:, None] + 2 + tl.arange(0, 8)[None, :], qs.to(tl.uint8))
        tl.store(block[:, None] + 10 + tl.arange(0, 4)[None, :], signs.to(tl.uint8))
        stored = tl.div_rn(n, tl.sqrt_rn(centroid_sq))  # [G]
        _store_half(block, tl.reshape(tl.broadcast_to(stored[:, None], (G, 4)), (NB,)))
