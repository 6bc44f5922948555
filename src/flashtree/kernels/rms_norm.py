"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w over the last dimension, in float32, y in x's dtype
(the target's GGUF norm weights already hold the final multiplier: the converter folded HF's 1 + w in).

PyTorch spends about seven kernels on it (cast, square, mean, add, rsqrt, two products, cast back) and
a 27B decode step calls it ~300 times (the block norms, the per-head q/k norms of attention and the
DeltaNet output norm, fused here with its SiLU gate): ~2000 tiny launches per step, several
milliseconds even inside a CUDA graph.
The Triton kernel is one launch, one program per row. `rms_norm` runs it where Triton runs (CUDA, or
the CPU interpreter) and the torch reference elsewhere; both sum the squares in float32, so they
differ only in summation order (within float32 rounding).

`add_rms_norm` of a few float32 rows on a Hopper GPU (decode, verify: the residual stream of a bf16 model is
float32, docs/FIDELITY.md) runs `add_rms_norm.cu` instead: a row per cluster of 8 CTAs, so that a row's 100 KB of
loads and stores at the 27B shape go through 8 SMs rather than one (the Triton launch took 2.8 us there). Asked
(`x_f16`), it also writes the normed rows as the float16 x of the quantized matmul that reads them next
(quant_matmul/mma.py `prepare_x`), which that matmul then takes instead of converting them in a launch of its own.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

from flashtree.kernels import triton_runs_on
from flashtree.kernels.cuda_functions import functions, launch, nvrtc_loads, with_cluster_helpers
from flashtree.kernels.quant_matmul import mma

try:  # the kernel needs triton; the reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def gated_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor,
                             out_dtype: torch.dtype) -> torch.Tensor:
    """The Gated DeltaNet's output norm: rms_norm(x) * SiLU(gate) in float32, then `out_dtype`."""
    return (rms_norm_reference(x, weight, eps) * F.silu(gate.float())).to(out_dtype)


