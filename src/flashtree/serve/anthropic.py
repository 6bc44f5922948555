"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), what Claude Code and
other Anthropic clients speak, over the same engine, chat template and output parser as the OpenAI routes:
requests become template messages, the parser's reasoning / content / tool-call deltas become `thinking`,
`text` and `tool_use` content blocks, streamed as Anthropic's named SSE events."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, AsyncIterator, ClassVar, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator

from flashtree.engine.config import GenerationResult
from flashtree.engine.sampling import SamplingParams
from flashtree.serve.server import Server, flashtree_stats, named_sse, parsed_events, ready_server, wait_for
from flashtree.serve.errors import ANTHROPIC_ERRORS, APIError, unsupported
from flashtree.serve.parsing import Delta, OutputParser, opens_thinking
from flashtree.serve.protocol import Body, RequestBody, bounded_stops
from flashtree.serve.scheduler import Job


class TextBlock(Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or ())
        return f"Error: {body}" if self.is_error else body


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


class ToolDef(Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class ThinkingConfig(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


# Anthropic documents no limit; each stop sequence is matched against the output after every token.
MAX_STOP_SEQUENCES = 16


class MessagesInput(RequestBody):
    """What a prompt is made of: the fields /v1/messages and /v1/messages/count_tokens share."""

    model: str | None = None  # any name is accepted: Claude Code asks for its own model names
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None

    def check_supported(self) -> None:
        kind = (self.tool_choice or {}).get("type", "auto")
        if kind in ("any", "tool"):
            raise unsupported("tool_choice", "forcing a tool call needs constrained decoding, which is not "
                                             "supported yet: use tool_choice auto or none")

    def template_messages(self) -> list[dict]:
        """The conversation as the chat template's (OpenAI-style) messages: tool results become `tool`
        messages, tool uses `tool_calls`, thinking `reasoning_content`."""
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for message in self.messages:
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "user":
                out += _user_messages(message.content)
            else:
                out.append(_assistant_message(message.content))
        return out

    def template_tools(self) -> list[dict] | None:
        if not self.tools or (self.tool_choice or {}).get("type") == "none":
            return None
        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.input_schema}} for t in self.tools]

    def tool_schemas(self) -> dict[str, dict] | None:
        tools = self.template_tools()
        return None if tools is None else {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def template_kwargs(self) -> dict:
        """`thinking` switches it ("enabled" or "adaptive" on, "disabled" off); without the field the server's
        default holds (--think/--no-think, else the chat template's), as on the OpenAI routes."""
        return {} if self.thinking is None else {"enable_thinking": self.thinking.type != "disabled"}


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None

    ignore_eos: ClassVar[bool] = False  # what Server.submit reads of a request, as of the OpenAI bodies

    @field_validator("stop_sequences")
    @classmethod
    def _bounded_stop_sequences(cls, stops: list[str] | None) -> list[str] | None:
        return stops if stops is None else bounded_stops(stops, MAX_STOP_SEQUENCES)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    def requested_max_tokens(self) -> int:
        return self.max_tokens

    def logprob_count(self) -> None:  # the Messages API has no log-probabilities
        return None

    def prompt_logprob_count(self) -> None:
        return None

    def sampling(self) -> SamplingParams:
        """An omitted temperature means greedy, as on the OpenAI routes (not Anthropic's 1.0)."""
        return SamplingParams(temperature=self.temperature or 0.0, top_p=self.top_p or 1.0, top_k=self.top_k or 0)


def _user_messages(blocks: list) -> list[dict]:
    out, text = [], []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            raise APIError(400, f"a user message cannot hold a {block.type} block", param="messages")
    return out + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant_message(blocks: list) -> dict:
    message: dict = {"role": "assistant", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
    reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if any(isinstance(b, ToolResultBlock) for b in blocks):
        raise APIError(400, "an assistant message cannot hold a tool_result block", param="messages")
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _stop_reason(result: GenerationResult, called_tools: bool) -> str:
    if called_tools:
        return "tool_use"
    if result.finish_reason == "stop":
        return "stop_sequence" if result.stop_string is not None else "end_turn"
    return "max_tokens"  # "length", or cancelled by the per-request timeout


def _usage(result: GenerationResult) -> dict:
    """Anthropic's split: `input_tokens` are the prompt tokens prefilled, `cache_read_input_tokens` those the
    prefix cache restored."""
    cached = result.stats.cached_tokens
    return {"input_tokens": result.stats.prompt_tokens - cached, "cache_read_input_tokens": cached,
            "output_tokens": len(result.token_ids)}


def _blocks(message: Delta) -> list[dict]:
    blocks = []
    if message.reasoning:
        blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks


class _Stream:
    """Turns the parser's deltas into Anthropic's content-block events, opening a new block whenever the
    kind of output changes (thinking, text, each tool call)."""

    def __init__(self):
        self.index = -1
        self.open: tuple | None = None  # ("thinking",), ("text",) or ("tool_use", call index)

    def events(self, delta: Delta) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if delta.reasoning:
            out += self._switch(("thinking",), {"type": "thinking", "thinking": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            out += self._switch(("text",), {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta.content}))
        for part in delta.tool_calls:
            start = {"type": "tool_use", "id": part.get("id"), "name": part["function"].get("name"), "input": {}}
            out += self._switch(("tool_use", part["index"]), start)
            if part["function"]["arguments"]:
                out.append(self._delta({"type": "input_json_delta", "partial_json": part["function"]["arguments"]}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _switch(self, kind: tuple, block: dict) -> list[tuple[str, dict]]:
        if self.open == kind:
            return []
        out = self.close()
        self.index, self.open = self.index + 1, kind
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}


async def _message_events(job: Job, parser: OutputParser, message: dict) -> AsyncIterator[tuple[str, dict]]:
    yield "message_start", {"type": "message_start", "message": message}
    async for event in parsed_events(job, parser, _Stream()):
        yield event
    result = job.result
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": _stop_reason(result, parser.called_tools),
                                      "stop_sequence": result.stop_string},
                            "usage": _usage(result), "flashtree": flashtree_stats(result)}
    yield "message_stop", {"type": "message_stop"}


router = APIRouter(responses=ANTHROPIC_ERRORS)


async def _prompt(server: Server, body: MessagesInput, what: str | None = None) -> tuple[str, list[int]]:
    body.check_supported()
    return await server.encode_chat(body.template_messages(), body.template_tools(), body.template_kwargs(), what=what)


@router.post("/v1/messages", response_model=None)
async def messages(body: MessagesRequest, request: Request, server: Server = Depends(ready_server)) -> dict | StreamingResponse:
    prompt, prompt_ids = await _prompt(server, body, "messages")
    message_id = f"msg_{uuid.uuid4().hex}"
    job = server.submit(prompt_ids, body, "messages", message_id)
    parser = OutputParser(opens_thinking(prompt), body.tool_schemas())
    message = {"id": message_id, "type": "message", "role": "assistant", "model": server.model_name, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}
    if body.stream:
        return named_sse(_message_events(job, parser, message), job, APIError.anthropic_body)
    result = await wait_for(job, request)
    reply = Delta()
    reply.add(parser.feed(result.text))
    reply.add(parser.finish())
    return {**message, "content": _blocks(reply), "stop_reason": _stop_reason(result, parser.called_tools),
            "stop_sequence": result.stop_string, "usage": _usage(result), "flashtree": flashtree_stats(result)}


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesInput, server: Server = Depends(ready_server)) -> dict:
    _, prompt_ids = await _prompt(server, body)
    return {"input_tokens": len(prompt_ids)}
