"""Typed OpenAI request bodies, and the checks that turn what we can't honour into a clear 400."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from flashtree.engine.sampling import INT64_MAX, SamplingParams
from flashtree.serve.errors import APIError, unsupported

MAX_STOP_STRINGS = 4  # OpenAI's limit for `stop`
MAX_STOP_CHARS = 256  # each stop string is matched against the output after every token


def bounded_stops(stops: list[str], limit: int) -> list[str]:
    """`stops` if there are at most `limit` of them, each 1 to MAX_STOP_CHARS characters long."""
    if len(stops) > limit:
        raise PydanticCustomError("too_many_stops", "at most {limit} stop strings are allowed, got {count}",
                                  {"limit": limit, "count": len(stops)})
    if any(not 0 < len(stop) <= MAX_STOP_CHARS for stop in stops):
        raise PydanticCustomError("stop_length", "each stop string must hold 1 to {chars} characters",
                                  {"chars": MAX_STOP_CHARS})
    return stops


_SCALARS = {int, float, bool, type(None)}  # JSON values that hold no text


def _is_utf8(text: str) -> bool:
    """False for text with a lone surrogate (JSON's \\ud800 escapes can spell one), which UTF-8 cannot encode."""
    if text.isascii():  # the common case, at memory speed
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_path(data: Any) -> str | None:
    """Where in a parsed JSON body a string (or key) holds a lone surrogate ("" for the body itself); None if nowhere."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _is_utf8(item):
                return path
        elif isinstance(item, dict):
            for key, value in item.items():
                stack += [(path, key), (f"{path}.{key}".lstrip("."), value)]
        elif isinstance(item, list) and not set(map(type, item)) <= _SCALARS:  # a list of ids is passed at C speed
            stack += [(f"{path}[{index}]", value) for index, value in enumerate(item)]
    return None


class Body(BaseModel):
    # Strict types, as OpenAI checks them ("stream": "yes" is an error, not True); unknown keys are ignored,
    # as OpenAI-compatible servers do for client-specific extras. JSON's Infinity and NaN are no numbers.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class RequestBody(Body):
    """A whole request: all its text must be valid Unicode (what the tokenizer and the JSON reply can hold)."""

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        path = _surrogate_path(data)
        if path is not None:
            raise APIError(400, f"{path or 'the request'} holds a lone UTF-16 surrogate (such as \\ud800), which is "
                                f"not text: send valid UTF-8", param=path or None)
        return data


class StreamOptions(Body):
    include_usage: bool = False


class GenerationParams(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    n: int = Field(1, ge=1, le=16)  # choices, generated one after another
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False  # vLLM's extension: keep generating past end-of-generation tokens
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        return stop if stop is None else bounded_stops([stop] if isinstance(stop, str) else stop, MAX_STOP_STRINGS)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """None: no log-probabilities; k: each token's, with the k most likely alternatives."""
        return None

    def prompt_logprob_count(self) -> int | None:
        """The same for the prompt's tokens."""
        return None

    def sampling(self) -> SamplingParams:
        """The engine's sampling parameters. An omitted temperature means greedy (0), not OpenAI's 1:
        identical-to-greedy output is what a local speculative server is run for (docs/SERVING.md)."""
        return SamplingParams(
            temperature=self.temperature or 0.0, top_p=self.top_p or 1.0,
            top_k=max(self.top_k or 0, 0), min_p=self.min_p or 0.0, seed=self.seed,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self._logit_bias(),
        )

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        entries = []
        for key, value in (self.logit_bias or {}).items():
            # Python refuses int() of over 4300 digits; no vocabulary reaches 10 digits
            if not (key.isascii() and key.isdigit() and len(key) < 10) or not -100 <= value <= 100:
                shown = key if len(key) <= 20 else key[:20] + "..."
                raise APIError(400, f"logit_bias maps token ids (ASCII digits) to biases in [-100, 100], got "
                                    f"{shown!r}: {value}", param="logit_bias")
            entries.append((int(key), float(value)))
        return tuple(entries)

    def check_supported(self) -> None:
        """Reject parameters flashtree can't honour yet."""


class CompletionRequest(GenerationParams):
    prompt: str | Annotated[list[int], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.logprobs is not None and self.stream:
            raise unsupported("echo", "the prompt's logprobs (echo with logprobs) come with non-streaming requests only")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 generates nothing: it is for scoring a prompt with echo", param="max_tokens")
        if self.suffix:
            raise unsupported("suffix", "suffix (fill-in-the-middle) is not supported")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "only best_of=1 is supported")


class FunctionCall(Body):
    name: str
    arguments: str = "{}"


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            return "".join(part["text"] for part in content)
        return content

    def for_template(self) -> dict:
        message = self.model_dump(exclude_none=True)
        # "developer" is OpenAI's newer name for the system role; Qwen templates only know "system".
        if message["role"] == "developer":
            message["role"] = "system"
        return message


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatCompletionRequest(GenerationParams):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise unsupported("response_format", "structured output (response_format) is not supported yet")
        if self.tool_choice == "required" or isinstance(self.tool_choice, dict):
            raise unsupported("tool_choice", "forcing a tool call needs constrained decoding, which is not "
                                             "supported yet: use tool_choice 'auto' or 'none'")

    def template_tools(self) -> list[dict] | None:
        """Tools shown to the model; with tool_choice 'none' the model isn't told about them at all."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_schemas(self) -> dict[str, dict] | None:
        """name -> parameters schema for the output parser; None turns tool-call parsing off."""
        tools = self.template_tools()
        return None if tools is None else {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


class TokenizeRequest(RequestBody):
    """Either raw text (`prompt`, or llama.cpp's `content`) or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = Field(None, validation_alias=AliasChoices("prompt", "content"))
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