def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the next norm: (h + delta, rms_norm(h + delta)), the sum in h's dtype."""
    total = h + delta
    return total, rms_norm_reference(total, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 x_f16: QType | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` in one launch where Triton runs (h, delta [T, D] contiguous, same dtype). `x_f16`
    (Q4_K, Q6_K): where the cluster kernel runs, the launch also writes the normed rows as that type's float16 x
    (`mma.prepare_x`'s outputs, bit for bit), for the matmul that reads them (FLASHTREE_NORM_WRITES_X=0: never)."""
    if not (_runs(h) and h.dim() == 2 and h.is_contiguous() and delta.is_contiguous() and delta.dtype == h.dtype
            and delta.shape == h.shape and h.shape[0]):
        return add_rms_norm_reference(h, delta, weight, eps)
    total, normed = torch.empty_like(h), torch.empty_like(h)
    dim = h.shape[-1]
    if _cluster_kernel_takes(h, weight, delta):
        threads = min(1024, -(-dim // (4 * CLUSTER * 32)) * 32)
        writes_x = _writes_x_f16(x_f16, dim)
        x_inputs = mma.x_f16_buffers(h.shape[0], dim, x_f16, h.device) if writes_x else ()
        launch(_cluster_function(h.device, _CLUSTER_KERNELS[x_f16 if writes_x else None]), (h.shape[0] * CLUSTER, 1),
               threads, [h, delta, weight, total, normed, *x_inputs, dim, float(eps)], h.device)
        if writes_x:
            mma.remember_x_f16(normed, x_f16, x_inputs)
        return total, normed
    _add_rms_norm_kernel[(h.shape[0],)](h, delta, weight, total, normed, dim, eps, BLOCK=triton.next_power_of_2(dim),
                                        num_warps=4 if dim <= 1024 else 8)
    return total, normed


def _writes_x_f16(qtype: QType | None, dim: int) -> bool:
    """The cluster kernel writes `qtype`'s float16 x as well: a type of the float16 kernels, whole super-blocks."""
    return (qtype in mma.MMA_TYPES and dim % mma.SUPER == 0
            and os.environ.get("FLASHTREE_NORM_WRITES_X", "1") != "0")


CLUSTER = 8  # CTAs a row takes in add_rms_norm.cu (its CLUSTER)
_CLUSTER_MAX_VECS = 4  # and its MAX_VECS: float4s a thread holds
CLUSTER_MAX_ROWS = 64  # decode, verify and short chunks; longer ones fill the GPU with one program a row
_CLUSTER_SOURCE = Path(__file__).with_name("add_rms_norm.cu")


def cluster_source() -> str:
    """add_rms_norm.cu as NVRTC compiles it, the cluster helpers and qmh's float16 x helpers first."""
    return with_cluster_helpers(_CLUSTER_SOURCE, mma.X_F16_SOURCE)


def _cluster_kernel_takes(h: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> bool:
    """float32 rows (and weight) on a GPU with thread-block clusters (sm_90+), few enough rows, columns that split
    into whole float4s per CTA and fit its registers, and 16-byte aligned inputs (its float4 loads);
    FLASHTREE_CLUSTER_NORM=0 keeps the Triton kernel."""
    dim = h.shape[-1]
    aligned = all(t.data_ptr() % 16 == 0 for t in (h, weight, h if delta is None else delta))
    return (h.is_cuda and h.dtype == torch.float32 and weight.dtype == torch.float32 and weight.is_contiguous()
            and h.shape[0] <= CLUSTER_MAX_ROWS and dim % (4 * CLUSTER) == 0 and aligned
            and dim <= 4 * CLUSTER * _CLUSTER_MAX_VECS * 1024 and _clusters_available(h.device))


@functools.cache
def _clusters_available(device: torch.device) -> bool:
    return (os.environ.get("FLASHTREE_CLUSTER_NORM", "1") != "0" and torch.cuda.get_device_capability(device)[0] >= 9
            and nvrtc_loads())


# add_rms_norm.cu's instances: the norm alone, or writing that type's float16 x as well
_CLUSTER_KERNELS = {None: "add_rms_norm_f32", QType.Q4_K: "add_rms_norm_f32_q4_k", QType.Q6_K: "add_rms_norm_f32_q6_k"}


def _cluster_function(device: torch.device, name: str):
    return functions(device).function(name, cluster_source)


def cuda_jobs(device: torch.device, activations: torch.dtype, x_f16_types=()) -> list[tuple[str, str]]:
    """(name, CUDA C source) of the cluster kernels where a model whose activations are `activations` will launch them
    on `device`, for the load-time compile (engine/loader.py): the norm alone and writing the float16 x of each of
    `x_f16_types` (the types of its fragment-ordered weights) that has such an x; none elsewhere."""
    if torch.device(device).type != "cuda" or activations != torch.float32 or not _clusters_available(device):
        return []
    return [(_CLUSTER_KERNELS[qtype], cluster_source()) for qtype in (None, *mma.MMA_TYPES)
            if qtype is None or qtype in x_f16_types]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (any float dtype; rows may be strided, the last dimension contiguous), weight [D]."""
    if not _runs(x):
        return rms_norm_reference(x, weight, eps)
    return _launch(x, weight, eps, None, x.dtype)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """`gated_rms_norm_reference` in one launch where Triton runs (gate: x's shape, any float dtype)."""
    if not (_runs(x) and gate.shape == x.shape and gate.stride(-1) == 1):
        return gated_rms_norm_reference(x, weight, eps, gate, out_dtype)
    return _launch(x, weight, eps, gate, out_dtype)


def _runs(x: torch.Tensor) -> bool:
    return triton is not None and triton_runs_on(x.device) and x.stride(-1) == 1


def _launch(x, weight, eps, gate, out_dtype) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)  # a view for the strided per-head slices the model passes
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        gates, gate_strides = _gate_rows(gate, rows)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, gates, out, rows.stride(0), *gate_strides, dim, eps,
                                           HAS_GATE=gate is not None, BLOCK=triton.next_power_of_2(dim),
                                           num_warps=4 if dim <= 1024 else 8)
    return out.reshape(x.shape)


def _gate_rows(gate: torch.Tensor | None, rows: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The gate and how row r of it is found: (stride between tokens, between heads, heads a token), row r at
    (r // heads) tokens + (r % heads) heads. A [T, heads, D] gate is read in place (the DeltaNet's z, a slice of its
    fused input projection: reshaping it to rows would copy it for every token past the first)."""
    if gate is None:
        return rows, (rows.stride(0), 0, 1)
    if gate.dim() == 3:
        return gate, (gate.stride(0), gate.stride(1), gate.shape[1])
    gates = gate.reshape(-1, gate.shape[-1])
    return gates, (gates.stride(0), 0, 1)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, gate_ptr, out_ptr, row_stride, gate_stride_t, gate_stride_h, gate_heads, D,
                         eps, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * inv * w
        if HAS_GATE:
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the reference's rms_norm returns x's dtype
            gate_row = (row // gate_heads) * gate_stride_t + (row % gate_heads) * gate_stride_h
            g = tl.load(gate_ptr + gate_row + cols, mask=mask, other=0.0).to(tl.float32)
            y = y * (g * tl.sigmoid(g))
        tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, total_ptr, normed_ptr, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        h = tl.load(h_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        delta = tl.load(delta_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        total = (h + delta).to(total_ptr.dtype.element_ty)  # the stream keeps its dtype; the norm reads it so
        tl.store(total_ptr + row * D + cols, total, mask=mask)
        x = total.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(normed_ptr + row * D + cols, (x * inv * w).to(normed_ptr.dtype.element_ty), mask=mask)
