"""`--tensor-parallel N` on the command line: one process per rank, rank 0 runs the command."""

from __future__ import annotations

import os
import sys

import torch.distributed

from flashtree.cli.args import engine_args
from flashtree.parallel.launch import spawn_ranks
from flashtree.engine.loader import load_engine
from flashtree.errors import FlashtreeError


def run_rank(args, argv) -> int:
    """The CLI under `--tensor-parallel N`: without RANK in the environment, start N ranks running `argv`
    (flashtree.parallel.launch); rank 0 runs the command; any other rank only loads the same engine and
    follows rank 0 (it never reads stdin, binds a port or prints). `bench --synthetic` is SPMD instead:
    every rank runs the whole benchmark in lock step (it calls the model outside `generate`), rank 0
    alone prints and writes the results."""
    if getattr(args, "synthetic", None) and getattr(args, "command", None) != "bench":
        raise FlashtreeError("--synthetic with --tensor-parallel is for `flashtree bench` only")
    if "RANK" not in os.environ:
        return spawn_ranks(argv, args.tensor_parallel)
    if getattr(args, "synthetic", None):
        if os.environ["RANK"] != "0":
            sys.stdout = open(os.devnull, "w")
        try:
            return args.handler(args) or 0
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    if os.environ["RANK"] == "0":
        return args.handler(args) or 0
    # follows rank 0, then exits; the memory check here plans for the default context with no cap (rank 0
    # checks the requested ones)
    load_engine(engine_args(args, ctx=None, gpu_memory=None))
    return 0
