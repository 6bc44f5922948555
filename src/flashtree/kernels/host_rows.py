"""Rows of a table kept in the host's pinned memory, gathered by the GPU itself (zero-copy), graph-safe.

A 27B token embedding is 0.67 GiB in Q4_K and a step reads 1 to 24 of its 248,320 rows, so it can stay in host
memory, as llama.cpp keeps it, and leave the GPU's memory to the KV cache (issue #20: 262K tokens on a 24 GiB
card). The token ids are device tensors (a graphed speculative step makes them on the GPU), so the host cannot
look the rows up: a kernel reads them through the pinned buffer's address, which unified addressing makes the
GPU's too, over PCIe. One program copies one row, a word a lane.

* `gather_rows(table, index)`: table uint8 [V, B] (pinned host memory, or on the index's device), index int [n]
  -> uint8 [n, B] on the index's device; an id outside [0, V) gives a row of zeros, never a read outside the table.
* `gpu_reads_host(device)`: whether that GPU reads pinned host memory from Triton (a probe row, once a device).
* `pinned(table)`: a pinned host copy of a table (on the host already or on a GPU).

Without CUDA (and without TRITON_INTERPRET=1) the torch form runs: `table[index]`.
"""

from __future__ import annotations

import functools

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import on_device, triton_runs_on

try:  # the kernel needs triton; the torch form does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    triton = None

BLOCK_WORDS = 1024  # 4-byte words a program copies at once: a Q4_K row of 5120 values is 720


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] on the index's device, reading a pinned host table in place when the index is on a GPU."""
    if table.dim() != 2 or table.dtype != torch.uint8 or index.dim() != 1:
        raise FlashtreeError(f"gather_rows takes a uint8 [V, B] table and an index vector, got {table.dtype} "
                             f"{tuple(table.shape)} and {tuple(index.shape)}")
    host_table = table.device.type == "cpu" and index.device.type == "cuda"
    same_device = table.device == index.device and triton_runs_on(index.device)
    if triton is None or not (host_table or same_device):
        return table[index.to(table.device)].to(index.device)
    if host_table and not table.is_pinned():
        raise FlashtreeError("gather_rows reads a host table from the GPU only in pinned memory (`pinned`)")
    vocab, width = table.shape
    out = torch.empty(index.shape[0], width, dtype=torch.uint8, device=index.device)
    if index.shape[0] == 0:
        return out
    words = width % 4 == 0 and table.stride(0) % 4 == 0 and table.data_ptr() % 4 == 0
    src, dst = (table.view(torch.int32), out.view(torch.int32)) if words else (table, out)
    cols = src.shape[1]
    block = min(BLOCK_WORDS, triton.next_power_of_2(cols))
    with on_device(index.device):
        _gather_rows_kernel[(index.shape[0], triton.cdiv(cols, block))](
            src, index, dst, vocab, cols, src.stride(0), BLOCK=block)
    return out


def pinned(table: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `table` (from the host or a GPU), contiguous."""
    return table.contiguous().cpu().pin_memory()


@functools.cache
def gpu_reads_host(device: torch.device) -> bool:
    """Whether `device` (a CUDA device) gathers rows of a pinned host table right: a probe of 4 rows of 16 bytes. A
    platform without unified addressing of pinned memory, or a Triton that refuses host pointers, says no here
    rather than at the first token."""
    if triton is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    probe = torch.arange(64, dtype=torch.uint8).reshape(4, 16)
    # on `device`: the memory check of a tensor-parallel rank probes before the rank picks its GPU, and pinning
    # with no current context would open one on GPU 0 for every rank
    with on_device(device):
        try:
            index = torch.tensor([2, 0, 3], device=device)
            got = gather_rows(probe.pin_memory(), index)
            return torch.equal(got.cpu(), probe[[2, 0, 3]])
        except (RuntimeError, ValueError):  # Triton: "Pointer argument cannot be accessed from Triton (cpu tensor?)"
            return False


if triton is not None:

    @triton.jit
    def _gather_rows_kernel(table_ptr, index_ptr, out_ptr, vocab, cols, stride_v, BLOCK: tl.constexpr):
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < cols
        row = tl.load(index_ptr + tl.program_id(0)).to(tl.int64) + tl.zeros_like(offs).to(tl.int64)  # per lane:
        inside = (row >= 0) & (row < vocab)  # the masks stay vectors
        values = tl.load(table_ptr + tl.where(inside, row, 0) * stride_v + offs, mask=ok & inside, other=0)
        tl.store(out_ptr + tl.program_id(0).to(tl.int64) * cols + offs, values, mask=ok)
