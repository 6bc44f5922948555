"""OpenAI-compatible HTTP API over one Engine: chat and text completions (streamed or not), models,
health, Prometheus metrics, tokenize/detokenize."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, StreamingResponse

from flashtree.engine.generate import GenerationResult
from flashtree.engine.output import TokenLogprob
from flashtree.errors import FlashtreeError
from flashtree.formats.chat_template import ChatTemplate, template_or_chatml
from flashtree.serve import DEFAULT_MAX_REQUEST_MB
from flashtree.serve.body_limit import BodySizeLimit
from flashtree.serve.errors import OPENAI_ERRORS, APIError, document_errors, install_error_handlers
from flashtree.serve.logprobs import Echo, chat_logprobs, completion_logprobs, joined, token_text
from flashtree.serve.parsing import Delta, OutputParser, opens_thinking, reasoning_tokens
from flashtree.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerationParams,
                                      TokenizeRequest)
from flashtree.serve.scheduler import Job, Metrics, Scheduler

log = logging.getLogger("flashtree.serve")

# Keys the template renderer sets itself; letting chat_template_kwargs override them would break rendering.
_RESERVED_TEMPLATE_KEYS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


class Server:
    """What the routes share: the engine once loaded, its scheduler, and the serving options."""

    def __init__(self, engine, model_name: str, api_key: str | None, queue_size: int, request_timeout: float,
                 shutdown_timeout: float, parse_special: bool = False):
        if queue_size < 1:
            raise FlashtreeError(f"the queue must hold at least 1 request, got {queue_size}")
        if api_key == "":  # an empty key would let every request in while looking like auth is on
            raise FlashtreeError("the API key is empty: give a non-empty --api-key (or $FLASHTREE_API_KEY), or none")
        # Anything without `generate` is a factory, loaded in the background so /health can say "loading".
        self._factory: Callable | None = None if hasattr(engine, "generate") else engine
        self.engine = None if self._factory else engine
        self.model_name = model_name
        self.api_key = api_key
        self.parse_special = parse_special
        self.queue_size = queue_size
        self.request_timeout = request_timeout
        self.shutdown_timeout = shutdown_timeout
        self.metrics = Metrics()
        self.scheduler: Scheduler | None = None
        self.template: ChatTemplate | None = None
        self.template_kwargs: dict = {}  # server-wide defaults (enable_thinking), under each request's own
        self.status = "loading"
        self.load_error = ""
        self.created = int(time.time())

    def start(self) -> None:
        if self._factory is None:
            self._ready(self.engine)
        else:
            threading.Thread(target=self._load, name="flashtree-load", daemon=True).start()

    def _load(self) -> None:
        try:
            self._ready(self._factory())
        except FlashtreeError as exc:  # a known problem: its message says what to do
            log.error("loading the model failed: %s", exc)
            self.load_error, self.status = str(exc), "failed"
        except Exception as exc:
            log.exception("loading the model failed")
            self.load_error, self.status = f"{type(exc).__name__}: {exc}", "failed"

    def _ready(self, engine) -> None:
        self.engine = engine
        self.template = template_or_chatml(engine.target.chat_template)
        self.scheduler = Scheduler(engine, self.queue_size, self.metrics)
        self.status = "ready"

    def stop(self) -> None:
        self.status = "stopping"
        if self.scheduler is not None:
            self.scheduler.shutdown(self.shutdown_timeout)

    def require_ready(self) -> None:
        if self.status == "loading":
            raise APIError(503, "Loading model", retry_after=5)
        if self.status == "failed":
            raise APIError(503, f"the model failed to load: {self.load_error}")
        if self.status == "stopping":
            raise APIError(503, "the server is shutting down")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    @property
    def context_limit(self) -> int:
        return self.engine.default_config.ctx or self.engine.target.config.context_length

    async def encode_chat(self, messages: list[dict], tools: list[dict] | None, kwargs: dict | None,
                          add_generation_prompt: bool = True, what: str | None = None) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids, made off the event loop (a long prompt takes seconds). With
        `what` (routes that generate), a prompt longer than the context is refused before it is tokenized
        whenever its length alone shows that."""
        for key in kwargs or ():
            if key in _RESERVED_TEMPLATE_KEYS:
                raise APIError(400, f"chat_template_kwargs may not set {key!r}", param="chat_template_kwargs")
        tokenizer = self.engine.tokenizer

        def encode() -> tuple[str, list[int]]:
            chat = tokenizer.render_chat(self.template, messages, tools, add_generation_prompt, self.parse_special,
                                         **{**self.template_kwargs, **(kwargs or {})})
            if what is not None:
                self.check_context(tokenizer.min_tokens(chat.escaped), what, at_least=True)
            return chat.text, tokenizer.encode_rendered(chat)

        return await run_in_threadpool(encode)

    async def encode_text(self, text: str, what: str | None = None) -> list[int]:
        """`encode_chat` for a plain text."""
        tokenizer = self.engine.tokenizer
        if what is not None:
            self.check_context(tokenizer.min_tokens(text), what, at_least=True)
        return await run_in_threadpool(tokenizer.encode, text, self.parse_special)

    def check_context(self, prompt: int, what: str, at_least: bool = False) -> None:
        """A prompt of `prompt` tokens (`at_least` that many) must leave room for one generated token."""
        limit = self.context_limit
        # OpenAI's wording: agent clients match it to trigger history compaction.
        if prompt >= limit:
            count = f"at least {prompt}" if at_least else str(prompt)
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your {what} "
                                f"resulted in {count} tokens. Please reduce the length of the {what}.",
                           param=what, code="context_length_exceeded")

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams, what: str, request_id: str = "") -> Job:
        [job] = self.submit_choices(prompt_ids, params, what, request_id, 1)
        return job

    def submit_choices(self, prompt_ids: Sequence[int], params: GenerationParams, what: str, request_id: str,
                       n: int) -> list[Job]:
        """`n` generations of one prompt (OpenAI's `n`), queued together; with a `seed`, choice i uses seed + i."""
        requested = params.requested_max_tokens()
        sampling = params.sampling()
        vocab = self.engine.tokenizer.vocab_size
        if any(token >= vocab for token, _ in sampling.logit_bias):
            raise APIError(400, f"logit_bias names a token id outside the vocabulary [0, {vocab})", param="logit_bias")
        config = self.engine.config_for(max_new_tokens=requested, stop=params.stop_strings, sampling=sampling,
                                        ignore_eos=params.ignore_eos or None, logprobs=params.logprob_count(),
                                        prompt_logprobs=params.prompt_logprob_count())
        limit, prompt = self.context_limit, len(prompt_ids)
        self.check_context(prompt, what)
        if requested is not None and prompt + requested > limit:
            # Only a max_tokens the client asked for is refused; the server's default is cut to what fits.
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt + requested} tokens ({prompt} in the {what}, {requested} in the completion). "
                                f"Please reduce the length of the {what} or completion.",
                           param="max_tokens", code="context_length_exceeded")
        seed = config.sampling.seed
        configs = [config if seed is None else replace(config, sampling=replace(config.sampling, seed=seed + i))
                   for i in range(n)]
        jobs = [Job(prompt_ids, c, self.request_timeout, request_id) for c in configs]
        self.scheduler.submit(*jobs)
        return jobs


