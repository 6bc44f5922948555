"""Jinja chat templates (GGUF `tokenizer.chat_template`), rendered the way transformers renders them."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flashtree.errors import FlashtreeError

# Small ChatML template for synthetic tokenizers. It frames turns, thinking, <tool_call> blocks and
# tool responses exactly like the Qwen3.5 template (so one parser serves both), with a shorter tools
# preamble and text-only content. Assistant reasoning (reasoning_content, or a <think> block inline in
# the content) is kept only after the last user turn, as in Qwen.
CHATML_TEMPLATE = """\
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou may call these functions:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call one, reply with:\\n<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>' }}
    {%- if messages[0].role == 'system' %}
        {{- '\\n\\n' + messages[0].content | trim }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content | trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- set content = (m.content or '') | trim %}
    {%- if m.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = m.reasoning_content %}
        {%- if reasoning is not string and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_user %}
            {{- '<think>\\n' + (reasoning or '') | trim + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in m.tool_calls or [] %}
            {%- set fn = call.function or call %}
            {%- if not loop.first %}
                {{- '\\n' }}
            {%- elif content %}
                {{- '\\n\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n<function=' + fn.name + '>\\n' }}
            {%- for name, value in (fn.arguments or {}) | items %}
                {{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif m.role != 'system' or not loop.first %}
        {{- raise_exception('Unexpected message role ' + m.role + ' at position ' + loop.index0 | string) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n<think>\\n' }}
    {%- if enable_thinking is false %}
        {{- '\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# ChatML for models trained on answers alone (the toy targets `flashtree train` makes, the embedded demo
# among them): the generation prompt closes the think block unless enable_thinking is true. Such a model
# never writes </think> itself, so with Qwen's default (thinking on) its whole reply would be reasoning.
ANSWER_FIRST_TEMPLATE = CHATML_TEMPLATE.replace("{%- if enable_thinking is false %}",
                                                "{%- if enable_thinking is not true %}")

# Other names clients use for the assistant's reasoning; templates read `reasoning_content`.
_REASONING_ALIASES = ("reasoning", "thinking")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>', '&' and "'"; HF templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _normalize_message(message: dict) -> dict:
    """Copy of an OpenAI-style message in the shape templates expect, leaving the caller's dict alone."""
    message = dict(message)
    if message.get("reasoning_content") is None:
        alias = next((message[k] for k in _REASONING_ALIASES if message.get(k) is not None), None)
        if alias is not None:
            message["reasoning_content"] = alias
    if message.get("tool_calls"):
        message["tool_calls"] = [_normalize_tool_call(call) for call in message["tool_calls"]]
    return message


def _normalize_tool_call(call: dict) -> dict:
    # OpenAI clients send function.arguments as JSON text, but templates iterate it as a mapping.
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class ChatTemplate:
    """A compiled chat template, sandboxed like transformers' `apply_chat_template`."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise FlashtreeError(f"chat template syntax error at line {e.lineno}: {e.message}") from e
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Prompt text for `messages`; extra keyword arguments (e.g. enable_thinking) go to the template."""
        try:
            return self._template.render(
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
                messages=[_normalize_message(m) for m in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:
            raise FlashtreeError(f"chat template error: {e.message or type(e).__name__}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # Messages of an unexpected shape, in our normalization or in template code (e.g. None + str).
            raise FlashtreeError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e


def template_or_chatml(template: ChatTemplate | None) -> ChatTemplate:
    """A model's own template; GGUFs without one get ChatML, which frames Qwen turns the same way."""
    return template or ChatTemplate(CHATML_TEMPLATE, eos_token="<|im_end|>")
