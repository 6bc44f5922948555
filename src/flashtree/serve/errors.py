"""OpenAI-shaped errors: every failure, ours or FastAPI's, leaves as `{"error": {message, type, param, code}}`;
on Anthropic's routes (/v1/messages...) as Anthropic's `{"type": "error", "error": {type, message}}`."""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashtree.errors import FlashtreeError

log = logging.getLogger("flashtree.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "unavailable_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

    def response(self, request: Request | None = None) -> JSONResponse:
        """The error in the shape of the API `request` went to (OpenAI's unless an Anthropic route)."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        anthropic = request is not None and request.url.path.startswith(ANTHROPIC_PREFIX)
        return JSONResponse(self.anthropic_body() if anthropic else self.body(), status_code=self.status,
                            headers=headers)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error envelope."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def _error_responses(model: type[BaseModel]) -> dict:
    """What the routes answer besides success, for the OpenAPI document."""
    return {400: {"model": model, "description": "Invalid request (bad or unsupported parameters, too long a prompt)"},
            401: {"model": model, "description": "Missing or wrong API key"},
            413: {"model": model, "description": "Request body over the server's limit"},
            503: {"model": model, "description": "Model loading, queue full or shutting down"}}


OPENAI_ERRORS = _error_responses(ErrorResponse)
ANTHROPIC_ERRORS = _error_responses(AnthropicErrorResponse)


def document_errors(app: FastAPI) -> None:
    """The OpenAPI document without FastAPI's 422 validation responses: invalid requests get 400 and the error
    envelope (declared on the routers), as every handler here answers."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def _is_field(part: str | int) -> bool:
    """False for the union-member tags pydantic puts in error locations ('str', 'list[str]', ...)."""
    return isinstance(part, int) or (part.isidentifier() and part not in {"str", "int", "float", "bool", "none"})


def _validation_error(exc: RequestValidationError) -> APIError:
    # Only the first problem, and never the offending input: echoing bodies back can be huge.
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": ""}
    if first["type"] == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    loc = [part for part in first["loc"][1:] if _is_field(part)]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    message = first["msg"] if param is None else f"{param}: {first['msg']}"
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request)

    @app.exception_handler(FlashtreeError)
    async def flashtree_error(request: Request, exc: FlashtreeError) -> JSONResponse:
        # Raised for input the user can fix: a template that rejects the messages, token ids out of range.
        return APIError(400, str(exc)).response(request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response(request)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response(request)
