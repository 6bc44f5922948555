"""OpenAI's Responses API: exact output through a scripted engine, and the official openai client against a live
server (it parses every event and object the way OpenAI's own clients do)."""

import json

import openai
import pytest

from flashtree.serve.app import build_app
from tests.serve.conftest import MODEL
from tests.serve.fakes import live_server
from tests.serve.test_anthropic import events
from tests.serve.test_api import CALL, decoded_prompt

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def respond(client, **body):
    return client.post("/v1/responses", json={"model": MODEL, "input": "What's the weather in Paris?", **body})


def streamed_output(stream: list[tuple[str, dict]]) -> dict:
    """The final response of a stream, after checking that the deltas add up to it."""
    numbers = [body["sequence_number"] for _, body in stream]
    assert numbers == list(range(len(stream)))
    assert [name for name, _ in stream][:2] == ["response.created", "response.in_progress"]
    final = stream[-1][1]["response"]
    texts: dict[int, str] = {}
    for name, body in stream:
        if name.endswith(".delta"):
            texts[body["output_index"]] = texts.get(body["output_index"], "") + body["delta"]
    for index, item in enumerate(final["output"]):
        whole = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert texts.get(index, "") == whole
    return final


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_message(client, scripted, stream):
    scripted.script = "The user wants weather.\n</think>\n\nIt is sunny."
    response = respond(client, stream=stream, instructions="Be terse.")
    body = streamed_output(events(response)) if stream else response.json()
    assert body["object"] == "response" and body["status"] == "completed" and body["id"].startswith("resp_")
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "The user wants weather."
    assert message["type"] == "message" and message["content"][0] == {"type": "output_text", "text": "It is sunny.",
                                                                       "annotations": []}
    ids = scripted.results[-1].token_ids
    assert body["usage"]["output_tokens"] == len(ids)
    reasoning_ids = ids.index(scripted.tokenizer.token_id("</think>"))  # the tokens before the closing tag
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == reasoning_ids > 0
    assert "Be terse." in decoded_prompt(scripted).split("<|im_end|>")[0]


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(client, scripted, stream):
    scripted.script = CALL
    response = respond(client, stream=stream, tools=TOOLS, reasoning={"effort": "none"})
    body = streamed_output(events(response)) if stream else response.json()
    [call] = body["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"]
    assert decoded_prompt(scripted).endswith("</think>\n\n")  # effort none: no thinking
    history = [{"role": "user", "content": "What's the weather in Paris?"},
               {"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"]},
               {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21C"}]
    scripted.script = "It is sunny."
    assert respond(client, input=history, tools=TOOLS).status_code == 200
    prompt = decoded_prompt(scripted)
    assert "<parameter=city>\nParis\n</parameter>" in prompt and "<tool_response>\nsunny, 21C" in prompt


def test_length_is_incomplete(client, scripted):
    scripted.script = "</think>\n\nOne two three four five six."
    body = respond(client, max_output_tokens=4).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]"),
    ({"input": [{"type": "web_search_call"}]}, "input[0]"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_cannot_be_honoured_is_a_400(client, scripted, extra, param):
    response = respond(client, **extra)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert not scripted.prompts


def test_official_client(tiny_engine):
    with live_server(build_app(tiny_engine, MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        kwargs = dict(model=MODEL, input="Hi", max_output_tokens=12, reasoning={"effort": "none"})
        whole = client.responses.create(**kwargs)
        assert whole.status in ("completed", "incomplete") and whole.usage.output_tokens > 0 and whole.output_text
        streamed = [event for event in client.responses.create(stream=True, **kwargs)]
        final = streamed[-1].response
        assert streamed[0].type == "response.created" and final.output_text == whole.output_text
        assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == whole.output_text
