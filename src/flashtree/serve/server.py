"""What every API of the server shares: the `Server` (the engine once loaded, its scheduler, the serving
options), the request dependencies that find and authorize it, waiting on jobs, and the named-event stream
the Anthropic and Responses APIs use."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from dataclasses import replace
from typing import AsyncIterator, Callable, Sequence

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from flashtree.engine.config import GenerationResult
from flashtree.errors import FlashtreeError
from flashtree.formats.chat_template import ChatTemplate, template_or_chatml
from flashtree.serve.errors import APIError
from flashtree.serve.parsing import OutputParser
from flashtree.serve.protocol import GenerationParams
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


async def wait_for(job: Job, request: Request) -> GenerationResult:
    """The job's result; a client that hangs up meanwhile cancels it."""
    [result] = await wait_all([job], request)
    return result


async def wait_all(jobs: list[Job], request: Request) -> list[GenerationResult]:
    """The jobs' results, in order; a client that hangs up meanwhile cancels them all."""

    async def cancel_on_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel_all(jobs)

    watcher = asyncio.create_task(cancel_on_disconnect())
    try:
        return [await job.wait() for job in jobs]
    finally:
        watcher.cancel()
        cancel_all(jobs)


def cancel_all(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel()


def current_server(request: Request) -> Server:
    return request.app.state.server


def authorized_server(request: Request, server: Server = Depends(current_server)) -> Server:
    if server.api_key is None:
        return server
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(given.strip().encode(), server.api_key.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                       code="invalid_api_key")
    return server


def ready_server(server: Server = Depends(authorized_server)) -> Server:
    server.require_ready()
    return server


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
