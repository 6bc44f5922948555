import copy
import datetime
import json
from pathlib import Path

import pytest

from flashtree.errors import FlashtreeError
from flashtree.formats.chat_template import CHATML_TEMPLATE, ChatTemplate

QWEN35 = (Path(__file__).parent / "data" / "qwen35-chat-template.jinja").read_text()

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city — «quoted» & <escaped>?",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}


def call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CHAT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "東京", "days": 2})],
    },
    {"role": "tool", "tool_call_id": "call_get_weather", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_get_weather", "content": '{"temp": 18, "note": "雨"}'},
    {
        "role": "assistant",
        "content": "Let me also search.",
        "tool_calls": [call("search", {"query": "forecast", "filters": {"lang": ["en", "fr"]}})],
    },
    {"role": "tool", "content": "no results"},
]

MULTI_TURN = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n6"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome.", "reasoning_content": "polite reply"},
]

CASES = {
    "plain": ([{"role": "user", "content": "Hello!"}], None, {}),
    "system": ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], None, {}),
    "thinking_on": ([{"role": "user", "content": "Hi"}], None, {"enable_thinking": True}),
    "thinking_off": ([{"role": "user", "content": "Hi"}], None, {"enable_thinking": False}),
    "tools": (TOOL_CHAT[:2], [WEATHER_TOOL, SEARCH_TOOL], {}),
    "tools_no_system": (TOOL_CHAT[1:2], [WEATHER_TOOL], {}),
    "tool_calls": (TOOL_CHAT, [WEATHER_TOOL, SEARCH_TOOL], {}),
    "tool_calls_no_tools_thinking_off": (TOOL_CHAT, None, {"enable_thinking": False}),
    "multi_turn_reasoning": (MULTI_TURN, None, {"add_generation_prompt": False}),
    "multi_turn_continue": (MULTI_TURN + [{"role": "user", "content": "Bye"}], None, {}),
    "preserve_thinking": (MULTI_TURN, None, {"preserve_thinking": True, "add_generation_prompt": False}),
}


def hf_render(source: str, messages: list[dict], tools: list[dict] | None, **kwargs) -> str:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    kwargs.setdefault("add_generation_prompt", True)
    rendered, _ = chat_template_utils.render_jinja_template(
        [messages], tools=tools, chat_template=source, **kwargs
    )
    return rendered[0]


@pytest.mark.parametrize("name", CASES)
def test_qwen35_matches_transformers(name: str) -> None:
    messages, tools, kwargs = CASES[name]
    before = copy.deepcopy(messages)
    ours = ChatTemplate(QWEN35).render(messages, tools=tools, **kwargs)
    assert ours == hf_render(QWEN35, messages, tools, **kwargs)
    assert messages == before  # rendering never edits the caller's messages


def test_qwen35_expected_text() -> None:
    template = ChatTemplate(QWEN35)
    assert template.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert template.render([{"role": "user", "content": "Hi"}], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    text = template.render(TOOL_CHAT, tools=[WEATHER_TOOL])
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in text  # unescaped, non-ASCII kept
    assert "<think>\nTwo cities, two calls.\n</think>\n\n<tool_call>\n<function=get_weather>\n" in text
    assert "<parameter=city>\n東京\n</parameter>\n<parameter=days>\n2\n</parameter>\n" in text
    assert '<parameter=filters>\n{"lang": ["en", "fr"]}\n</parameter>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n" in text


def test_openai_style_inputs_are_normalized() -> None:
    template = ChatTemplate(QWEN35)
    as_dicts = template.render(TOOL_CHAT)
    as_openai = copy.deepcopy(TOOL_CHAT)
    for message in as_openai:
        for tool_call in message.get("tool_calls", []):
            tool_call["function"]["arguments"] = json.dumps(tool_call["function"]["arguments"])
        if "reasoning_content" in message:
            message["reasoning"] = message.pop("reasoning_content")
    assert template.render(as_openai) == as_dicts


def test_chatml_template_frames_like_qwen35() -> None:
    ours, qwen = ChatTemplate(CHATML_TEMPLATE), ChatTemplate(QWEN35)
    for name in ("plain", "system", "thinking_off", "tool_calls_no_tools_thinking_off", "multi_turn_reasoning"):
        messages, _, kwargs = CASES[name]
        assert ours.render(messages, **kwargs) == qwen.render(messages, **kwargs), name
    text = ours.render(TOOL_CHAT, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER_TOOL, ensure_ascii=False) in text
    assert "You are a weather bot.<|im_end|>\n" in text
    # from the first user turn on, tool-call framing is identical to Qwen's
    start = text.index("<|im_start|>user")
    assert text[start:] == qwen.render(TOOL_CHAT, tools=[WEATHER_TOOL]).split("<|im_end|>\n", 1)[1]


def test_helpers() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{{ x | tojson(indent=2) }}|{{ strftime_now('%Y') }}|{{ messages[0].content }}{{ eos_token }}",
        bos_token="<s>",
        eos_token="</s>",
    )
    out = template.render([{"role": "user", "content": "u"}], x={"a": "<é>"})
    assert out == '<s>{\n  "a": "<é>"\n}|' + str(datetime.datetime.now().year) + "|u</s>"


@pytest.mark.parametrize(
    ("source", "messages", "message"),
    [
        (QWEN35, [{"role": "system", "content": "only system"}], "No user query found"),
        (QWEN35, [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}], "Unexpected message role"),
        (CHATML_TEMPLATE, [], "No messages provided"),
        ("{{ messages.append(1) }}", [], "chat template error"),  # sandbox refuses mutation
        ("{{ ''.__class__.__mro__ }}", [], "chat template error"),  # and private attributes
        ("{{ 'a' + messages[0].content }}", [{"role": "user", "content": None}], "TypeError"),
        (QWEN35, ["not a message"], "ValueError"),
    ],
)
def test_render_errors(source: str, messages: list[dict], message: str) -> None:
    with pytest.raises(FlashtreeError, match=message):
        ChatTemplate(source).render(messages)


def test_syntax_error() -> None:
    with pytest.raises(FlashtreeError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}")
