"""The prefix cache's command-line flags (serve, chat) and defaults, apart from the cache itself so that
building the argument parser does not import torch."""

from __future__ import annotations

import argparse

DEFAULT_INTERVAL = 1024
DEFAULT_MAX_ENTRIES = 64
DEFAULT_MAX_BYTES = 8 << 30  # all snapshots, device memory and host RAM together
DEFAULT_DEVICE_BYTES = 4 << 30  # of which in device memory; the least recently used past it spill to host RAM
GIB = 1 << 30


def add_prefix_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV + DeltaNet state of earlier prompts/answers across turns "
                             "(default on; --no-prefix-cache switches it off)")
    parser.add_argument("--prefix-cache-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                        help=f"most snapshots kept, least recently used evicted (default {DEFAULT_MAX_ENTRIES})")
    parser.add_argument("--prefix-cache-gib", type=float, default=DEFAULT_MAX_BYTES / GIB,
                        help=f"most memory the snapshots take in all, device and host RAM, in GiB "
                             f"(default {DEFAULT_MAX_BYTES / GIB:g})")
    parser.add_argument("--prefix-cache-device-gib", type=float, default=DEFAULT_DEVICE_BYTES / GIB,
                        help="of that, most kept in device memory (counted by the memory plan); the least "
                             "recently used snapshots past it move to host RAM "
                             f"(default {DEFAULT_DEVICE_BYTES / GIB:g})")
    parser.add_argument("--prefix-cache-interval", type=int, default=DEFAULT_INTERVAL,
                        help=f"also snapshot every N prompt tokens of a long prompt (default {DEFAULT_INTERVAL})")


def prefix_cache_settings(args: argparse.Namespace) -> dict:
    """The `EngineArgs` prefix-cache fields of the flags `add_prefix_cache_args` added; none for a command
    without them (`flashtree run` opening the chat: no prefix cache)."""
    if not hasattr(args, "prefix_cache"):
        return {}
    return {"prefix_cache": args.prefix_cache, "prefix_cache_entries": args.prefix_cache_entries,
            "prefix_cache_bytes": max(1, int(args.prefix_cache_gib * GIB)),
            "prefix_cache_device_bytes": max(0, int(args.prefix_cache_device_gib * GIB)),
            "prefix_cache_interval": args.prefix_cache_interval}
