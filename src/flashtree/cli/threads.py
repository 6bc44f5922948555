"""CPU threads for torch: `--threads N`, and the default when it is not given.

The default leaves one physical core free. torch's OpenMP workers spin while they wait for work, so
when any other process takes one of their cores every parallel region waits for the descheduled
worker: on a 2-core machine with one core busy, `run -n 128` on the demo pair fell from 455 tok/s
(2 threads, idle) to 125 tok/s, while 1 thread kept 330 tok/s busy or idle (docs/PERFORMANCE.md,
"CPU threads"). Whether the machine will be busy is not knowable at start-up, so the default trades
at most one core's share when idle for not collapsing when shared.
"""

from __future__ import annotations

import os
from pathlib import Path


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (its affinity mask); SMT siblings count once."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology.joinpath("physical_package_id").read_text(), topology.joinpath("core_id").read_text()))
        except OSError:  # no sysfs topology (some containers): count the CPU itself
            cores.add(("cpu", str(cpu)))
    return max(len(cores), 1)


def default_threads() -> int:
    """OMP_NUM_THREADS when set (the user chose), else the physical cores less one, at least 1."""
    chosen = os.environ.get("OMP_NUM_THREADS", "")
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return max(physical_cores() - 1, 1)


def set_threads(count: int | None) -> int:
    """Sets torch's intra-op and inter-op thread counts once, before any work; returns the count used."""
    import torch  # deferred with the rest of torch: `flashtree --help` must not pay for it

    count = count or default_threads()
    torch.set_num_threads(count)
    try:
        torch.set_num_interop_threads(count)
    except RuntimeError:  # already set, or inter-op work already started (a second `main` call in one process)
        pass
    return count