@dataclass
class Reply:
    """Fields every body or chunk of one response shares."""

    object: str  # "chat.completion" or "text_completion"
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return f"{'chatcmpl' if self.object == 'chat.completion' else 'cmpl'}-{self.id}"

    def body(self, choices: list[dict], chunk: bool = False, **extra) -> dict:
        name = f"{self.object}.chunk" if chunk and self.object == "chat.completion" else self.object
        return {"id": self.response_id, "object": name, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def _usage(results: list[GenerationResult], parsers: list[OutputParser] = (), tokenizer=None) -> dict:
    """One prompt (counted once, as OpenAI does for `n` > 1) and every choice's completion; with the chat
    choices' `parsers` (done with their replies), the reasoning tokens among them."""
    prompt, completion = results[0].stats.prompt_tokens, sum(len(r.token_ids) for r in results)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": results[0].stats.cached_tokens}}
    if parsers:
        reasoning = sum(reasoning_tokens(r.token_ids, tokenizer, p) for r, p in zip(results, parsers))
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def flashtree_stats(result: GenerationResult) -> dict:
    """The `flashtree` field of a response: this request's speculative-decoding stats."""
    stats = result.stats
    return {"tokens": stats.new_tokens, "tokens_per_s": round(stats.tokens_per_s, 3),
            "acceptance_length": round(stats.acceptance_length, 4),
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "acceptance_histogram": {str(k): v for k, v in sorted(stats.accepted.items())},
            "prompt_tokens": stats.prompt_tokens, "cached_tokens": stats.cached_tokens, "steps": stats.steps,
            "prefill_s": round(stats.prefill_s, 6),
            "decode_s": round(stats.decode_s, 6), "draft_s": round(stats.draft_s, 6),
            "verify_s": round(stats.verify_s, 6), "total_s": round(stats.total_s, 6)}


def _finish_reason(result: GenerationResult, called_tools: bool = False) -> str:
    if result.finish_reason == "stop":
        return "tool_calls" if called_tools else "stop"
    return "length"  # "length", or "cancelled" by the per-request timeout: the reply was cut short either way


def _message_delta(delta: Delta) -> dict:
    out: dict = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = delta.tool_calls
    return out


async def wait_for(job: Job, request: Request) -> GenerationResult:
    """The job's result; a client that hangs up meanwhile cancels it."""
    [result] = await _wait_all([job], request)
    return result


async def _wait_all(jobs: list[Job], request: Request) -> list[GenerationResult]:
    """The jobs' results, in order; a client that hangs up meanwhile cancels them all."""

    async def cancel_on_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        _cancel(jobs)

    watcher = asyncio.create_task(cancel_on_disconnect())
    try:
        return [await job.wait() for job in jobs]
    finally:
        watcher.cancel()
        _cancel(jobs)


def _cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel()


def _sse(events: AsyncIterator[dict], jobs: list[Job]) -> StreamingResponse:
    async def stream() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except APIError as exc:  # headers are out: a failure can only be reported as an event
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception as exc:
            log.exception("streaming failed")
            yield f"data: {json.dumps(APIError(500, f'internal error: {type(exc).__name__}').body())}\n\n"
        finally:
            _cancel(jobs)  # a client that hung up closes this generator: stop generating for it
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _server(request: Request) -> Server:
    return request.app.state.server


def _authorized(request: Request, server: Server = Depends(_server)) -> Server:
    if server.api_key is None:
        return server
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(given.strip().encode(), server.api_key.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                       code="invalid_api_key")
    return server


def ready_server(server: Server = Depends(_authorized)) -> Server:
    server.require_ready()
    return server


public = APIRouter(responses={503: OPENAI_ERRORS[503]})
api = APIRouter(responses=OPENAI_ERRORS)


@public.get("/health")
def health(server: Server = Depends(_server)) -> dict:
    server.require_ready()
    return {"status": "ok"}


@api.get("/v1/models")
def models(server: Server = Depends(_authorized)) -> dict:
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                        "owned_by": "flashtree"}]}


