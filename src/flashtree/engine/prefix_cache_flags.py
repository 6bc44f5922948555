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
