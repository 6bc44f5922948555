"""Protocol tests through TestClient: a scripted engine for exact output, the tiny random engine for the real path."""

import json
import threading

import pytest
from fastapi.testclient import TestClient

from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.sampling import SamplingParams
from flashtree.errors import FlashtreeError
from flashtree.serve.app import build_app
from tests.serve.conftest import MODEL
from tests.serve.fakes import ScriptedEngine

USER = [{"role": "user", "content": "What's the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def chat(client, stream=False, headers=None, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "stream": stream, **body},
                       headers=headers)


def sse(response) -> list[dict]:
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def merged_deltas(chunks) -> dict:
    out = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            out["content"] += delta.get("content") or ""
            out["reasoning_content"] += delta.get("reasoning_content") or ""
            for part in delta.get("tool_calls", []):
                call = out["tool_calls"].setdefault(part["index"], {"name": "", "arguments": "", "id": None})
                call["id"] = call["id"] or part.get("id")
                call["name"] += part["function"].get("name", "")
                call["arguments"] += part["function"]["arguments"]
    return out


def decoded_prompt(engine) -> str:
    return engine.tokenizer.decode(engine.prompts[-1])


# --- chat with the scripted engine -----------------------------------------------------------------------------

def test_chat_non_streaming(client, scripted):
    scripted.script = "Paris is sunny."
    body = chat(client, chat_template_kwargs={"enable_thinking": False}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Paris is sunny.", "reasoning_content": None}
    assert choice["finish_reason"] == "stop"
    n = len(scripted.tokenizer.encode("Paris is sunny."))
    assert body["usage"]["completion_tokens"] == n
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + n == len(scripted.prompts[-1]) + n
    assert body["flashtree"]["tokens"] == n and body["flashtree"]["acceptance_length"] == 1.0


def test_chat_streaming_with_usage(client, scripted):
    scripted.script = "Paris is sunny today."
    chunks = sse(chat(client, stream=True, stream_options={"include_usage": True},
                      chat_template_kwargs={"enable_thinking": False}))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert merged_deltas(chunks)["content"] == "Paris is sunny today."
    assert len(chunks) > 4  # streamed in pieces, not one blob
    stats = chunks[-2]["flashtree"]  # the finish_reason chunk, and no other, carries the request's stats
    assert stats["tokens"] == chunks[-1]["usage"]["completion_tokens"] and stats["acceptance_length"] == 1.0
    assert stats["acceptance_histogram"] == {"1": stats["steps"]} and stats["tokens_per_s"] >= 0
    assert all("flashtree" not in c for c in chunks[:-2] + chunks[-1:])


def test_completions_carry_flashtree_stats(client, scripted):
    scripted.script = "abc"
    body = client.post("/v1/completions", json={"prompt": "x"}).json()
    assert body["flashtree"]["tokens"] == body["usage"]["completion_tokens"] > 0
    chunks = sse(client.post("/v1/completions", json={"prompt": "x", "stream": True}))
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["flashtree"]["acceptance_length"] == 1.0


def test_one_log_line_per_request(client, scripted, caplog):
    scripted.script = "Paris is sunny."
    with caplog.at_level("INFO", logger="flashtree.serve"):
        body = chat(client, chat_template_kwargs={"enable_thinking": False}).json()
        chunks = sse(chat(client, stream=True))
    lines = [r.getMessage() for r in caplog.records if r.name == "flashtree.serve"]
    assert len(lines) == 2
    assert lines[0].startswith(body["id"] + " ") and f"completion_tokens={body['usage']['completion_tokens']}" in lines[0]
    assert f"prompt_tokens={body['usage']['prompt_tokens']}" in lines[0]
    assert "tok/s=" in lines[0] and "AL=1.00" in lines[0] and "finish=stop" in lines[0]
    assert lines[1].startswith(chunks[0]["id"] + " ")


def test_no_usage_chunk_unless_asked(client):
    chunks = sse(chat(client, stream=True))
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_split(client, scripted, stream):
    scripted.script = "The user wants weather.\n</think>\n\nIt is sunny."
    response = chat(client, stream=stream, stream_options={"include_usage": True} if stream else None)
    chunks = sse(response) if stream else None
    message = merged_deltas(chunks) if stream else response.json()["choices"][0]["message"]
    assert decoded_prompt(scripted).endswith("<think>\n")
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "It is sunny."
    usage = chunks[-1]["usage"] if stream else response.json()["usage"]
    ids = scripted.results[-1].token_ids
    assert usage["completion_tokens_details"]["reasoning_tokens"] == ids.index(scripted.tokenizer.token_id("</think>")) > 0


@pytest.mark.parametrize("script, reasoning", [("never closes its thinking", "all"), ("</think>\n\nIt is sunny.", 0)])
def test_reasoning_tokens_of_unclosed_and_empty_thinking(client, scripted, script, reasoning):
    scripted.script = script
    usage = chat(client).json()["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == (usage["completion_tokens"] if reasoning == "all"
                                                                      else reasoning)


def test_enable_thinking_false_reaches_the_template(client, scripted):
    scripted.script = "It is sunny."
    message = chat(client, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert decoded_prompt(scripted).endswith("</think>\n\n")
    assert message == {"role": "assistant", "content": "It is sunny.", "reasoning_content": None}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls(client, scripted, stream):
    scripted.script = "I should look it up.\n</think>\n\n" + CALL
    response = chat(client, stream=stream, tools=TOOLS)
    assert "get_weather" in decoded_prompt(scripted)  # the template showed the tools to the model
    if stream:
        chunks = sse(response)
        merged = merged_deltas(chunks)
        [call] = merged["tool_calls"].values()
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert call["id"].startswith("call_")
        name, arguments = call["name"], call["arguments"]
    else:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        name, arguments = call["function"]["name"], call["function"]["arguments"]
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}


def test_tool_choice_none_hides_tools_and_parses_nothing(client, scripted):
    scripted.script = "</think>\n\n" + CALL
    choice = chat(client, tools=TOOLS, tool_choice="none").json()["choices"][0]
    assert "get_weather" not in decoded_prompt(scripted)
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == CALL


def test_tool_round_trip_history_renders(client, scripted):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS})
    assert response.status_code == 200
    prompt = decoded_prompt(scripted)
    assert "<parameter=city>\nParis\n</parameter>" in prompt and "<tool_response>\nsunny, 21C" in prompt


