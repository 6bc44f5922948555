"""`--tensor-parallel N` without torchrun: flashtree starts N copies of its own command line, one per
rank, with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) on a free
local port, and with NVLink multicast off in every child (flashtree.parallel.CHILD_ENV)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from flashtree.parallel import CHILD_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(CHILD_ENV)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return env


def spawn_ranks(argv: Sequence[str], world: int, module: str = "flashtree.cli.main", grace_s: float = 10.0) -> int:
    """Run `python -m module argv` as `world` ranks; rank 0 keeps the terminal. Returns the first failure's
    exit code (0 when all succeed). If one rank fails the others are stopped; followers still running
    `grace_s` after rank 0 ended are stopped too (they only ever serve rank 0)."""
    port = free_port()
    procs = []
    for rank in range(world):
        stdin = None if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=rank_env(rank, world, port),
                                      stdin=stdin))
    code = 0
    deadline, stopped = None, set()

    def on_term(signum, frame):  # a terminated launcher takes its ranks with it
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        remaining = list(procs)
        while remaining:
            if deadline is None and procs[0] not in remaining:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for p in remaining:
                    p.terminate()
                stopped.update(remaining)
                deadline = float("inf")
            for p in list(remaining):
                try:
                    rc = p.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
                remaining.remove(p)
                if rc != 0 and code == 0 and p not in stopped:
                    code = rc
                    for other in remaining:
                        other.terminate()
                    stopped.update(remaining)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
        code = 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return code
