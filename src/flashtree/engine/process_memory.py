"""The whole process's memory on a GPU: held to a `--gpu-memory` cap, and measured.

PyTorch's allocator sees only its own tensors. The process also holds the CUDA context, cuBLAS workspaces
and the Triton and NVRTC modules it loaded, outside the allocator; a 24 GiB card must hold both.

* `cap_process_memory`: with `--gpu-memory`, the allocator of each CUDA device the process uses may
  reserve the cap less the memory held outside it (`cuda_overhead`), so that a 24 GiB card can be played
  on a larger one: an allocation past the cap raises out-of-memory as it would on that card. Under a cap
  the allocator grows its segments in place (expandable segments) unless PYTORCH_CUDA_ALLOC_CONF says
  otherwise: with fixed segments, blocks cached in one size class cannot serve another, and at 24 GiB
  the budget-64 verify graph did not fit (H200, 2026-12-02, docs/LONG_CONTEXT.md "Measured under the cap").
* `measure_process_memory`: the device's used memory (total - free, the context included) against what
  the allocator reserved; the difference is the footprint outside the allocator, the figure that
  `DEFAULT_CUDA_OVERHEAD` stands in for. It counts everything on the device, so it is this process's only
  when no other process uses the GPU (as on the benchmark machines).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

import torch

from flashtree.engine.planner import GIB, fmt_bytes, parse_size
from flashtree.errors import FlashtreeError
from flashtree.kernels import indexed


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"  # the user's allocator settings, which a cap leaves as they are


def allocator_fraction(cap: int, cuda_overhead: int, total: int, device: str) -> float:
    """The share of `device`'s `total` bytes the allocator may reserve so that it and the `cuda_overhead`
    held outside it stay within `cap`."""
    if cap > total:
        raise FlashtreeError(f"--gpu-memory {fmt_bytes(cap)} is more than {device} has ({fmt_bytes(total)})")
    if cap <= cuda_overhead:
        raise FlashtreeError(f"--gpu-memory {fmt_bytes(cap)} leaves nothing for tensors once the CUDA context and "
                             f"libraries take {fmt_bytes(cuda_overhead)} (--cuda-overhead)")
    return (cap - cuda_overhead) / total


def cap_process_memory(devices: Iterable[torch.device | str], gpu_memory: str | None, cuda_overhead: int) -> None:
    """Hold this process to `gpu_memory` (e.g. '24GiB') on each CUDA device of `devices`; no cap when None."""
    if gpu_memory is None:
        return
    cap = parse_size(gpu_memory)
    devices = {indexed(d) for d in devices if torch.device(d).type == "cuda"}
    if devices and "expandable_segments" not in os.environ.get(ALLOC_CONF, ""):
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    for device in devices:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(allocator_fraction(cap, cuda_overhead, total, str(device)), device)


@dataclass(frozen=True)
class ProcessMemory:
    """One GPU's memory as the device and as PyTorch's allocator see it, in bytes."""

    device_used: int  # total - free: everything on the device, the CUDA context included
    allocator_reserved: int  # what the allocator holds now (its tensors and its cached blocks)
    allocator_peak_reserved: int  # since the last reset of the peak statistics
    allocator_peak_allocated: int

    @property
    def outside_allocator(self) -> int:
        """CUDA context, library workspaces and modules: the device's used memory the allocator did not reserve."""
        return self.device_used - self.allocator_reserved

    @property
    def peak_footprint(self) -> int:
        """The process at its largest: the allocator's peak reservation plus what it holds outside the
        allocator (measured at the end of the run, when every module it loaded is resident)."""
        return self.allocator_peak_reserved + self.outside_allocator

    def as_gib(self) -> dict[str, float]:
        fields = {"device_used": self.device_used, "allocator_reserved": self.allocator_reserved,
                  "outside_allocator": self.outside_allocator,
                  "allocator_peak_allocated": self.allocator_peak_allocated,
                  "allocator_peak_reserved": self.allocator_peak_reserved, "peak_footprint": self.peak_footprint}
        return {name: round(value / GIB, 3) for name, value in fields.items()}


def measure_process_memory(device: torch.device | int) -> ProcessMemory:
    """`device`'s memory now, once its queued work has finished (see the module's note on other processes)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return ProcessMemory(device_used=total - free, allocator_reserved=torch.cuda.memory_reserved(device),
                         allocator_peak_reserved=torch.cuda.max_memory_reserved(device),
                         allocator_peak_allocated=torch.cuda.max_memory_allocated(device))
