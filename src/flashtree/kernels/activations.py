"""Two elementwise steps of a decoder layer as one launch each (PyTorch spends two to five kernels on
each; a 27B decode step runs them 64 and 16 times):

- `silu_mul`: the MLP's SiLU(gate) * up, rounded where PyTorch rounds (SiLU to the activation dtype, then
  the product); `interleaved_silu_mul` the same of a fused gate + up matmul's interleaved outputs (`GLU_GROUP`);
- `gated_heads`: attention's output, heads-major [H, T, D] as the attention kernels write it, to token-major
  [T, H*D] and multiplied by sigmoid(gate) (read in place from the interleaved [query ; gate] rows) (the gate rounded to the activation dtype first, as the model
  does), which is the transpose-copy and the four gate kernels in one.

Both compute in float32 and round to the activation dtype; they differ from the references in the last
bits of exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtree.kernels import triton_runs_on

try:  # the kernel needs triton; the reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

BLOCK = 1024  # values per program of silu_mul
# a fused gate + up projection's outputs in groups of GLU_GROUP gate values then the same GLU_GROUP up values (the
# tensor-core kernels' 16-row tile pairs rows g and g + 8: quant_matmul.GluWeight, mma.cu `store_glu`)
GLU_GROUP = 8


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [T, F] (rows may be strided, e.g. halves of one fused projection) -> [T, F] in their dtype."""
    if not _runs(gate, up) or gate.shape != up.shape or gate.dim() != 2:
        return silu_mul_reference(gate, up)
    t, f = gate.shape
    out = torch.empty(t, f, dtype=gate.dtype, device=gate.device)
    _silu_mul_kernel[(t, triton.cdiv(f, BLOCK))](gate, up, out, gate.stride(0), up.stride(0), f, BLOCK=BLOCK,
                                                 INTERLEAVED=False, num_warps=4)
    return out


def glu_halves(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up values [..., F] of interleaved rows y [..., 2F] (`GLU_GROUP` of each in turn), as copies."""
    groups = y.reshape(*y.shape[:-1], y.shape[-1] // (2 * GLU_GROUP), 2, GLU_GROUP)
    return tuple(groups.select(-2, side).reshape(*y.shape[:-1], y.shape[-1] // 2) for side in (0, 1))


def interleaved_silu_mul(y: torch.Tensor) -> torch.Tensor:
    """`silu_mul` of the gate and up values interleaved in y [T, 2F] (`glu_halves`) -> [T, F] in y's dtype: the
    fused gate + up matmuls that do not apply it themselves (dense prefill chunks, small matrices, the CPU)."""
    if not _runs(y) or y.dim() != 2 or y.shape[-1] % (2 * GLU_GROUP):
        return silu_mul_reference(*glu_halves(y))
    t, f = y.shape[0], y.shape[1] // 2
    out = torch.empty(t, f, dtype=y.dtype, device=y.device)
    _silu_mul_kernel[(t, triton.cdiv(f, BLOCK))](y, y, out, y.stride(0), y.stride(0), f, BLOCK=BLOCK,
                                                 INTERLEAVED=True, GROUP=GLU_GROUP, num_warps=4)
    return out


def gated_heads_reference(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out [H, T, D], gate [T, H, D] (any strides, any float dtype) -> [T, H*D] in out's dtype."""
    heads, t, dim = out.shape
    return (out.transpose(0, 1).reshape(t, heads * dim)
            * torch.sigmoid(gate.float()).reshape(t, heads * dim).to(out.dtype))


def gated_heads(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    heads, t, dim = out.shape
    if not _runs(out, gate) or dim & (dim - 1) or gate.shape != (t, heads, dim):
        return gated_heads_reference(out, gate)
    result = torch.empty(t, heads * dim, dtype=out.dtype, device=out.device)
    _gated_heads_kernel[(t, heads)](out, gate, result, out.stride(0), out.stride(1), gate.stride(0), gate.stride(1),
                                    D=dim, num_warps=1 if dim <= 128 else 2)
    return result


def _runs(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (triton is not None and triton_runs_on(first.device) and first.numel() > 0
            and all(x.stride(-1) == 1 for x in tensors))


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, gate_stride, up_stride, F, BLOCK: tl.constexpr,
                         INTERLEAVED: tl.constexpr, GROUP: tl.constexpr = 8):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        if INTERLEAVED:  # one row of GROUP gate values, then their GROUP up values, in turn
            at = cols // GROUP * (2 * GROUP) + cols % GROUP
            g = tl.load(gate_ptr + row * gate_stride + at, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(up_ptr + row * up_stride + at + GROUP, mask=mask, other=0.0).to(tl.float32)
        else:
            g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * F + cols, (silu * u).to(dtype), mask=mask)

    @triton.jit
    def _gated_heads_kernel(out_ptr, gate_ptr, result_ptr, head_stride, token_stride, gate_token_stride,
                            gate_head_stride, D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, D)
        o = tl.load(out_ptr + head * head_stride + token * token_stride + offs).to(tl.float32)
        g = tl.load(gate_ptr + token * gate_token_stride + head * gate_head_stride + offs).to(tl.float32)
        dtype = result_ptr.dtype.element_ty
        gate = tl.sigmoid(g).to(dtype).to(tl.float32)
        tl.store(result_ptr + (token * tl.num_programs(1) + head) * D + offs, (o * gate).to(dtype))
