"""`flashtree serve`: the OpenAI- and Anthropic-compatible server on uvicorn.

torch and the engine are imported inside the functions that run the command: `flashtree --help` builds
every subcommand's parser and must not wait for them."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path

from flashtree.cli.args import add_parse_special_arg, add_thinking_arg, engine_args, int_range, thinking_kwargs
from flashtree.engine.prefix_cache_flags import add_prefix_cache_args, prefix_cache_settings
from flashtree.serve import (DEFAULT_MAX_REQUEST_MB, DEFAULT_QUEUE_SIZE, DEFAULT_REQUEST_TIMEOUT_S,
                             DEFAULT_SHUTDOWN_TIMEOUT_S)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Serving flags only; the model flags (--model, --draft, --spec, --budget, --device, --ctx) are
    added by the caller."""
    p = subparsers.add_parser("serve", help="serve an OpenAI- and Anthropic-compatible HTTP API",
                              description="Serve the model over OpenAI's chat, completions and responses APIs "
                                          "and Anthropic's messages API (see docs/SERVING.md).")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_range(1, 65535), default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("FLASHTREE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $FLASHTREE_API_KEY)")
    p.add_argument("--served-model-name", help="model id clients send and /v1/models lists (default: file stem)")
    p.add_argument("--max-tokens", type=int_range(1), default=4096,
                   help="completion length when a request sets none (default 4096)")
    p.add_argument("--max-queued-requests", type=int_range(1), default=DEFAULT_QUEUE_SIZE,
                   help=f"requests that may wait while one generates; more get 503 (default {DEFAULT_QUEUE_SIZE})")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds from arrival before a request's generation is stopped "
                        f"(default {DEFAULT_REQUEST_TIMEOUT_S:g})")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="seconds in-flight requests get to finish on shutdown before they are cancelled "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="browser origins allowed to call the API (CORS), comma-separated, or * "
                        "(default: * on a loopback --host, none otherwise)")
    p.add_argument("--max-request-mb", type=_positive_float, default=DEFAULT_MAX_REQUEST_MB, metavar="MB",
                   help=f"largest request body in MiB; larger ones get 413 unread (default {DEFAULT_MAX_REQUEST_MB})")
    add_parse_special_arg(p)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_thinking_arg(p)
    p.add_argument("--special", action="store_true",
                   help="keep special tokens such as <|im_end|> in returned text (ids are the same either way)")
    add_prefix_cache_args(p)
    p.set_defaults(handler=run_serve)
    return p


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def engine_factory(args: argparse.Namespace):
    """Loads the engine on call, with the request defaults the flags set."""

    def load():
        from flashtree.engine.loader import load_engine

        return load_engine(engine_args(args, progress=True, max_new_tokens=args.max_tokens,
                                       skip_special_tokens=not args.special, **prefix_cache_settings(args)))

    return load


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_files(args: argparse.Namespace) -> None:
    """What can fail at once fails before the server starts (exit 1, one line): the model file's header and
    the draft's config. The weights load behind /health (503 until ready; after a failed load too)."""
    from flashtree.engine.loader import is_demo
    from flashtree.engine.planner import DraftShape
    from flashtree.formats.gguf_file import GGUFFile

    if not is_demo(args.model):
        GGUFFile(args.model)
    if args.draft:
        DraftShape.from_dir(args.draft)


def allowed_origins(flag: str | None, host: str) -> list[str]:
    """CORS origins: the flag's list; without it every origin on a loopback bind (as llama-server and vLLM
    allow browser front-ends on this machine), none on a reachable one."""
    if flag is None:
        return ["*"] if _is_loopback(host) else []
    return [origin.strip() for origin in flag.split(",") if origin.strip()]


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from flashtree.serve.app import build_app

    _check_files(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not _is_loopback(args.host) and not args.api_key:
        logging.getLogger("flashtree.serve").warning(
            "binding %s without --api-key: anyone who can reach this port can use the model", args.host)
    from flashtree.engine.loader import is_demo

    name = args.served_model_name or ("flashtree-demo" if is_demo(args.model) else Path(args.model).stem)
    app = build_app(engine_factory(args), name, api_key=args.api_key, queue_size=args.max_queued_requests,
                    template_kwargs=thinking_kwargs(args.think),
                    allowed_origins=allowed_origins(args.allowed_origins, args.host),
                    request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
                    max_request_mb=args.max_request_mb, parse_special=args.parse_special)
    print(f"flashtree: serving {name} at http://{args.host}:{args.port}/v1 (loading the model...)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0
