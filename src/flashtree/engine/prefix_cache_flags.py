"""The prefix cache's command-line flags (serve, chat) and defaults, apart from the cache itself so that
building the argument parser does not import torch."""

from __future__ import annotations

import argparse

DEFAULT_INTERVAL = 1024
DEFAULT_MAX_ENTRIES = 64
DEFAULT_MAX_BYTES = 8 << 30


def add_prefix_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV + DeltaNet state of earlier prompts/answers across turns "
                             "(default on; --no-prefix-cache switches it off)")
    parser.add_argument("--prefix-cache-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                        help=f"most snapshots kept, least recently used evicted (default {DEFAULT_MAX_ENTRIES})")
    parser.add_argument("--prefix-cache-gib", type=float, default=DEFAULT_MAX_BYTES / (1 << 30),
                        help=f"most memory the snapshots take, in GiB (default {DEFAULT_MAX_BYTES / (1 << 30):g}; "
                             "host RAM when the model is on a GPU)")
    parser.add_argument("--prefix-cache-interval", type=int, default=DEFAULT_INTERVAL,
                        help=f"also snapshot every N prompt tokens of a long prompt (default {DEFAULT_INTERVAL})")


def prefix_cache_settings(args: argparse.Namespace) -> dict:
    """The `EngineArgs` prefix-cache fields of the flags `add_prefix_cache_args` added; none for a command
    without them (`flashtree run` opening the chat: no prefix cache)."""
    if not hasattr(args, "prefix_cache"):
        return {}
    return {"prefix_cache": args.prefix_cache, "prefix_cache_entries": args.prefix_cache_entries,
            "prefix_cache_bytes": max(1, int(args.prefix_cache_gib * (1 << 30))),
            "prefix_cache_interval": args.prefix_cache_interval}
