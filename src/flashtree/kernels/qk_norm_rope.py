"""Attention's per-head query/key preparation in one launch: RMSNorm over each head (float32, rounded to
the activation dtype as the model does), then NeoX (rotate-half) RoPE on the first `rot_dim` dims, the
rest passing through. For keys going into a float cache the same launch writes them, and the values,
straight into the cache rows (`norm_rope_into_cache`). PyTorch spends about a dozen kernels per tensor on this (casts, norm, slices, two
concatenations, negation, products); the Triton kernel is one program per (token, head) and reads the
query straight out of the interleaved [query ; gate] projection rows.
"""

from __future__ import annotations

import functools

import torch

from flashtree.kernels import triton_runs_on
from flashtree.kernels.kv_quant import TQ3_GROUP, rotate, rotation_signs
from flashtree.kernels.rms_norm import rms_norm_reference

try:  # the kernel needs triton; the reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None


def rope_tables_reference(positions: torch.Tensor, rot_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rot_dim] for NeoX (rotate-half) pairing, computed in float32."""
    freqs = positions.float()[:, None] * _inv_freq(rot_dim, theta, positions.device)[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def rope_tables(positions: torch.Tensor, rot_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables_reference` in one launch where Triton runs (PyTorch spends about eight kernels on it, once
    per step), else the reference."""
    t = positions.shape[0]
    if triton is None or not triton_runs_on(positions.device) or t == 0 or rot_dim % 2:
        return rope_tables_reference(positions, rot_dim, theta)
    cos = torch.empty(t, rot_dim, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    half = rot_dim // 2
    _rope_tables_kernel[(t,)](positions, _inv_freq(rot_dim, theta, positions.device), cos, sin, HALF=half,
                              BLOCK=triton.next_power_of_2(half), num_warps=1)
    return cos, sin


@functools.cache
def _inv_freq(rot_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """theta^(-2i / rot_dim), float32 [rot_dim / 2]: made once per device (a CUDA graph reads the same buffer)."""
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, device=device, dtype=torch.float32) / rot_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head of x [T, H, D]; the rest pass through."""
    rot = cos.shape[-1]
    xr, rest = x[..., :rot].float(), x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (rows may be strided), weight [D], cos/sin float32 [T, rot_dim] -> [T, H, D] in x's dtype."""
    return apply_rope(rms_norm_reference(x, weight, eps), cos, sin)


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, rotated: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`qk_norm_rope_reference` in one launch where Triton runs (power-of-two head size, even rot_dim); with
    `rotated` (a query for TQ3_0 keys) also `kv_quant.rotate`d, in the same launch. `out_dtype` (x's by default):
    the result rounded once more to it at the store (a float32 query as the bf16 operand attention reads)."""
    t, heads, dim = x.shape
    rot = cos.shape[-1]
    out_dtype = out_dtype or x.dtype
    if (triton is None or not triton_runs_on(x.device) or t == 0 or x.stride(-1) != 1 or dim & (dim - 1)
            or rot % 2 or rot > dim or (rotated and dim % TQ3_GROUP)):
        out = qk_norm_rope_reference(x, weight, eps, cos, sin)
        return (rotate(out) if rotated else out).to(out_dtype)
    out = torch.empty(t, heads, dim, dtype=out_dtype, device=x.device)
    signs = rotation_signs(x.device) if rotated else out  # unused unless ROTATE
    _qk_norm_rope_kernel[(t, heads)](x, weight, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1),
                                     eps, x, out, out, 0, 0, 0, 0, 0, 0, signs, D=dim, ROT=rot, INTO_CACHE=False,
                                     ROTATE=rotated, num_warps=1 if dim <= 128 else 2)
    return out


def norm_rope_into_cache(k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """An attention layer's K/V write for float caches: k [T, Hkv, D] through `qk_norm_rope` and v [T, Hkv, D]
    as it is, cast to the caches' dtypes, into rows `slots` [T] of k_cache and v_cache [Hkv, capacity, D].
    One launch where Triton runs (each program also copies its V row), else the reference: the norm, then
    `index_copy_` of both."""
    t, heads, dim = k.shape
    rot = cos.shape[-1]
    if (triton is None or not triton_runs_on(k.device) or t == 0 or k.stride(-1) != 1 or v.stride(-1) != 1
            or dim & (dim - 1) or rot % 2 or rot > dim or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1
            or v.shape != k.shape):
        k_cache.index_copy_(1, slots, qk_norm_rope(k, weight, eps, cos, sin).transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))
        return
    _qk_norm_rope_kernel[(t, heads)](k, weight, cos.contiguous(), sin.contiguous(), k_cache, k.stride(0), k.stride(1),
                                     eps, v, v_cache, slots, v.stride(0), v.stride(1), k_cache.stride(0),
                                     k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), k, D=dim, ROT=rot,
                                     INTO_CACHE=True, ROTATE=False, num_warps=1 if dim <= 128 else 2)


if triton is not None:
    from flashtree.kernels.hadamard import rotate_row  # (defined where triton is)

    @triton.jit
    def _rope_tables_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        ok = i < HALF
        angle = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_ptr + i, mask=ok, other=0.0)
        c, s = tl.cos(angle), tl.sin(angle)
        row = token * 2 * HALF
        tl.store(cos_ptr + row + i, c, mask=ok)  # both halves: the NeoX pairing repeats the frequencies
        tl.store(cos_ptr + row + HALF + i, c, mask=ok)
        tl.store(sin_ptr + row + i, s, mask=ok)
        tl.store(sin_ptr + row + HALF + i, s, mask=ok)

    @triton.jit
    def _normed(x_ptr, w_ptr, offs, mask, inv):
        """Normalized, weighted values at `offs`, rounded to the activation dtype like the reference's norm."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return (x * inv * w).to(x_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, token_stride, head_stride, eps,
                             v_ptr, v_out_ptr, slots_ptr, v_token_stride, v_head_stride, out_head_stride,
                             out_row_stride, v_out_head_stride, v_out_row_stride, signs_ptr,
                             D: tl.constexpr, ROT: tl.constexpr, INTO_CACHE: tl.constexpr, ROTATE: tl.constexpr):
        """INTO_CACHE: `out` is the K cache (row slots[token] of head `head`), and V's row goes to its cache
        too; otherwise `out` is a contiguous [T, H, D] (the v and cache arguments unused)."""
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        row = x_ptr + token * token_stride + head * head_stride
        offs = tl.arange(0, D)
        x = tl.load(row + offs).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        y = _normed(row, w_ptr, offs, offs < D, inv)
        rotating = offs < ROT
        first_half = offs < ROT // 2
        partner = _normed(row, w_ptr, tl.where(first_half, offs + ROT // 2, offs - ROT // 2), rotating, inv)
        cos = tl.load(cos_ptr + token * ROT + offs, mask=rotating, other=1.0)
        sin = tl.load(sin_ptr + token * ROT + offs, mask=rotating, other=0.0)
        rotated = y * cos + tl.where(first_half, -partner, partner) * sin
        out = tl.where(rotating, rotated, y)
        if INTO_CACHE:
            slot = tl.load(slots_ptr + token).to(tl.int64)
            tl.store(out_ptr + head * out_head_stride + slot * out_row_stride + offs,
                     out.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty))  # the norm's dtype, then the cache's
            value = tl.load(v_ptr + token * v_token_stride + head * v_head_stride + offs)
            tl.store(v_out_ptr + head * v_out_head_stride + slot * v_out_row_stride + offs,
                     value.to(v_out_ptr.dtype.element_ty))
        else:
            if ROTATE:  # in float32 from the normed row rounded to the dtype, as `rotate` of the reference's result
                out = rotate_row(out.to(x_ptr.dtype.element_ty).to(tl.float32), signs_ptr, D, False)
            tl.store(out_ptr + (token * tl.num_programs(1) + head) * D + offs, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def norm_rope_tile(rows, w_ptr, cos_ptr, sin_ptr, tok, d, ok, eps, D: tl.constexpr, ROT: tl.constexpr):
        """`qk_norm_rope` of a [rows, D] tile inside another kernel (rows: one pointer a row, tok: its token):
        RMSNorm over each row in float32, rounded to the input dtype as the model does, then NeoX RoPE on the
        first ROT dims (cos/sin rows of the tokens), rounded again."""
        dtype = rows.dtype.element_ty
        x = tl.load(rows + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        y = (x * inv[:, None] * tl.load(w_ptr + d).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        rotating = d < ROT
        first_half = d < ROT // 2
        partner_d = tl.where(first_half, d + ROT // 2, tl.where(rotating, d - ROT // 2, d))
        xp = tl.load(rows + partner_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        partner = (xp * inv[:, None] * tl.load(w_ptr + partner_d).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        table = tok.to(tl.int64)[:, None] * ROT + d[None, :]
        cos = tl.load(cos_ptr + table, mask=ok[:, None] & rotating[None, :], other=1.0)
        sin = tl.load(sin_ptr + table, mask=ok[:, None] & rotating[None, :], other=0.0)
        rotated = y * cos + tl.where(first_half[None, :], -partner, partner) * sin
        return tl.where(rotating[None, :], rotated, y).to(dtype)
