"""Splits Qwen3.5/3.6 output text into reasoning, content and OpenAI tool calls, incrementally.

Qwen writes reasoning as `<think>...</think>` (the template's generation prompt usually opens the
block already) and tool calls as `<tool_call>` blocks holding either XML
(`<function=NAME><parameter=ARG>value</parameter></function>`) or JSON (`{"name", "arguments"}`).
The same parser serves streaming and non-streaming responses, so both always agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
REASONING, CONTENT, TOOL = "reasoning", "content", "tool"

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
# A parameter ends at </parameter>, or (models sometimes omit it) where the next one or the function ends.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=|</function>))", re.DOTALL)


def opens_thinking(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open <think> block (Qwen's default generation prompt)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def reasoning_tokens(token_ids: list[int], tokenizer, parser: OutputParser) -> int:
    """Generated tokens spent reasoning: those before the `</think>` token, or all of them when the reply
    never closed its thinking; none when `parser` (done with this reply) saw no reasoning."""
    if not parser.reasoned:
        return 0
    close = tokenizer.token_id(THINK_CLOSE)
    return token_ids.index(close) if close in token_ids else len(token_ids)


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI streaming `delta.tool_calls` entries

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: Delta) -> None:
        """Accumulate streaming deltas into one complete message (tool-call arguments concatenated)."""
        self.reasoning += other.reasoning
        self.content += other.content
        for part in other.tool_calls:
            if part["index"] < len(self.tool_calls):
                self.tool_calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
            else:
                self.tool_calls.append({k: (dict(v) if isinstance(v, dict) else v) for k, v in part.items()})


@dataclass
class _Call:
    index: int
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    name: str | None = None
    params: int = 0  # parameters already streamed


def _longest_tag_prefix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that could be the start of one of `tags`."""
    for n in range(min(len(text), max((len(t) for t in tags), default=0)), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


def _coerce(value: str, schema: dict | None):
    """Parameter text to the JSON type the tool's schema declares; text that doesn't parse stays a string."""
    kind = (schema or {}).get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds & {None, "string"}:
        return value
    text = value.strip()
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except ValueError:
        return value


class OutputParser:
    """Feed model text with `feed`, end with `finish`; each returns the Delta that is now certain.

    Text that might still turn out to be a tag (a partial `</think>`) or trailing whitespace before a
    section ends is held back, so nothing emitted ever has to be taken back.
    """

    def __init__(self, thinking: bool, tools: dict[str, dict] | None = None):
        """`thinking`: the prompt opened a <think> block. `tools`: name -> JSON schema of its parameters,
        or None to leave <tool_call> text in the content."""
        self._mode = REASONING if thinking else CONTENT
        self._tools = tools
        self._buf = ""
        self._ws = ""  # trailing whitespace of the current section, emitted once more text follows
        self._fresh = True  # the current section has emitted nothing: its leading whitespace is dropped
        self._at_start = True  # nothing emitted at all: a model-written <think> may still open reasoning
        self._calls: list[_Call] = []
        self._out = Delta()
        self.reasoned = False  # some reasoning text came out (for the reasoning token count)

    @property
    def called_tools(self) -> bool:
        return any(c.name for c in self._calls)

    def feed(self, text: str) -> Delta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> Delta:
        return self._run(final=True)

    def _run(self, final: bool) -> Delta:
        self._out = Delta()
        while self._step(final):
            pass
        return self._out

    def _switch(self, mode: str) -> bool:
        self._mode, self._ws, self._fresh = mode, "", True
        return True

    def _step(self, final: bool) -> bool:
        """Consume what the buffer allows in the current mode; True when the mode changed."""
        if self._mode == TOOL:
            return self._tool_step(final)
        if self._mode == CONTENT and self._at_start:
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf = head[len(THINK_OPEN):]
                return self._switch(REASONING)
            if THINK_OPEN.startswith(head) and not final:
                return False
        close = THINK_CLOSE if self._mode == REASONING else CALL_OPEN if self._tools is not None else None
        at = self._buf.find(close) if close else -1
        if at >= 0:
            self._emit(self._buf[:at], end=True)
            self._buf = self._buf[at + len(close):]
            if self._mode == CONTENT:
                self._calls.append(_Call(len(self._calls)))
            return self._switch(CONTENT if self._mode == REASONING else TOOL)
        keep = 0 if final or not close else _longest_tag_prefix(self._buf, (close,))
        self._emit(self._buf[: len(self._buf) - keep], end=final)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _emit(self, text: str, end: bool) -> None:
        if self._fresh:
            text = text.lstrip()
        text = self._ws + text
        body = text.rstrip()
        self._ws = "" if end else text[len(body):]
        if body:
            self._fresh = self._at_start = False
            if self._mode == REASONING:
                self._out.reasoning += body
                self.reasoned = True
            else:
                self._out.content += body

    def _tool_step(self, final: bool) -> bool:
        at = self._buf.find(CALL_CLOSE)
        block = self._buf if at < 0 else self._buf[:at]
        if at < 0 and not final:
            if block.lstrip().startswith("<function="):
                self._stream_xml_call(block, closed=False)
            return False
        if not self._close_call(block):
            # Not a call we can read: keep the text where the user can see it.
            self._out.content += CALL_OPEN + block + (CALL_CLOSE if at >= 0 else "")
            self._calls.pop()
        self._buf = "" if at < 0 else self._buf[at + len(CALL_CLOSE):]
        return self._switch(CONTENT) and at >= 0

    def _close_call(self, block: str) -> bool:
        body = block.strip()
        if body.startswith("{"):
            return self._json_call(body)
        if _FUNCTION.search(block) is None:
            return False
        self._stream_xml_call(block, closed=True)
        return True

    def _stream_xml_call(self, block: str, closed: bool) -> None:
        call = self._calls[-1]
        function = _FUNCTION.search(block)
        if function is None:
            return
        if call.name is None:
            call.name = function[1].strip()
            self._tool_delta(call, name=call.name, arguments="")
        schema = ((self._tools or {}).get(call.name) or {}).get("properties") or {}
        params = list(_PARAMETER.finditer(block + ("</function>" if closed else ""), function.end()))
        for p in params[call.params:]:
            key = p[1].strip()
            value = _coerce(p[2].removeprefix("\n").removesuffix("\n"), schema.get(key))
            prefix = "{" if call.params == 0 else ", "
            self._tool_delta(call, arguments=f"{prefix}{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
            call.params += 1
        if closed:
            self._tool_delta(call, arguments="}" if call.params else "{}")

    def _json_call(self, body: str) -> bool:
        try:
            data = json.loads(body)
        except ValueError:
            return False
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return False
        arguments = data.get("arguments", data.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call = self._calls[-1]
        call.name = data["name"]
        self._tool_delta(call, name=call.name, arguments=arguments)
        return True

    def _tool_delta(self, call: _Call, arguments: str, name: str | None = None) -> None:
        if name is None:
            part = {"index": call.index, "function": {"arguments": arguments}}
        else:
            part = {"index": call.index, "id": call.id, "type": "function",
                    "function": {"name": name, "arguments": arguments}}
        self._out.tool_calls.append(part)