def test_text_parts_and_developer_role(client, scripted):
    messages = [{"role": "developer", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert client.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
    assert "<|im_start|>system\nBe terse.<|im_end|>" in decoded_prompt(scripted)
    assert "Hi there" in decoded_prompt(scripted)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_and_max_tokens(client, scripted, stream):
    scripted.script = "One. Two. Three. Four."
    kwargs = {"stream": stream, "chat_template_kwargs": {"enable_thinking": False}}
    for body, text, reason in [({"stop": "Three"}, "One. Two.", "stop"),
                               ({"stop": ["Four", "Two"]}, "One.", "stop"),
                               ({"max_tokens": 2}, None, "length"),
                               ({"max_completion_tokens": 2, "max_tokens": 50}, None, "length")]:
        response = chat(client, **kwargs, **body)
        if stream:
            chunks = sse(response)
            content, finish = merged_deltas(chunks)["content"], chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = response.json()["choices"][0]
            content, finish = choice["message"]["content"], choice["finish_reason"]
        assert finish == reason
        if text is not None:
            assert content == text
        else:
            assert len(scripted.results[-1].token_ids) == 2


def test_greedy_sampling_params_accepted(client):
    assert chat(client, temperature=0, top_p=0.9, top_k=20, seed=7, min_p=0.05, n=1).status_code == 200


def test_completions(client, scripted):
    scripted.script = " world, hello."
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 50}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == " world, hello." and body["choices"][0]["finish_reason"] == "stop"
    assert scripted.prompts[-1] == scripted.tokenizer.encode("Hello")
    chunks = sse(client.post("/v1/completions", json={"prompt": [1, 2, 3], "stream": True, "stop": ",",
                                                      "stream_options": {"include_usage": True}}))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == " world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["prompt_tokens"] == 3


# --- errors ----------------------------------------------------------------------------------------------------

def assert_error(response, status, param=None, code=None, contains=""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert contains.lower() in error["message"].lower()
    assert error["param"] == param and (code is None or error["code"] == code)
    return error


@pytest.mark.parametrize("body,param,contains", [
    ({"model": MODEL}, "messages", "field required"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": "hi"}, "messages", ""),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", ""),
    ({"messages": USER, "max_tokens": "many"}, "max_tokens", ""),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", ""),
    ({"messages": USER, "stream": "yes"}, "stream", ""),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", ""),
    ({"messages": USER, "temperature": -1}, "temperature", ""),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "only text"),
])
def test_validation_errors_are_400(client, body, param, contains):
    assert_error(client.post("/v1/chat/completions", json=body), 400, param=param, contains=contains)


@pytest.mark.parametrize("extra,param,contains", [
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "not supported"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set"),
])
def test_unsupported_features_are_clear_400s(client, scripted, extra, param, contains):
    assert_error(chat(client, **extra), 400, param=param, contains=contains)
    assert not scripted.prompts  # nothing reached the engine


def test_completions_errors(client):
    assert_error(client.post("/v1/completions", json={"model": MODEL}), 400, param="prompt")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "logprobs": 21}), 400, param="logprobs")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "temperature": 3}), 400, param="temperature")
    assert_error(client.post("/v1/completions", json={"prompt": [10**9]}), 400, param="prompt")
    assert_error(client.post("/v1/completions", json={"prompt": ""}), 400, param="prompt")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(real_client, tiny_engine, stream):
    body = {"messages": USER, "max_tokens": 12, "logprobs": True, "top_logprobs": 2, "stream": stream,
            "chat_template_kwargs": {"enable_thinking": False}}
    response = real_client.post("/v1/chat/completions", json=body)
    if stream:
        chunks = sse(response)
        content = [item for c in chunks for ch in c["choices"] if ch["logprobs"] for item in ch["logprobs"]["content"]]
        text = merged_deltas(chunks)["content"]
    else:
        choice = response.json()["choices"][0]
        content, text = choice["logprobs"]["content"], choice["message"]["content"]
    tokenizer = tiny_engine.target.tokenizer  # the entries behind the reply: the same greedy run, in the engine
    entries = Engine(tiny_engine.target).generate(tiny_engine.encode_messages(USER, enable_thinking=False),
                                                  GenerationConfig(max_new_tokens=12, logprobs=2)).logprobs
    assert [item["bytes"] for item in content] == [list(tokenizer.bytes_of(e.token)) for e in entries]
    assert bytes(sum((item["bytes"] for item in content), [])).decode("utf-8", "replace").strip() == text.strip()
    for item, entry in zip(content, entries):
        assert item["logprob"] == pytest.approx(entry.logprob, abs=1e-5) and len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(real_client, tiny_engine, stream):
    body = {"prompt": "def fib(n):", "max_tokens": 10, "logprobs": 3, "stream": stream}
    response = real_client.post("/v1/completions", json=body)
    if stream:
        chunks = [c["choices"][0] for c in sse(response)]
        text = "".join(c["text"] for c in chunks)
        parts = [c["logprobs"] for c in chunks if c["logprobs"]]
        logprobs = {key: sum((p[key] for p in parts), []) for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                      "text_offset")}
    else:
        choice = response.json()["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
    tokenizer = tiny_engine.target.tokenizer
    ids = Engine(tiny_engine.target).generate(tokenizer.encode("def fib(n):"), GenerationConfig(max_new_tokens=10)).token_ids
    assert logprobs["tokens"] == [tokenizer.bytes_of(t).decode("utf-8", "replace") for t in ids] and text
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 10
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(10)]
    # keyed by token text, so tokens that print the same (partial UTF-8) share a key
    assert all(1 <= len(top) <= 3 and lp <= max(top.values()) <= 0
               for top, lp in zip(logprobs["top_logprobs"], logprobs["token_logprobs"]))


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices(real_client, tiny_engine, stream):
    body = {"prompt": "def fib(n):", "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 11, "stream": stream,
            "stream_options": {"include_usage": True}}
    response = real_client.post("/v1/completions", json=body)
    if stream:
        chunks = sse(response)
        texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                 for i in range(3)}
        usage = chunks[-1]["usage"]
    else:
        reply = response.json()
        assert [c["index"] for c in reply["choices"]] == [0, 1, 2] and len(reply["flashtree"]) == 3
        texts, usage = {c["index"]: c["text"] for c in reply["choices"]}, reply["usage"]
    tokenizer = tiny_engine.target.tokenizer
    for i in range(3):  # choice i is the seeded run with seed + i
        config = GenerationConfig(max_new_tokens=8, sampling=SamplingParams(temperature=1.0, seed=11 + i))
        assert texts[i] == tiny_engine.generate(tokenizer.encode("def fib(n):"), config).text
    assert len(set(texts.values())) > 1 and usage["completion_tokens"] == 24
    assert usage["prompt_tokens"] == len(tokenizer.encode("def fib(n):"))


