"""`flashtree` command line: run, info, serve, chat, bench. Errors print as one line, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys

from flashtree import __version__
from flashtree.bench import cli as bench
from flashtree.cli import info, plan, run
from flashtree.cli.args import add_model_args
from flashtree.cli.chat import add_chat_parser
from flashtree.cli.threads import set_threads
from flashtree.errors import OUT_OF_MEMORY_ADVICE, FlashtreeError, out_of_memory_summary
from flashtree.serve.cli import add_serve_parser
from flashtree.train import cli as train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtree", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flashtree {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run.add_parser(sub)
    info.add_parser(sub)
    plan.add_parser(sub)
    add_model_args(add_serve_parser(sub))
    add_model_args(add_chat_parser(sub))
    bench.add_parser(sub)
    train.add_parser(sub)
    return parser


def apply_process_options(args: argparse.Namespace) -> None:
    """The model commands' process-wide flags: CPU threads, and the note that -ngl does nothing."""
    if getattr(args, "gpu_layers", None) is not None:
        print(f"note: -ngl {args.gpu_layers} ignored: flashtree puts all layers on --device "
              "(--layer-split spreads them over GPUs)", file=sys.stderr)
    if hasattr(args, "threads"):
        set_threads(args.threads)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        apply_process_options(args)
        if getattr(args, "tensor_parallel", 1) > 1:  # one process per rank (flashtree.cli.tensor_parallel)
            from flashtree.cli.tensor_parallel import run_rank  # deferred: imports torch, --help must not wait

            return run_rank(args, sys.argv[1:] if argv is None else list(argv))
        return args.handler(args) or 0
    except FlashtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # torch's OutOfMemoryError is one; any other is a bug and keeps its traceback
        summary = out_of_memory_summary(exc)
        if summary is None:
            raise
        print(f"error: out of GPU memory ({summary}); {OUT_OF_MEMORY_ADVICE}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`flashtree info demo | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's recipe: no error at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
