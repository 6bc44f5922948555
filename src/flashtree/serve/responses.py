"""OpenAI's Responses API (`POST /v1/responses`), stateless: the request's `input` items become chat template
messages, and the output parser's reasoning / content / tool-call deltas become `reasoning`, `message` and
`function_call` output items, streamed as the API's typed events. Nothing is stored, so
`previous_response_id` is refused; send the conversation in `input`."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, ClassVar, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from flashtree.engine.config import GenerationResult
from flashtree.engine.sampling import SamplingParams
from flashtree.serve.server import Server, flashtree_stats, named_sse, parsed_events, ready_server, wait_for
from flashtree.serve.errors import OPENAI_ERRORS, APIError, unsupported
from flashtree.serve.parsing import Delta, OutputParser, opens_thinking, reasoning_tokens
from flashtree.serve.protocol import Body, RequestBody
from flashtree.serve.scheduler import Job


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    # what Server.submit reads of a request, as of the chat completions body
    ignore_eos: ClassVar[bool] = False
    stop_strings: ClassVar[tuple[str, ...]] = ()

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def logprob_count(self) -> None:
        return None

    def prompt_logprob_count(self) -> None:
        return None

    def sampling(self) -> SamplingParams:
        """An omitted temperature means greedy, as on every flashtree route."""
        return SamplingParams(temperature=self.temperature or 0.0, top_p=self.top_p or 1.0)

    def check_supported(self) -> None:
        if self.previous_response_id:
            raise unsupported("previous_response_id", "responses are not stored: send the whole conversation in input")
        if self.tool_choice == "required" or isinstance(self.tool_choice, dict):
            raise unsupported("tool_choice", "forcing a tool call needs constrained decoding, which is not "
                                             "supported yet: use tool_choice 'auto' or 'none'")
        text_format = (self.text or {}).get("format", {}).get("type", "text")
        if text_format != "text":
            raise unsupported("text", "structured output (text.format) is not supported yet")

    def template_messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for index, item in enumerate(self.input):
            out += _template_messages(item, f"input[{index}]")
        return _merged_tool_calls(out)

    def template_tools(self) -> list[dict] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.parameters or {}}} for t in self.tools]

    def tool_schemas(self) -> dict[str, dict] | None:
        tools = self.template_tools()
        return None if tools is None else {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def template_kwargs(self) -> dict:
        """`reasoning.effort` switches thinking (none or minimal: off; low, medium, high: on); without it the
        server's default holds (--think/--no-think, else the chat template's)."""
        effort = (self.reasoning or {}).get("effort")
        return {} if effort is None else {"enable_thinking": effort not in ("none", "minimal")}


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param=where)
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content: only text parts (input_text, output_text) are supported",
                           param=where)
        parts.append(part["text"])
    return "".join(parts)


def _template_messages(item: dict, where: str) -> list[dict]:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=where)
        return [{"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"), where)}]
    if kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise APIError(400, f"{where}: a function_call needs call_id, name and arguments strings", param=where)
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise APIError(400, f"{where}: a function_call_output needs call_id and output strings", param=where)
        return [{"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}]
    if kind == "reasoning":  # earlier reasoning: the template drops past turns' thinking anyway
        return []
    raise APIError(400, f"{where}: input items of type {kind!r} are not supported", param=where)


def _merged_tool_calls(messages: list[dict]) -> list[dict]:
    """Consecutive function_call items (one assistant turn calling several tools) as one assistant message."""
    out: list[dict] = []
    for message in messages:
        previous = out[-1] if out else None
        if message.get("tool_calls") and previous is not None and previous["role"] == "assistant" \
                and (previous.get("tool_calls") or not previous["content"]):
            previous.setdefault("tool_calls", []).extend(message["tool_calls"])
        else:
            out.append(message)
    return out


def _usage(result: GenerationResult, reasoning: int) -> dict:
    prompt, output = result.stats.prompt_tokens, len(result.token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": result.stats.cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


def _finished(response: dict, result: GenerationResult, output: list[dict], parser: OutputParser, tokenizer) -> dict:
    """The final response object; `parser` is done with the reply (for the reasoning token count)."""
    cut = result.finish_reason != "stop"
    usage = _usage(result, reasoning_tokens(result.token_ids, tokenizer, parser))
    return {**response, "status": "incomplete" if cut else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "usage": usage,
            "flashtree": flashtree_stats(result)}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _items(message: Delta) -> list[dict]:
    items = []
    if message.reasoning:
        items.append({"type": "reasoning", "id": _item_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": message.reasoning}]})
    if message.content:
        items.append({"type": "message", "id": _item_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message.content, "annotations": []}]})
    for call in message.tool_calls:
        items.append({"type": "function_call", "id": _item_id("fc"), "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


class _Stream:
    """The parser's deltas as output items: a new item whenever the kind of output changes, each opened,
    filled by deltas and closed with the events the API defines for its type."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: tuple | None = None  # ("reasoning",), ("message",) or ("function_call", call index)

    def events(self, delta: Delta) -> list[dict]:
        out: list[dict] = []
        if delta.reasoning:
            out += self._switch(("reasoning",), {"type": "reasoning", "id": _item_id("rs"), "summary": [],
                                                 "content": [{"type": "reasoning_text", "text": ""}]})
            out.append(self._text_delta("response.reasoning_text.delta", delta.reasoning))
        if delta.content:
            out += self._switch(("message",), {"type": "message", "id": _item_id("msg"), "status": "in_progress",
                                               "role": "assistant",
                                               "content": [{"type": "output_text", "text": "", "annotations": []}]})
            out.append(self._text_delta("response.output_text.delta", delta.content))
        for part in delta.tool_calls:
            item = {"type": "function_call", "id": _item_id("fc"), "call_id": part.get("id"),
                    "name": part["function"].get("name"), "arguments": "", "status": "in_progress"}
            out += self._switch(("function_call", part["index"]), item)
            if part["function"]["arguments"]:
                current = self.items[-1]
                current["arguments"] += part["function"]["arguments"]
                out.append({"type": "response.function_call_arguments.delta", "item_id": current["id"],
                            "output_index": len(self.items) - 1, "delta": part["function"]["arguments"]})
        return out

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open, item, index = None, self.items[-1], len(self.items) - 1
        out = []
        if item["type"] == "function_call":
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                        "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            out.append({"type": f"response.{kind}.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"]})
            if item["type"] == "message":
                out.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                            "content_index": 0, "part": part})
        if "status" in item:
            item["status"] = "completed"
        return out + [{"type": "response.output_item.done", "output_index": index, "item": item}]

    def _switch(self, kind: tuple, item: dict) -> list[dict]:
        if self.open == kind:
            return []
        out = self.close()
        self.items.append(item)
        self.open = kind
        index = len(self.items) - 1
        shown = {**item, "content": []} if "content" in item else item
        out.append({"type": "response.output_item.added", "output_index": index, "item": shown})
        if item["type"] == "message":
            out.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
        return out

    def _text_delta(self, kind: str, text: str) -> dict:
        item = self.items[-1]
        item["content"][0]["text"] += text
        return {"type": kind, "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0,
                "delta": text}