@api.get("/metrics", response_class=PlainTextResponse)
def metrics(server: Server = Depends(_authorized)) -> PlainTextResponse:
    scheduler = server.scheduler
    waiting = scheduler.waiting if scheduler else 0
    running = int(scheduler is not None and scheduler.running is not None)
    text = server.metrics.render(waiting, running)
    prefix_cache = getattr(server.engine, "prefix_cache", None)
    if prefix_cache is not None:
        text += prefix_cache.metrics()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@api.post("/tokenize")
async def tokenize(body: TokenizeRequest, server: Server = Depends(ready_server)) -> dict:
    server.check_model(body.model)
    if body.messages is None:
        ids = await server.encode_text(body.prompt)
    else:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        _, ids = await server.encode_chat([m.for_template() for m in body.messages], tools, body.chat_template_kwargs,
                                          body.add_generation_prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": server.context_limit}


@api.post("/detokenize")
def detokenize(body: DetokenizeRequest, server: Server = Depends(ready_server)) -> dict:
    server.check_model(body.model)
    return {"prompt": server.engine.tokenizer.decode(body.tokens)}


def named_sse(events: AsyncIterator[tuple[str, dict]], job: Job, error_body: Callable[[APIError], dict]) -> StreamingResponse:
    """Server-sent events with names (`event: NAME`), as Anthropic's and the Responses API's streams are; a
    failure once the headers are out goes as an `error` event shaped by `error_body`."""

    async def stream() -> AsyncIterator[str]:
        try:
            async for name, data in events:
                yield f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
        except Exception as exc:
            if not isinstance(exc, APIError):
                log.exception("streaming failed")
                exc = APIError(500, f"internal error: {type(exc).__name__}")
            yield f"event: error\ndata: {json.dumps(error_body(exc))}\n\n"
        finally:
            job.cancel()  # a client that hung up closes this generator: stop generating for it

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def parsed_events(job: Job, parser: OutputParser, stream) -> AsyncIterator:
    """The job's text through the output parser into `stream` (an API's item builder with `events(delta)`
    and `close()`), whose events come out as they are made."""
    async for piece in job.texts():
        for event in stream.events(parser.feed(piece)):
            yield event
    for event in stream.events(parser.finish()) + stream.close():
        yield event


@api.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           server: Server = Depends(ready_server)) -> dict | StreamingResponse:
    server.check_model(body.model)
    body.check_supported()
    prompt, prompt_ids = await server.encode_chat([m.for_template() for m in body.messages], body.template_tools(),
                                                  body.chat_template_kwargs, what="messages")
    reply = Reply("chat.completion", server.model_name)
    jobs = server.submit_choices(prompt_ids, body, "messages", reply.response_id, body.n)
    parsers = [OutputParser(opens_thinking(prompt), body.tool_schemas()) for _ in jobs]
    tokenizer = server.engine.tokenizer
    if body.stream:
        return _sse(_chat_stream(jobs, parsers, reply, body.include_usage, tokenizer), jobs)
    results = await _wait_all(jobs, request)
    choices = [_chat_choice(i, result, parser, tokenizer) for i, (result, parser) in enumerate(zip(results, parsers))]
    return reply.body(choices, usage=_usage(results, parsers, tokenizer), flashtree=_flashtree_field(results))


