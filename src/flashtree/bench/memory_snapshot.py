"""`bench --steps --memory-snapshot FILE`: where a GPU's memory sits, by the flashtree line that allocated it.

The footprint that matters on a 24 GiB card is what the allocator reserves, not only what its tensors hold
(issue #20: 22.08 GiB of tensors at the peak, 22.70 reserved). PyTorch's allocator keeps the Python stack of
every live block once `_record_memory_history("state")` is on (a few microseconds an allocation); its snapshot
lists each segment with its live and free blocks. From it this module prints:

* the reservation by pool (the default pool or a CUDA graph's), block class (large / small) and stream: what
  is live in it and what it keeps free;
* the live memory by the first flashtree line on each block's stack (a library's file where none is);
* the free blocks the allocator keeps, largest first, each with the live blocks on either side of it.

The bench writes the snapshot at the first out-of-memory (a `--gpu-memory` cap the run does not fit: the
moment the process is at its fullest, with the stack of the allocation that failed) and at the end of the run,
and prints its summary after each phase. `python -m flashtree.bench.memory_snapshot FILE` prints the tables of a
written snapshot again; PyTorch's memory viewer (pytorch.org/memory_viz) reads the same file.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

MIB = 2**20
OWN_FILES = "/flashtree/"  # frames from these files name a block's site
THIS_FILE = "bench/memory_snapshot.py"


def block_site(frames: list[dict]) -> str:
    """The line a block was allocated from: the innermost flashtree frame, else the innermost frame of a
    library, else '<no stack>' (blocks made before recording started)."""
    for frame in frames:
        name = frame.get("filename", "")
        if OWN_FILES in name and THIS_FILE not in name:
            return f"{name.split(OWN_FILES, 1)[1]}:{frame.get('line')} {frame.get('name')}"
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name:
            return f"{Path(name).name}:{frame.get('line')} {frame.get('name')}"
    return "<no stack>" if not frames else f"{Path(frames[0].get('filename', '?')).name} (torch)"


def pool_name(segment: dict) -> str:
    pool = tuple(segment.get("segment_pool_id", (0, 0)))
    return "default" if pool == (0, 0) else f"graph pool {pool[0]}.{pool[1]}"


@dataclass
class PoolUse:
    reserved: int = 0
    live: int = 0

    @property
    def free(self) -> int:
        return self.reserved - self.live


@dataclass
class FreeBlock:
    size: int
    where: str  # the pool and class it sits in
    before: str  # the site of the live block below it ('' at a segment's start)
    after: str


@dataclass
class Summary:
    pools: dict[tuple[str, str, int], PoolUse] = field(default_factory=dict)
    sites: dict[str, list[int]] = field(default_factory=dict)  # site -> [bytes, blocks]
    free_blocks: list[FreeBlock] = field(default_factory=list)

    @property
    def reserved(self) -> int:
        return sum(p.reserved for p in self.pools.values())

    @property
    def live(self) -> int:
        return sum(p.live for p in self.pools.values())


def summarize(snapshot: dict, device: int | None = None) -> Summary:
    """The reservation by pool, the live memory by site and the free blocks of `snapshot` (one device's
    segments when `device` is given)."""
    summary = Summary()
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for segment in snapshot["segments"]:
        if device is not None and segment.get("device", device) != device:
            continue
        key = (pool_name(segment), segment.get("segment_type", "?"), segment.get("stream", 0))
        use = summary.pools.setdefault(key, PoolUse())
        blocks = segment["blocks"]
        for i, block in enumerate(blocks):
            use.reserved += block["size"]
            if block["state"] == "inactive":
                neighbours = [block_site(blocks[j].get("frames", [])) if 0 <= j < len(blocks)
                              and blocks[j]["state"] != "inactive" else "" for j in (i - 1, i + 1)]
                summary.free_blocks.append(FreeBlock(block["size"], f"{key[0]} {key[1]}", *neighbours))
                continue
            use.live += block["size"]
            entry = sites[block_site(block.get("frames", []))]
            entry[0] += block["size"]
            entry[1] += 1
    summary.sites = dict(sites)
    summary.free_blocks.sort(key=lambda b: -b.size)
    return summary


def format_summary(summary: Summary, top: int = 16) -> str:
    lines = [f"allocator: {summary.reserved / MIB:,.1f} MiB reserved, {summary.live / MIB:,.1f} MiB live, "
             f"{(summary.reserved - summary.live) / MIB:,.1f} MiB kept free",
             f"{'pool':<22}{'class':<7}{'stream':>16}{'reserved MiB':>14}{'live MiB':>11}{'free MiB':>10}"]
    for (pool, kind, stream), use in sorted(summary.pools.items(), key=lambda kv: -kv[1].reserved):
        lines.append(f"{pool:<22}{kind:<7}{stream:>16}{use.reserved / MIB:>14,.1f}{use.live / MIB:>11,.1f}"
                     f"{use.free / MIB:>10,.1f}")
    lines.append(f"{'live memory by site':<72}{'MiB':>10}{'blocks':>8}")
    ranked = sorted(summary.sites.items(), key=lambda kv: -kv[1][0])
    for site, (size, count) in ranked[:top]:
        lines.append(f"{site[:72]:<72}{size / MIB:>10,.1f}{count:>8}")
    rest = ranked[top:]
    if rest:
        lines.append(f"{f'{len(rest)} more sites':<72}{sum(s for _, (s, _) in rest) / MIB:>10,.1f}"
                     f"{sum(c for _, (_, c) in rest):>8}")
    big = [b for b in summary.free_blocks if b.size >= MIB]
    lines.append(f"free blocks kept: {len(summary.free_blocks)}, {len(big)} of 1 MiB or more "
                 f"({sum(b.size for b in big) / MIB:,.1f} MiB); the largest, between the live blocks of:")
    for block in big[: top // 2]:
        lines.append(f"  {block.size / MIB:>9,.1f} MiB  {block.where}: {block.before[:48] or '-'} | "
                     f"{block.after[:48] or '-'}")
    return "\n".join(lines)


class SnapshotRecorder:
    """Keeps the allocator's block stacks from `start` on; writes the snapshot to `path` at the first
    out-of-memory and at `finish`, printing its summary."""

    def __init__(self, path: str | Path, device: torch.device):
        self.path, self.device = Path(path), device
        self.oom_written = False

    def start(self) -> None:
        torch.cuda.init()  # the allocator's per-device state exists from here: both calls below set it
        torch.cuda.memory._record_memory_history("state", context="state", stacks="python")
        torch._C._cuda_attach_out_of_memory_observer(self._on_out_of_memory)

    def phase(self, name: str) -> str:
        """One line for the report: what is reserved, live and kept free after `name`."""
        summary = summarize(torch.cuda.memory._snapshot(), self.device.index)
        line = (f"{name}: {summary.reserved / MIB:,.1f} MiB reserved, {summary.live / MIB:,.1f} live, "
                f"{(summary.reserved - summary.live) / MIB:,.1f} kept free")
        print(f"memory snapshot: {line}", flush=True)
        return line

    def finish(self) -> None:
        if not self.oom_written:
            self._write(torch.cuda.memory._snapshot(), "end of run")
        torch.cuda.memory._record_memory_history(None)

    def _on_out_of_memory(self, device: int, size: int, allowed: int, device_free: int) -> None:
        if self.oom_written:
            return
        self.oom_written = True
        stack = "".join(traceback.format_stack()[:-1][-8:])
        print(f"memory snapshot: out of memory on cuda:{device} asking {size / MIB:,.1f} MiB "
              f"({allowed / MIB:,.1f} MiB allowed); the allocation's stack:\n{stack}", file=sys.stderr, flush=True)
        self._write(torch.cuda.memory._snapshot(), "out of memory")

    def _write(self, snapshot: dict, moment: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as f:
            pickle.dump(snapshot, f)
        print(f"memory snapshot ({moment}) written to {self.path}\n"
              f"{format_summary(summarize(snapshot, self.device.index))}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtree.bench.memory_snapshot",
                                     description="print the tables of a memory snapshot written by bench")
    parser.add_argument("file", help="a snapshot pickle (bench --memory-snapshot FILE, torch's _dump_snapshot)")
    parser.add_argument("--top", type=int, default=16, help="sites and free blocks listed (default 16)")
    args = parser.parse_args(argv)
    try:
        with open(args.file, "rb") as f:
            snapshot = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        print(f"error: cannot read snapshot {args.file}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        print(f"error: {args.file} is not an allocator snapshot (no 'segments')", file=sys.stderr)
        return 2
    print(format_summary(summarize(snapshot), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