def test_n_choices_beyond_the_queue_are_refused(scripted):
    with TestClient(build_app(scripted, MODEL, queue_size=2)) as client:
        assert_error(chat(client, n=3), 400, param="n", contains="--max-queued-requests")
        assert len(chat(client, n=2).json()["choices"]) == 2


def test_echo_scores_the_prompt(real_client, tiny_engine):
    """lm-eval's loglikelihood request: echo the prompt with its tokens' log-probabilities."""
    tokenizer = tiny_engine.target.tokenizer
    prompt = "def fib(n): return n"
    ids = tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    choice = real_client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert logprobs["tokens"] == [tokenizer.bytes_of(t).decode("utf-8", "replace") for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    scored = tiny_engine.generate(ids, GenerationConfig(max_new_tokens=0, prompt_logprobs=1)).prompt_logprobs
    assert logprobs["token_logprobs"][1:] == pytest.approx([e.logprob for e in scored[1:]], abs=1e-5)
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(ids))]
    # with a completion after it: the prompt's entries, then the completion's, offsets running on
    both = real_client.post("/v1/completions", json={**body, "max_tokens": 3}).json()["choices"][0]
    assert both["text"].startswith(prompt) and len(both["logprobs"]["tokens"]) == len(ids) + 3
    assert both["logprobs"]["text_offset"][len(ids)] == len(prompt)
    streamed = sse(real_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "echo": True,
                                                              "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed) == both["text"]
    assert_error(real_client.post("/v1/completions", json={**body, "stream": True}), 400, param="echo")
    assert_error(real_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0}), 400, param="max_tokens")