def _chat_choice(index: int, result: GenerationResult, parser: OutputParser, tokenizer) -> dict:
    message = Delta()
    message.add(parser.feed(result.text))
    message.add(parser.finish())
    logprobs = None if result.logprobs is None else chat_logprobs(tokenizer, result.logprobs)
    choice = {"index": index, "message": {"role": "assistant", "content": message.content or None,
                                          "reasoning_content": message.reasoning or None},
              "logprobs": logprobs, "finish_reason": _finish_reason(result, parser.called_tools)}
    if message.tool_calls:
        choice["message"]["tool_calls"] = [{k: v for k, v in call.items() if k != "index"}
                                           for call in message.tool_calls]
    return choice


def _flashtree_field(results: list[GenerationResult]) -> dict | list[dict]:
    """One request's stats; a list of them, per choice, when it asked for several (`n`)."""
    stats = [flashtree_stats(result) for result in results]
    return stats[0] if len(stats) == 1 else stats


async def _chat_stream(jobs: list[Job], parsers: list[OutputParser], reply: Reply, include_usage: bool,
                       tokenizer) -> AsyncIterator[dict]:
    """Each choice's chunks in turn (they are generated one after another), then the usage."""
    for index, (job, parser) in enumerate(zip(jobs, parsers)):
        async for chunk in _chat_chunks(index, job, parser, reply, tokenizer):
            yield chunk
    if include_usage:
        yield reply.body([], chunk=True, usage=_usage([job.result for job in jobs], parsers, tokenizer))


