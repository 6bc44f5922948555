"""The OpenAI API: chat completions, completions, models, tokenize / detokenize, health and metrics."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from flashtree.engine.config import GenerationResult
from flashtree.engine.output import TokenLogprob
from flashtree.serve.errors import OPENAI_ERRORS, APIError
from flashtree.serve.logprobs import Echo, chat_logprobs, completion_logprobs, joined, token_text
from flashtree.serve.parsing import Delta, OutputParser, opens_thinking, reasoning_tokens
from flashtree.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from flashtree.serve.scheduler import Job
from flashtree.serve.server import (Server, authorized_server, cancel_all, current_server, flashtree_stats,
                                    ready_server, wait_all)

log = logging.getLogger("flashtree.serve")


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
            cancel_all(jobs)  # a client that hung up closes this generator: stop generating for it
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


public = APIRouter(responses={503: OPENAI_ERRORS[503]})
api = APIRouter(responses=OPENAI_ERRORS)


@public.get("/health")
def health(server: Server = Depends(current_server)) -> dict:
    server.require_ready()
    return {"status": "ok"}


@api.get("/v1/models")
def models(server: Server = Depends(authorized_server)) -> dict:
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                        "owned_by": "flashtree"}]}


@api.get("/metrics", response_class=PlainTextResponse)
def metrics(server: Server = Depends(authorized_server)) -> PlainTextResponse:
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
    results = await wait_all(jobs, request)
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
    results = await wait_all(jobs, request)
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