def test_logit_bias(real_client, tiny_engine):
    body = {"prompt": "def fib(n):", "max_tokens": 6}
    forced = 300
    text = real_client.post("/v1/completions", json={**body, "logit_bias": {str(forced): 100}}).json()
    assert text["choices"][0]["text"] == tiny_engine.tokenizer.decode([forced] * 6)
    for bias, words in [({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"), ({"99999999": 1}, "vocabulary")]:
        assert_error(real_client.post("/v1/completions", json={**body, "logit_bias": bias}), 400, param="logit_bias",
                     contains=words)


def test_malformed_json_and_wrong_content(client):
    headers = {"content-type": "application/json"}
    assert_error(client.post("/v1/chat/completions", content=b'{"messages": [', headers=headers), 400,
                 contains="not valid JSON")
    assert_error(client.post("/v1/chat/completions", content=b"[1, 2]", headers=headers), 400)
    assert_error(client.post("/v1/chat/completions", content=b"messages=hi"), 400)


def test_unknown_model_route_and_method(client):
    assert_error(chat(client, model="gpt-4o"), 404, param="model", code="model_not_found", contains="gpt-4o")
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)


def test_template_rejection_is_400(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late system prompt"}]
    assert_error(client.post("/v1/chat/completions", json={"messages": messages}), 400, contains="template")


def test_prompt_longer_than_context(tiny_target):
    engine = ScriptedEngine(tiny_target)
    engine.default_config = GenerationConfig(ctx=32)
    with TestClient(build_app(engine, MODEL)) as client:
        long = [{"role": "user", "content": "word " * 100}]
        error = assert_error(client.post("/v1/chat/completions", json={"messages": long}), 400,
                             param="messages", code="context_length_exceeded")
        assert "maximum context length is 32 tokens" in error["message"]
        assert_error(client.post("/v1/completions", json={"prompt": "word " * 100}), 400, param="prompt",
                     code="context_length_exceeded")
        assert client.post("/tokenize", json={"prompt": "x"}).json()["max_model_len"] == 32
        short = [{"role": "user", "content": "hi"}]
        prompt_tokens = client.post("/tokenize", json={"messages": short}).json()["count"]
        error = assert_error(client.post("/v1/chat/completions", json={"messages": short, "max_tokens": 30}), 400,
                             param="max_tokens", code="context_length_exceeded")
        assert (f"maximum context length is 32 tokens. However, you requested {prompt_tokens + 30} tokens "
                f"({prompt_tokens} in the messages, 30 in the completion)") in error["message"]
        error = assert_error(client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 31}), 400,
                             param="max_tokens", code="context_length_exceeded")
        assert "you requested 33 tokens (2 in the prompt, 31 in the completion)" in error["message"]
        assert not engine.prompts
        # exactly full is fine, and without max_tokens the server's default is cut to what fits
        assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 30}).status_code == 200
        assert client.post("/v1/chat/completions", json={"messages": short}).status_code == 200