async def _chat_chunks(index: int, job: Job, parser: OutputParser, reply: Reply, tokenizer) -> AsyncIterator[dict]:
    pending: list[TokenLogprob] = []  # entries of text the parser holds back, sent with the next chunk

    def choice(delta: dict, finish_reason: str | None = None) -> list[dict]:
        logprobs = chat_logprobs(tokenizer, pending) if pending else None
        pending.clear()
        return [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]

    yield reply.body(choice({"role": "assistant", "content": ""}), chunk=True)
    async for piece, entries in job.pieces():
        pending += entries
        if delta := parser.feed(piece):
            yield reply.body(choice(_message_delta(delta)), chunk=True)
    if delta := parser.finish():
        yield reply.body(choice(_message_delta(delta)), chunk=True)
    result = job.result
    yield reply.body(choice({}, _finish_reason(result, parser.called_tools)), chunk=True,
                     flashtree=flashtree_stats(result))


@api.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request,
                      server: Server = Depends(ready_server)) -> dict | StreamingResponse:
    server.check_model(body.model)
    body.check_supported()
    tokenizer = server.engine.tokenizer
    if isinstance(body.prompt, str):
        prompt_ids = await server.encode_text(body.prompt, "prompt")
    elif all(0 <= t < tokenizer.vocab_size for t in body.prompt):
        prompt_ids = body.prompt
    else:
        raise APIError(400, f"prompt token ids must lie in [0, {tokenizer.vocab_size})", param="prompt")
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    reply = Reply("text_completion", server.model_name)
    jobs = server.submit_choices(prompt_ids, body, "prompt", reply.response_id, body.n)
    echo = Echo(body.prompt if isinstance(body.prompt, str) else tokenizer.decode(prompt_ids), prompt_ids) \
        if body.echo else None
    if body.stream:
        return _sse(_completion_stream(jobs, reply, body.include_usage, tokenizer, echo), jobs)
    results = await _wait_all(jobs, request)
    choices = [_completion_choice(i, result, tokenizer, echo) for i, result in enumerate(results)]
    return reply.body(choices, usage=_usage(results), flashtree=_flashtree_field(results))


def _completion_choice(index: int, result: GenerationResult, tokenizer, echo: Echo | None) -> dict:
    logprobs = None if result.logprobs is None else completion_logprobs(tokenizer, result.logprobs, 0)
    text = result.text
    if echo is not None:
        if logprobs is not None:
            logprobs = joined(echo.logprobs(tokenizer, result.prompt_logprobs), logprobs)
        text = echo.text + text
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish_reason(result)}


async def _completion_stream(jobs: list[Job], reply: Reply, include_usage: bool, tokenizer,
                             echo: Echo | None) -> AsyncIterator[dict]:
    for index, job in enumerate(jobs):
        async for chunk in _completion_chunks(index, job, reply, tokenizer, echo):
            yield chunk
    if include_usage:
        yield reply.body([], chunk=True, usage=_usage([job.result for job in jobs]))


async def _completion_chunks(index: int, job: Job, reply: Reply, tokenizer, echo: Echo | None) -> AsyncIterator[dict]:
    offset = 0

    def choice(text: str, finish_reason: str | None = None, entries: list[TokenLogprob] = ()) -> list[dict]:
        logprobs = completion_logprobs(tokenizer, entries, offset) if entries else None
        return [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]

    if echo is not None:
        yield reply.body(choice(echo.text), chunk=True)
        offset = len(echo.text)
    async for piece, entries in job.pieces():
        yield reply.body(choice(piece, entries=entries), chunk=True)
        offset += sum(len(token_text(tokenizer, e.token)[0]) for e in entries)
    yield reply.body(choice("", _finish_reason(job.result)), chunk=True, flashtree=flashtree_stats(job.result))


def build_app(engine, model_name: str, api_key: str | None = None, queue_size: int = 16,
              request_timeout: float = 600.0, shutdown_timeout: float = 30.0,
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
    from flashtree.serve.anthropic import router as anthropic  # their routes use this module's dependencies
    from flashtree.serve.responses import router as responses

    app.include_router(anthropic)
    app.include_router(responses)
    document_errors(app)
    return app
