"""`flashtree` command line: run, info, serve, chat, bench. Errors print as one line, never a traceback."""

from __future__ import annotations

import argparse
import sys

from flashtree import __version__
from flashtree.errors import FlashtreeError


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model (names follow llama.cpp / vLLM)."""
    parser.add_argument("-m", "--model", help="target GGUF (default: the embedded demo model)")
    parser.add_argument("--draft", help="DFlash draft directory (config.json + model.safetensors)")
    parser.add_argument("--spec", choices=("ar", "chain", "ddtree"), default=None,
                        help="decoding mode (default: ddtree when a draft is given, else ar)")
    parser.add_argument("--budget", type=int, default=22, help="DDTree node budget (default 22)")
    parser.add_argument("--topk", type=int, default=8, help="DDTree candidates per depth (default 8)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("-c", "--ctx", type=int, default=None, help="context size in tokens (default: fit the request)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtree", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flashtree {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from flashtree.bench import cli as bench
    from flashtree.cli import info, run
    from flashtree.cli.chat import add_chat_parser
    from flashtree.serve.cli import add_serve_parser

    run.add_parser(sub)
    info.add_parser(sub)
    add_model_args(add_serve_parser(sub))
    add_model_args(add_chat_parser(sub))
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except FlashtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
