"""KV cache rows dequantized to the compute dtype in one pass (Triton), for the prefill of a quantized cache.

`dequantize_kv(rows, kv_type, dtype)` -> [heads, n, head_dim] in `dtype`, the same values as
`kv_type.dequantize(rows, dtype)` (the torch reference): each block is decoded in float32 by the same
`load_rows` the tree-attention kernel reads the cache with (a thread per 32-value block), then rounded
once to `dtype`. The reference
builds int64 indices and float32 copies of every value (about 6 GB at 256K rows of one TQ3_0 layer);
this writes only the output. Float caches, head dims the decoder cannot tile and CPU tensors without the
interpreter take the reference.
"""

from __future__ import annotations

import torch

from flashtree.kernels import triton_runs_on
from flashtree.kernels.kv_quant import FloatKV, KVType, kv_type
from flashtree.kernels.tree_attention import supported_head_dim

try:
    import triton
    import triton.language as tl

    from flashtree.kernels.tree_attention import KV_KINDS, load_rows
except ImportError:  # pragma: no cover - the torch reference serves
    triton = None

_ROWS_PER_PROGRAM = 32
_OPERAND = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

if triton is not None:

    @triton.jit
    def _dequantize_kernel(src_ptr, out_ptr, n_rows, stride_h, stride_r, D: tl.constexpr, KIND: tl.constexpr,
                           OP: tl.constexpr, BLOCK_N: tl.constexpr):
        head = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < n_rows
        x = load_rows(src_ptr + head * stride_h, rows, ok, stride_r, D, KIND, OP)
        offs = (head * n_rows + rows.to(tl.int64))[:, None] * D + tl.arange(0, D)[None, :]
        tl.store(out_ptr + offs, x, mask=ok[:, None])


def dequantize_kv(rows: torch.Tensor, kind: KVType | str, dtype: torch.dtype) -> torch.Tensor:
    """Storage rows [heads, n, row_bytes] (any row/head strides, unit stride within a row) -> values
    [heads, n, head_dim] in `dtype` (rotated domain for TQ3_0, as `KVType.dequantize`)."""
    t = kv_type(kind)
    if isinstance(t, FloatKV) or not _kernel_applies(rows, t, dtype):
        return t.dequantize(rows, dtype)
    heads, n, _ = rows.shape
    d = rows.shape[-1] // t.row_bytes(32) * 32
    out = torch.empty(heads, n, d, dtype=dtype, device=rows.device)
    if n:
        _dequantize_kernel[(heads, triton.cdiv(n, _ROWS_PER_PROGRAM))](
            rows, out, n, rows.stride(0), rows.stride(1), D=d, KIND=KV_KINDS[t.name],
            OP=getattr(tl, _OPERAND[dtype]), BLOCK_N=_ROWS_PER_PROGRAM)
    return out


def _kernel_applies(rows: torch.Tensor, t: KVType, dtype: torch.dtype) -> bool:
    if triton is None or not triton_runs_on(rows.device) or t.name not in KV_KINDS or dtype not in _OPERAND:
        return False
    if rows.dim() != 3 or rows.dtype != torch.uint8 or rows.stride(-1) != 1 or rows.shape[-1] % t.row_bytes(32):
        return False
    return supported_head_dim(rows.shape[-1] // t.row_bytes(32) * 32, t)