def test_context_limit_without_ctx_is_the_models(tiny_target):
    engine = ScriptedEngine(tiny_target)  # default_config.ctx is None: the GGUF's context_length is the limit
    limit = tiny_target.config.context_length
    with TestClient(build_app(engine, MODEL)) as client:
        error = assert_error(client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": limit}), 400,
                             param="max_tokens", code="context_length_exceeded")
        assert f"maximum context length is {limit} tokens" in error["message"] and str(limit + 2) in error["message"]
        assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": limit - 2}).status_code == 200


def test_api_key(scripted):
    with TestClient(build_app(scripted, MODEL, api_key="sekret")) as client:
        assert client.get("/health").status_code == 200  # public
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            assert_error(chat(client, headers=headers), 401, code="invalid_api_key")
            assert_error(client.get("/v1/models", headers=headers), 401)
        assert chat(client, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert client.get("/metrics", headers={"x-api-key": "sekret"}).status_code == 200


# --- models, health, metrics, tokenize -------------------------------------------------------------------------

def test_models(client):
    assert client.get("/v1/models").json()["data"][0] | {"created": 0} == {
        "id": MODEL, "object": "model", "created": 0, "owned_by": "flashtree"}


def test_health_while_loading_and_after(scripted):
    release = threading.Event()

    def factory():
        release.wait(10)
        return scripted

    with TestClient(build_app(factory, MODEL)) as client:
        error = assert_error(client.get("/health"), 503, contains="loading")
        assert error["type"] == "unavailable_error"
        assert_error(chat(client), 503)
        release.set()
        for _ in range(200):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.01)
        assert client.get("/health").json() == {"status": "ok"}
        assert chat(client).status_code == 200


def _wait_for_the_load_to_end(client) -> None:
    for _ in range(200):
        if client.get("/health").json()["error"]["message"] != "Loading model":
            return
        threading.Event().wait(0.01)


def test_failed_load_reports_503(scripted):
    def factory():
        raise RuntimeError("no such file")

    with TestClient(build_app(factory, MODEL)) as client:
        _wait_for_the_load_to_end(client)
        assert_error(client.get("/health"), 503, contains="no such file")


def test_a_known_load_failure_is_logged_in_one_line(scripted, caplog):
    def factory():
        raise FlashtreeError("weights.gguf: truncated file")

    with TestClient(build_app(factory, MODEL)) as client:
        _wait_for_the_load_to_end(client)
        assert_error(client.get("/health"), 503, contains="weights.gguf: truncated file")
    failures = [r for r in caplog.records if "loading the model failed" in r.getMessage()]
    assert failures and all(r.exc_info is None for r in failures)


