"""Weights laid out without holes: each piece of a model is built in a scratch memory pool, and its final
tensors are then copied, one after the other, into the device's default pool.

Building a layer on the GPU allocates temporaries among its final tensors: the uploaded GGUF bytes before their
tensor-core layout, the separate projections before they are fused. Freed, they leave holes between the weights
that PyTorch's allocator keeps mapped, since with expandable segments (the `--gpu-memory` default) it maps and
unmaps memory in 20 MiB pieces and a hole holds a whole aligned piece only by chance. At the 27B shape the holes
came to 730 MiB: a 23 GiB cap ran out of memory allocating the KV cache with 739 MiB of its reservation free
(H100, 2026-12-06, `bench --memory-snapshot`: 95 free blocks of 1 MiB or more between the weights).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class WeightPool:
    """`build(make)`: `make()`'s allocations on `device` go to a scratch pool; the CUDA tensors reachable from its
    result that live there are then copied to the default pool (`relocate`). `close()` hands the scratch back.
    On the CPU, a torch without `torch.cuda.use_mem_pool`, or one whose pools refuse expandable
    segments, `build` is `make()`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        usable = self.device.type == "cuda" and hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")
        self.scratch = torch.cuda.MemPool() if usable else None

    def build(self, make: Callable[[], T]) -> T:
        if self.scratch is None:
            return make()
        try:
            with torch.cuda.use_mem_pool(self.scratch, self.device):
                result = make()
        except RuntimeError as exc:
            if not _pools_refuse_expandable_segments(exc):
                raise
            self.scratch = None  # torch 2.7-2.8 under expandable segments (a --gpu-memory cap): the plain build
            return make()
        ranges = self._scratch_ranges()
        relocate(result, lambda t: t.is_cuda and any(lo <= t.untyped_storage().data_ptr() < hi for lo, hi in ranges))
        return result

    def close(self) -> None:
        """The scratch pool's memory back to the driver (its blocks are all free once every result is built)."""
        if self.scratch is not None:
            self.scratch = None
            torch.cuda.empty_cache()

    def _scratch_ranges(self) -> list[tuple[int, int]]:
        pool = tuple(self.scratch.id)
        return [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()
                if tuple(s.get("segment_pool_id", ())) == pool]


def _pools_refuse_expandable_segments(exc: RuntimeError) -> bool:
    """The error of a torch whose memory pools do not take expandable segments ("MemPool doesn't currently support
    expandable_segments"; later versions allow pools without a custom allocator)."""
    text = str(exc)
    return not isinstance(exc, torch.OutOfMemoryError) and "MemPool" in text and "expandable_segments" in text


def relocate(root, moves: Callable[[torch.Tensor], bool]) -> None:
    """Replace every tensor reachable from `root` (through lists, tuples, dicts and flashtree objects' attributes)
    for which `moves(tensor)` holds by one in a fresh allocation with the same values; tensors that shared a
    storage share its one copy, as the same views."""
    copies: dict[int, torch.UntypedStorage] = {}

    def moved(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in copies:
            copies[key] = storage.clone()
        out = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        out.set_(copies[key], tensor.storage_offset(), tensor.size(), tensor.stride())
        return torch.nn.Parameter(out, requires_grad=tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) \
            else out

    seen: set[int] = set()

    def visit(value):
        """`value` with its tensors moved: the same object (changed in place) or, for a tuple, a new one."""
        if isinstance(value, torch.Tensor):
            return moved(value) if moves(value) else value
        if id(value) in seen:
            return value
        if isinstance(value, list):
            seen.add(id(value))
            value[:] = [visit(item) for item in value]
        elif isinstance(value, dict):
            seen.add(id(value))
            for key, item in value.items():
                value[key] = visit(item)
        elif isinstance(value, tuple):
            items = [visit(item) for item in value]
            if any(a is not b for a, b in zip(items, value)):
                return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("flashtree."):
            seen.add(id(value))
            for name, item in list(vars(value).items()):
                new = visit(item)
                if new is not item:  # past a frozen dataclass's guard: the same values, in other memory
                    object.__setattr__(value, name, new)
        return value

    visit(root)
