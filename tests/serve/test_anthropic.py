"""Anthropic's Messages API through TestClient: a scripted engine for exact output, the tiny engine for the real path."""

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient

from flashtree.serve.app import build_app
from tests.serve.conftest import MODEL
from tests.serve.test_api import CALL, chat, decoded_prompt

USER = [{"role": "user", "content": "What's the weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def messages(client, stream=False, headers=None, **body):
    """A Messages request, thinking disabled unless `body` says otherwise (the tiny model's template thinks by
    default)."""
    payload = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": USER, "stream": stream,
               "thinking": {"type": "disabled"}, **body}
    return client.post("/v1/messages", json=payload, headers=headers)


def events(response) -> list[tuple[str, dict]]:
    """Named SSE events, each `event:` line followed by its `data:` line; no [DONE] terminator."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.splitlines() if line]
    names, data = lines[0::2], lines[1::2]
    assert all(n.startswith("event: ") for n in names) and all(d.startswith("data: ") for d in data)
    out = [(n[7:], json.loads(d[6:])) for n, d in zip(names, data)]
    assert all(name == body["type"] for name, body in out)
    return out


def streamed_message(stream: list[tuple[str, dict]]) -> dict:
    """The message the events build, the way Anthropic's SDK accumulates them."""
    message = stream[0][1]["message"]
    for name, body in stream[1:]:
        if name == "content_block_start":
            assert body["index"] == len(message["content"])
            message["content"].append(dict(body["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][body["index"]], body["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[delta["type"]]
            block[key] = block.get(key, "") + delta[key]
        elif name == "message_delta":
            message.update(body["delta"])
            message["usage"].update(body["usage"])
    for block in message["content"]:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial_json", "") or "{}")
    assert [name for name, _ in stream][-2:] == ["message_delta", "message_stop"]
    return message


def reply(client, stream, **body) -> dict:
    response = messages(client, stream=stream, **body)
    return streamed_message(events(response)) if stream else response.json()


@pytest.mark.parametrize("stream", [False, True])
def test_text_reply(client, scripted, stream):
    scripted.script = "Paris is sunny."
    message = reply(client, stream)
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert message["model"] == MODEL  # whatever name the client asked for, the served model answers
    assert message["content"] == [{"type": "text", "text": "Paris is sunny."}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    assert message["usage"] == {"input_tokens": len(scripted.prompts[-1]), "cache_read_input_tokens": 0,
                                "output_tokens": len(scripted.results[-1].token_ids)}
    assert decoded_prompt(scripted).endswith("</think>\n\n")  # thinking disabled reached the template


@pytest.mark.parametrize("server_default, prompt_end", [({}, "<think>\n"), ({"enable_thinking": False}, "</think>\n\n")])
def test_without_a_thinking_field_the_server_default_holds(scripted, server_default, prompt_end):
    """As on the OpenAI routes: the chat template's default, or serve --think/--no-think."""
    with TestClient(build_app(scripted, MODEL, template_kwargs=server_default)) as client:
        messages(client, thinking=None)
    assert decoded_prompt(scripted).endswith(prompt_end)


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_when_enabled(client, scripted, stream):
    scripted.script = "The user wants weather.\n</think>\n\nIt is sunny."
    message = reply(client, stream, thinking={"type": "enabled", "budget_tokens": 1024})
    assert decoded_prompt(scripted).endswith("<think>\n")
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    assert message["content"][0]["thinking"] == "The user wants weather."
    assert message["content"][1]["text"] == "It is sunny."


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use(client, scripted, stream):
    scripted.script = CALL
    message = reply(client, stream, tools=TOOLS)
    assert "get_weather" in decoded_prompt(scripted)
    [block] = message["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {"city": "Paris"}
    assert block["id"] and message["stop_reason"] == "tool_use"


def test_tool_result_round_trip_renders(client, scripted):
    history = USER + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    response = messages(client, messages=history, tools=TOOLS, system=[{"type": "text", "text": "Be terse."}])
    assert response.status_code == 200
    prompt = decoded_prompt(scripted)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "Be terse." in system
    assert "<parameter=city>\nParis\n</parameter>" in prompt and "<tool_response>\nsunny, 21C" in prompt
    assert prompt.index("sunny, 21C") < prompt.index("And tomorrow?")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_and_max_tokens(client, scripted, stream):
    scripted.script = "One. Two. Three. Four."
    message = reply(client, stream, stop_sequences=["Four", "Three"])
    assert message["content"] == [{"type": "text", "text": "One. Two."}]  # as the OpenAI routes trim it
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "Three")
    message = reply(client, stream, max_tokens=2)
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 2


def test_count_tokens_is_the_prompt_the_reply_uses(client, scripted):
    counted = client.post("/v1/messages/count_tokens", json={"model": "any", "messages": USER, "tools": TOOLS,
                                                             "thinking": {"type": "disabled"}})
    assert counted.status_code == 200
    messages(client, tools=TOOLS)
    assert counted.json() == {"input_tokens": len(scripted.prompts[-1])}


@pytest.mark.parametrize("body, status, kind, words", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]}, 400,
     "invalid_request_error", "tool_result"),
    ({"tool_choice": {"type": "any"}, "tools": TOOLS}, 400, "invalid_request_error", "tool_choice"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
])
def test_errors_have_anthropic_shape(client, body, status, kind, words):
    payload = {k: v for k, v in body.items() if v is not None}
    response = client.post("/v1/messages", json={"max_tokens": 8, "messages": USER, **payload}
                           if "max_tokens" not in body else {"messages": USER, **payload})
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"]


def test_api_key_by_x_api_key_header(scripted):
    with TestClient(build_app(scripted, MODEL, api_key="secret")) as client:
        denied = messages(client)
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        assert messages(client, headers={"x-api-key": "secret"}).status_code == 200
        assert chat(client).json()["error"]["type"] == "authentication_error"  # OpenAI shape on OpenAI routes
        assert "param" in chat(client).json()["error"]


def test_real_engine_stream_equals_non_stream(real_client):
    body = {"max_tokens": 12, "messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}}
    whole = real_client.post("/v1/messages", json=body).json()
    streamed = streamed_message(events(real_client.post("/v1/messages", json={**body, "stream": True})))
    assert streamed["content"] == whole["content"] and streamed["stop_reason"] == whole["stop_reason"]
    assert streamed["usage"] == whole["usage"]


def test_prefix_cache_hits_are_reported_in_usage(tiny_engine):
    """A second turn that repeats the first's prompt restores it from the prefix cache: both APIs say how
    many prompt tokens were read from the cache rather than prefilled."""
    from flashtree.engine.prefix_cache import PrefixCache

    tiny_engine.prefix_cache = PrefixCache(interval=8)
    # snapshots land on prefill chunk ends: short chunks give this short prompt some below its end
    tiny_engine.default_config = dataclasses.replace(tiny_engine.default_config, prefill_chunk=8)
    system = "You are a helpful assistant who answers briefly. " * 4
    first = [{"role": "user", "content": "Hi"}]
    with TestClient(build_app(tiny_engine, MODEL)) as client:
        body = {"max_tokens": 4, "system": system, "messages": first}
        cold = client.post("/v1/messages", json=body).json()["usage"]
        warm = client.post("/v1/messages", json=body).json()["usage"]
        assert cold["cache_read_input_tokens"] == 0 and warm["cache_read_input_tokens"] > 0
        assert warm["input_tokens"] + warm["cache_read_input_tokens"] == cold["input_tokens"]
        openai = client.post("/v1/chat/completions", json={"max_tokens": 4, "messages": [
            {"role": "system", "content": system}, *first], "chat_template_kwargs": {"enable_thinking": False}})
        assert openai.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_failure_mid_stream_is_an_error_event(tiny_target):
    from tests.serve.fakes import ScriptedEngine

    class Failing(ScriptedEngine):
        def generate(self, prompt_ids, config, on_text=None, cancelled=None, on_logprobs=None):
            on_text("Par")
            raise RuntimeError("the GPU fell over")

    with TestClient(build_app(Failing(tiny_target), MODEL)) as client:
        stream = events(messages(client, stream=True))
    assert [name for name, _ in stream][0] == "message_start" and stream[-1][0] == "error"
    error = stream[-1][1]["error"]
    assert error["type"] == "api_error" and "generation failed" in error["message"]