def test_cors_preflight_and_headers(scripted):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with TestClient(build_app(scripted, MODEL, api_key="k", allowed_origins=["http://localhost:3000"])) as client:
        answer = client.options("/v1/chat/completions", headers=preflight)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "http://localhost:3000"
        reply = chat(client, headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = client.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    with TestClient(build_app(scripted, MODEL)) as client:  # no origins: no CORS headers at all
        assert "access-control-allow-origin" not in chat(client, headers={"Origin": "http://x.example"}).headers


def test_metrics(client, scripted):
    scripted.script = "abc"
    chat(client, chat_template_kwargs={"enable_thinking": False})
    text = client.get("/metrics").text
    assert 'flashtree_requests_total{outcome="stop"} 1' in text
    assert f"flashtree_generation_tokens_total {len(scripted.results[-1].token_ids)}" in text
    for name in ("prompt_tokens_total", "tokens_per_second", "acceptance_length", "queue_depth", "requests_running",
                 "requests_rejected_total"):
        assert f"# TYPE flashtree_{name} " in text
    assert "flashtree_acceptance_length 1.0" in text and "flashtree_queue_depth 0" in text


def test_tokenize_detokenize(client, scripted):
    ids = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["tokens"] == scripted.tokenizer.encode("Hello world") and ids["count"] == len(ids["tokens"])
    assert client.post("/tokenize", json={"content": "Hello world"}).json()["tokens"] == ids["tokens"]
    assert client.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "Hello world"}
    chat(client)
    rendered = client.post("/tokenize", json={"messages": USER}).json()["tokens"]
    assert rendered == scripted.prompts[-1]  # exactly what chat completions fed the engine
    assert_error(client.post("/tokenize", json={}), 400)
    assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400, contains="outside the vocabulary")


# --- queueing and timeouts -------------------------------------------------------------------------------------

def wait_for(predicate, timeout=5.0):
    event = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        event.wait(0.01)
    raise AssertionError("condition not reached")


def test_queue_full_is_503_with_retry_after(tiny_target):
    gate = threading.Event()
    engine = ScriptedEngine(tiny_target, gate=gate)
    app = build_app(engine, MODEL, queue_size=1)
    with TestClient(app) as client:
        responses = []
        threads = [threading.Thread(target=lambda: responses.append(chat(client))) for _ in range(2)]
        threads[0].start()
        wait_for(engine.started.is_set)  # first request is generating
        threads[1].start()
        wait_for(lambda: "flashtree_queue_depth 1" in client.get("/metrics").text)  # second is waiting
        full = chat(client)
        assert_error(full, 503, contains="busy")
        assert full.headers["retry-after"] == "1"
        gate.set()
        for t in threads:
            t.join(10)
        assert [r.status_code for r in responses] == [200, 200]
        assert "flashtree_requests_rejected_total 1" in client.get("/metrics").text


def test_queue_needs_room_for_one(scripted):
    with pytest.raises(FlashtreeError, match="at least 1"):
        build_app(scripted, MODEL, queue_size=0)


def test_request_timeout_ends_with_length(tiny_target):
    engine = ScriptedEngine(tiny_target, script="word " * 200, delay=0.01)
    with TestClient(build_app(engine, MODEL, request_timeout=0.2)) as client:
        choice = chat(client, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert engine.results[-1].finish_reason == "cancelled" and 0 < len(engine.results[-1].token_ids) < 100


# --- the real tiny engine --------------------------------------------------------------------------------------

@pytest.mark.parametrize("thinking", [True, False])
def test_real_engine_stream_matches_non_stream(real_client, thinking):
    kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}, "max_tokens": 12}
    plain = chat(real_client, **kwargs).json()
    chunks = sse(chat(real_client, stream=True, stream_options={"include_usage": True}, **kwargs))
    merged = merged_deltas(chunks)
    message = plain["choices"][0]["message"]
    assert merged["content"] == (message["content"] or "")
    assert merged["reasoning_content"] == (message["reasoning_content"] or "")
    assert chunks[-1]["usage"] == plain["usage"]
    assert plain["choices"][0]["finish_reason"] in ("stop", "length")
    assert 0 < plain["usage"]["completion_tokens"] <= 12


def test_real_engine_completions_and_tokenize(real_client, tiny_engine):
    body = real_client.post("/v1/completions", json={"prompt": "def fib(n):", "max_tokens": 8}).json()
    expected = tiny_engine.generate(tiny_engine.tokenizer.encode("def fib(n):"), GenerationConfig(max_new_tokens=8))
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    tokens = real_client.post("/tokenize", json={"prompt": "def fib(n):"}).json()["tokens"]
    assert real_client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "def fib(n):"
    assert real_client.get("/health").json() == {"status": "ok"}
