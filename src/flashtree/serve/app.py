"""The HTTP server over one Engine: the OpenAI (serve/openai.py), Anthropic (serve/anthropic.py) and
Responses (serve/responses.py) APIs, each a router over the shared `Server` (serve/server.py), behind the
body size limit, CORS and the error handlers."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from flashtree.serve import (DEFAULT_MAX_REQUEST_MB, DEFAULT_QUEUE_SIZE, DEFAULT_REQUEST_TIMEOUT_S,
                             DEFAULT_SHUTDOWN_TIMEOUT_S)
from flashtree.serve.anthropic import router as anthropic
from flashtree.serve.body_limit import BodySizeLimit
from flashtree.serve.errors import document_errors, install_error_handlers
from flashtree.serve.openai import api, public
from flashtree.serve.responses import router as responses
from flashtree.serve.server import Server


def build_app(engine, model_name: str, api_key: str | None = None, queue_size: int = DEFAULT_QUEUE_SIZE,
              request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
              allowed_origins: Sequence[str] = (), max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
              parse_special: bool = False, template_kwargs: dict | None = None) -> FastAPI:
    """`engine`: an Engine, or a zero-argument callable returning one (loaded in the background while
    /health answers 503). `queue_size`: requests that may wait while one generates; more get 503.
    `request_timeout`: seconds from arrival after which generation stops (finish_reason "length").
    `shutdown_timeout`: seconds in-flight work may take to finish at shutdown before it is cancelled.
    `allowed_origins`: browser origins answered with CORS headers ("*": any). `max_request_mb`: larger request
    bodies get 413. `parse_special`: control-token text in requests makes control tokens (forgeable turns).
    `template_kwargs`: the default chat template arguments, under each request's own (serve --think/--no-think
    sets enable_thinking)."""
    server = Server(engine, model_name, api_key, queue_size, request_timeout, shutdown_timeout, parse_special)
    server.template_kwargs = dict(template_kwargs or {})

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        server.start()
        yield
        await asyncio.to_thread(server.stop)

    app = FastAPI(title="flashtree", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodySizeLimit, max_bytes=int(max_request_mb * 2**20))
    if allowed_origins:  # added after the size limit, so that its 413s carry CORS headers too
        # credentials stay off: the API key travels in a header the browser code sets, never a cookie
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    install_error_handlers(app)
    app.include_router(public)
    app.include_router(api)
    app.include_router(anthropic)
    app.include_router(responses)
    document_errors(app)
    return app
