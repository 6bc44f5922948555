"""Triton kernels compiled ahead of their first launch, in parallel threads (issue 17's cold start).

Triton compiles a kernel specialization the first time it is launched, one after another inside the first
request: on a fresh H200 the 27B shape's first prefill spent ~10 of its 13 s on 14 kernels (2026-12-02 cold
start profile: gcc building a C launcher per kernel 3.6 s, ptxas 1.5 s, LLVM 2.0-2.7 s, Triton's front end
1.9-3.0 s). gcc and ptxas are other processes, so a thread pool overlaps most of it.

* `recorded_launches()`: within it, a launch of a specialization this process has not compiled runs nothing
  and is recorded instead (the arguments Triton's JIT would compile it with); compiled ones run as usual.
  What runs inside therefore computes garbage: only shapes are meant to come out of it.
* `compile_launches(launches, ...)`: compiles the recorded specializations in threads, into the JIT's own
  per-device cache (and Triton's on-disk cache), each with its module loaded and launcher built, so that
  their first real launch compiles nothing. A specialization that fails to compile here is left out: its
  first launch compiles it again and raises as it always would.

Both go through `JITFunction._do_compile`, Triton's internal compile step (the same arguments in Triton 3.6
and 3.9). Where it is not what this expects (`supported()`), nothing is recorded and every kernel compiles
at its first launch as before.
"""

from __future__ import annotations

import gc
import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

try:  # where triton is missing nothing is compiled ahead
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    JITFunction = Autotuner = None

COMPILE_PARAMETERS = ("self", "key", "signature", "device", "constexprs", "options", "attrs", "warmup")


def supported() -> bool:
    """Triton's compile step takes the arguments this module records."""
    return (JITFunction is not None and hasattr(JITFunction, "_do_compile")
            and tuple(inspect.signature(JITFunction._do_compile).parameters) == COMPILE_PARAMETERS)


@dataclass(frozen=True)
class Launch:
    """One kernel specialization to compile: the JIT function and its compile step's arguments."""
    kernel: object  # a triton JITFunction
    arguments: tuple  # key, signature, device, constexprs, options, attrs, warmup

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", repr(self.kernel))


def _bench_without_the_disk_cache(self, tuning_key, configs, bench_fn) -> bool:
    """`Autotuner.check_disk_cache` while recording: the configs are benchmarked (their launches recorded) and
    nothing is read from or written to Triton's on-disk autotuning cache. Its timings are of launches that ran
    nothing, so a choice written there would be taken by every later process: on an H100 fla's chunked
    DeltaNet kernel then launched a config its shared memory does not hold (OutOfResources, 2026-12-05)."""
    bench_fn()
    return False


@contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within: uncompiled launches are recorded (each specialization once) and not run. Autotuners' choices
    made inside (from timings of launches that ran nothing) are forgotten at the end and never reach Triton's
    on-disk autotuning cache."""
    launches: list[Launch] = []
    if not supported():
        yield launches
        return
    seen = set()
    compile_step = JITFunction._do_compile
    tuned = _autotuner_choices()

    def record(self, key, signature, device, constexprs, options, attrs, warmup):
        if (id(self), device, key) not in seen:
            seen.add((id(self), device, key))
            launches.append(Launch(self, (key, signature, device, constexprs, options, attrs, warmup)))
        return None  # Triton's launch returns without running when its compile step gives nothing

    disk_cache = getattr(Autotuner, "check_disk_cache", None)
    JITFunction._do_compile = record
    if disk_cache is not None:
        Autotuner.check_disk_cache = _bench_without_the_disk_cache
    try:
        yield launches
    finally:
        JITFunction._do_compile = compile_step
        if disk_cache is not None:
            Autotuner.check_disk_cache = disk_cache
        _restore_autotuner_choices(tuned)


def compile_launches(launches: list[Launch], progress: Callable[[str], None] | None = None) -> list[str]:
    """Compile `launches` (the first alone: Triton's one-time set-up, then the rest in a thread each, up to the
    CPU count); returns the names of those that failed (they compile at their first launch instead)."""
    failed = []

    def build(launch: Launch) -> None:
        try:
            torch.cuda.set_device(launch.arguments[2])  # the thread's device: the module loads there
            kernel = JITFunction._do_compile(launch.kernel, *launch.arguments)
            kernel._init_handles()  # the module loaded and the C launcher built now, not at the first launch
        except Exception:  # noqa: BLE001 - the first launch compiles it again and raises what it raises
            failed.append(launch.name)
        if progress is not None:
            progress(launch.name)

    if not launches:
        return failed
    build(launches[0])
    with ThreadPoolExecutor(min(len(launches), os.cpu_count() or 1)) as pool:
        list(pool.map(build, launches[1:]))
    return failed


def _autotuners() -> list:
    # type(), not isinstance(): some objects answer a __class__ lookup with a deprecation warning
    return [obj for obj in gc.get_objects() if Autotuner is not None and issubclass(type(obj), Autotuner)]


def _autotuner_choices() -> dict[int, dict]:
    return {id(tuner): dict(tuner.cache) for tuner in _autotuners() if hasattr(tuner, "cache")}


def _restore_autotuner_choices(before: dict[int, dict]) -> None:
    for tuner in _autotuners():
        if hasattr(tuner, "cache"):
            tuner.cache.clear()
            tuner.cache.update(before.get(id(tuner), {}))