async def _response_events(job: Job, parser: OutputParser, response: dict, tokenizer) -> AsyncIterator[dict]:
    yield {"type": "response.created", "response": response}
    yield {"type": "response.in_progress", "response": response}
    items = _Stream()
    async for event in parsed_events(job, parser, items):
        yield event
    final = _finished(response, job.result, items.items, parser, tokenizer)
    yield {"type": f"response.{final['status']}", "response": final}


async def _numbered(events: AsyncIterator[dict]) -> AsyncIterator[tuple[str, dict]]:
    """Each event named by its type and numbered in order, as the API's stream is."""
    number = 0
    async for event in events:
        yield event["type"], {**event, "sequence_number": number}
        number += 1


def _error_event(exc: APIError) -> dict:
    return {"type": "error", "code": exc.code or exc.type, "message": exc.message, "param": exc.param}


router = APIRouter(responses=OPENAI_ERRORS)


@router.post("/v1/responses", response_model=None)
async def responses(body: ResponsesRequest, request: Request, server: Server = Depends(ready_server)) -> dict | StreamingResponse:
    server.check_model(body.model)
    body.check_supported()
    prompt, prompt_ids = await server.encode_chat(body.template_messages(), body.template_tools(),
                                                  body.template_kwargs(), what="input")
    response_id = _item_id("resp")
    job = server.submit(prompt_ids, body, "input", response_id)
    parser = OutputParser(opens_thinking(prompt), body.tool_schemas())
    response = {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "model": server.model_name, "output": [], "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "temperature": body.temperature or 0.0,
                "top_p": body.top_p or 1.0, "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
                "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": True, "store": False,
                "previous_response_id": None, "reasoning": body.reasoning, "text": {"format": {"type": "text"}},
                "error": None, "incomplete_details": None, "metadata": body.metadata or {}, "usage": None}
    if body.stream:
        return named_sse(_numbered(_response_events(job, parser, response, server.engine.tokenizer)), job,
                         _error_event)
    result = await wait_for(job, request)
    message = Delta()
    message.add(parser.feed(result.text))
    message.add(parser.finish())
    return _finished(response, result, _items(message), parser, server.engine.tokenizer)
