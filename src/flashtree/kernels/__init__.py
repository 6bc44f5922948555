"""Kernels: one family per module, each a Triton GPU kernel with a torch reference of the same signature.

Where a Triton kernel runs: on CUDA tensors, and on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), which is how the tests exercise them without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(device: torch.device | str) -> bool:
    return triton_installed() and (torch.device(device).type == "cuda" or interpreted())


@functools.cache
def cpu_has_bf16_dot() -> bool:
    """This CPU multiplies bf16 in hardware (AVX512-BF16, or AMX tiles): there oneDNN's bf16 matmul at a draft
    block's 16 rows takes a fifth to a half of MKL's float32 sgemm (the demo pair's shapes, 2 threads, 2026-12-06);
    elsewhere bf16 is emulated and slower than float32. torch has the check only as private functions of torch.cpu:
    where one is missing, its answer is no."""
    checks = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(check is not None and check() for check in checks)


def gemm_layout(weight: torch.Tensor) -> torch.Tensor:
    """A dense [N, K] weight as `F.linear` reads it fastest where it lives: on the CPU K-major (its transpose
    contiguous, viewed back as [N, K]), so that MKL's sgemm takes B without transposing it into its panels: at 16-23
    rows (a draft block, a verify) 1.3-2.8x faster than the row-major weight, the same at one row (2 threads, torch
    2.13 with MKL, 2026-12-06, docs/PERFORMANCE.md). Elsewhere as it came, but a K-major weight moved off the CPU
    is row-major again (the layout the GPU paths were measured with)."""
    k_major = weight.dim() == 2 and weight.t().is_contiguous() and not weight.is_contiguous()
    if weight.device.type == "cpu" and weight.dim() == 2:
        return weight if k_major else weight.t().contiguous().t()
    return weight.contiguous() if k_major else weight


def indexed(device: torch.device | str) -> torch.device:
    """`cuda` as the `cuda:N` it means (the current GPU). A tensor's device always carries its index and
    `cuda` != `cuda:0`, so a model or draft holding an unindexed device fails every "same device?" check
    against its own tensors."""
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def on_device(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Triton launches its kernels on the *current* CUDA device, whatever device the tensors live on: work on
    a second GPU (a layer split's later stages, the draft on its own GPU) runs inside this context, or its
    kernels would read another GPU's memory (an illegal address without peer access)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def address_table(*columns: list[torch.Tensor]) -> torch.Tensor:
    """int64 [len(columns), n] on the first tensor's device: each column's tensors' addresses, for a kernel that
    serves many tensors of one shape in one launch (the commit's tables: `commit_rows.RowTable`, `WindowTable`,
    `gated_delta_triton.FoldTables`). Built outside CUDA graph capture; the tensors must stay where they are."""
    return torch.tensor([[t.data_ptr() for t in column] for column in columns], dtype=torch.int64,
                        device=columns[0][0].device)
