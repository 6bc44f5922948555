"""CUDA C to cubin through NVRTC (cuda-python), importing neither torch nor the kernels package.

The load-time compile of the tensor-core kernels (`kernels/quant_matmul/mma.py` `precompile`) runs this in
spawned processes; a process that imported torch first took ~9 s before its first cubin on a fresh H200
(2026-12-01, 24 instances in 12.6 s), most of it that import, while a compile itself takes about a second.
"""

from __future__ import annotations

import os
from pathlib import Path

from flashtree.errors import FlashtreeError


def bindings():
    """cuda-python's driver and NVRTC bindings (optional: only GPU runs need them)."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise FlashtreeError("the tensor-core quantized kernels need cuda-python: pip install 'cuda-bindings'") from e
    return driver, nvrtc


def check(result, what: str):
    """A cuda-python call's value, or an error naming the call."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise FlashtreeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def compile_cubin(source: str, arch: str) -> bytes:
    """NVRTC: CUDA C source -> cubin for `arch` (e.g. "sm_90"); no GPU needed."""
    _, nvrtc = bindings()
    prog = check(nvrtc.nvrtcCreateProgram(source.encode(), b"mma.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
    if int(err) != 0:
        size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise FlashtreeError(f"NVRTC could not compile the quantized kernels:\n{log.decode(errors='replace')}")
    size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    cubin = b" " * size
    check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin


def store(path: Path, cubin: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent compilers each rename a whole file
    tmp.write_bytes(cubin)
    tmp.replace(path)


def compile_to(job: tuple[str, str, str, Path]) -> str:
    """(name, source, arch, path): the cubin of `source` at `path` unless one is there; returns the name."""
    name, source, arch, path = job
    if not path.exists():
        store(path, compile_cubin(source, arch))
    return name
