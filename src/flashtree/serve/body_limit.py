"""A cap on request body size: a body past it gets 413 before it is read into memory."""

from __future__ import annotations

from fastapi import HTTPException, Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashtree.serve.errors import APIError


class BodySizeLimit:
    """ASGI middleware: a declared Content-Length over `max_bytes` is refused before the body is read; a body
    sent without one (chunked) is refused as soon as what arrived passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes (serve --max-request-mb)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > self.max_bytes:
            await APIError(413, self._message()).response(Request(scope))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # FastAPI passes an HTTPException raised while reading the body on to the error handlers.
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)
