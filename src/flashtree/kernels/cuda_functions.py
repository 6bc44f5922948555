"""CUDA C kernels compiled at run time (NVRTC, `flashtree.nvrtc`), cached on disk per GPU architecture, loaded
into the device's primary context (where torch allocates) and launched on torch's current stream, so that they
capture into CUDA graphs like torch's own kernels. The tensor-core matmuls (`quant_matmul/mma.py`), the
cluster add + RMSNorm (`rms_norm.py`) and the DeltaNet tree verify (`gated_delta_cuda.py`) use it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from flashtree.nvrtc import bindings, check, compile_cubin, compile_to, store


_CLUSTER_HELPERS = Path(__file__).with_name("cluster.cuh")


def with_cluster_helpers(source_file: Path, *headers: Path) -> str:
    """A kernel file's source with the thread-block-cluster helpers (cluster.cuh) and `headers` before it, in that
    order: NVRTC compiles with no headers, and the whole text is the cubin's cache key, so a change to a header
    recompiles every user."""
    return "\n".join(path.read_text() for path in (_CLUSTER_HELPERS, *headers, source_file))


@functools.cache
def nvrtc_loads() -> bool:
    """cuda-python importable and NVRTC loadable (otherwise the Triton kernels serve)."""
    try:
        _, nvrtc = bindings()
        check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except Exception:  # noqa: BLE001 - no cuda-python, or it cannot find libnvrtc
        return False
    return True


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHTREE_CACHE", Path.home() / ".cache" / "flashtree")) / "mma"


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def target(source: str, arch: str) -> str:
    """The architecture `source` compiles for: Hopper's warpgroup MMA (wgmma) exists on sm_90a only."""
    return arch + "a" if arch == "sm_90" and "wgmma." in source else arch


def cubin_path(name: str, source: str, arch: str) -> Path:
    key = hashlib.sha256(f"{arch}\n{source}".encode()).hexdigest()[:24]
    return cache_dir() / f"{name}-{key}.cubin"


def uncompiled(jobs: list[tuple[str, str]], arch: str) -> list[tuple[str, str]]:
    """The (name, whole CUDA C source) jobs whose cubin is not in the on-disk cache yet."""
    return [(name, source) for name, source in jobs if not cubin_path(name, source, target(source, arch)).exists()]


def precompile(jobs: list[tuple[str, str]], arch: str, workers: int | None = None, progress=None) -> None:
    """Compile (name, whole source) jobs into the on-disk cache in parallel processes (NVRTC needs no GPU), where
    `load_function` finds them; `progress` is called with each finished name."""
    todo = [(name, source, target(source, arch), cubin_path(name, source, target(source, arch)))
            for name, source in uncompiled(jobs, arch)]
    if not todo:
        return
    workers = workers or max(1, min(len(todo), os.cpu_count() or 1))
    context = multiprocessing.get_context("spawn")  # the parent may hold a CUDA context
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        # the workers import flashtree.nvrtc only (no torch): each starts in a fraction of a second
        for name in pool.map(compile_to, todo):
            if progress:
                progress(name)


def load_function(device: torch.device, name: str, source: str):
    """Function `name` of `source` (the whole CUDA C text) on `device`, compiled unless the disk cache has it."""
    driver, _ = bindings()
    arch = target(source, arch_of(device))
    path = cubin_path(name, source, arch)
    if path.exists():
        cubin = path.read_bytes()
    else:
        cubin = compile_cubin(source, arch)
        store(path, cubin)
    with torch.cuda.device(device):
        check(driver.cuInit(0), "cuInit")
        # torch allocates in the device's primary context: load the module there
        context = check(driver.cuDevicePrimaryCtxRetain(check(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")),
                         "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        module = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        return check(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")


class Functions:
    """The functions loaded so far on one device (each compiled or read from the disk cache once)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.loaded: dict[str, object] = {}
        self.lock = threading.Lock()

    def function(self, name: str, source: Callable[[], str]):
        """Function `name`, loaded on first use from `source()` (called then only: launches do not read files)."""
        fn = self.loaded.get(name)
        if fn is None:
            with self.lock:
                fn = self.loaded.get(name)
                if fn is None:
                    fn = self.loaded[name] = load_function(self.device, name, source())
        return fn


@functools.cache
def functions(device: torch.device) -> Functions:
    return Functions(device)


@functools.cache
def allow_shared(device: torch.device, name: str, size: int) -> None:
    """Let the loaded kernel `name` take `size` bytes of dynamic shared memory (above 48 KB a function must opt in)."""
    driver, _ = bindings()
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(driver.cuFuncSetAttribute(functions(device).loaded[name], attribute, size), "cuFuncSetAttribute")


@functools.cache
def dependent_launches(device: torch.device) -> bool:
    """Launch with programmatic dependent launch (FLASHTREE_PDL=1, Hopper): a kernel may start while the kernel before
    it on the stream finishes, and waits for it inside (`griddepcontrol.wait`, which every kernel of ours runs before
    it reads its inputs or writes). Off by default: at the 27B shape on the H200 it gave the verify-22 step 2 % and
    the draft step 4 % but cost the AR step 2 % and the speculative step 0.7 %, with the Triton kernels between ours
    launched plainly (twentieth session, docs/PERFORMANCE.md)."""
    return os.environ.get("FLASHTREE_PDL", "0") == "1" and torch.cuda.get_device_capability(device)[0] >= 9


def _config(driver, grid: tuple[int, int], threads: int, shared: int, stream, dependent: bool):
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid[0], grid[1], 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = shared
    config.hStream = stream
    if dependent:
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [attribute]
        config.numAttrs = 1
    return config


def launch(fn, grid: tuple[int, int], threads: int, args: list, device: torch.device, shared: int = 0) -> None:
    """One launch on torch's current stream (programmatic dependent launch where `dependent_launches`): tensors go as
    pointers, Python floats as float, ints as int; `shared`: dynamic shared memory bytes (the function allows them)."""
    driver, _ = bindings()
    stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    values, types = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            values.append(a.data_ptr())
            types.append(ctypes.c_void_p)
        else:
            values.append(a)
            types.append(ctypes.c_float if isinstance(a, float) else ctypes.c_int)
    config = _config(driver, grid, threads, shared, stream, dependent_launches(device))
    with torch.cuda.device(device):
        check(driver.cuLaunchKernelEx(config, fn, (tuple(values), tuple(types)), 0), "cuLaunchKernelEx")
