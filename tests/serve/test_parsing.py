import json

import pytest

from flashtree.serve.parsing import Delta, OutputParser, opens_thinking

WEATHER = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                            "metric": {"type": "boolean"}}}}
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")


def parse(text: str, thinking: bool = False, tools=None, pieces: int | None = None) -> tuple[Delta, OutputParser]:
    """Feeds `text` in chunks of `pieces` characters (all at once when None) and merges the deltas."""
    parser = OutputParser(thinking, tools)
    total = Delta()
    step = pieces or max(len(text), 1)
    for i in range(0, len(text), step):
        total.add(parser.feed(text[i : i + step]))
    total.add(parser.finish())
    return total, parser


@pytest.mark.parametrize("pieces", [None, 1, 3])
def test_reasoning_split_when_the_prompt_opened_think(pieces):
    out, _ = parse("Let me think.\nStill thinking.\n</think>\n\nThe answer is 4.", thinking=True, pieces=pieces)
    assert out.reasoning == "Let me think.\nStill thinking."
    assert out.content == "The answer is 4."


@pytest.mark.parametrize("pieces", [None, 1, 2])
def test_model_written_think_block(pieces):
    out, _ = parse("\n<think>\nhmm\n</think>\n\nHi there", pieces=pieces)
    assert (out.reasoning, out.content) == ("hmm", "Hi there")


def test_unclosed_reasoning_is_all_reasoning():
    out, _ = parse("thinking and thinking", thinking=True)
    assert (out.reasoning, out.content) == ("thinking and thinking", "")


def test_no_thinking_is_plain_content():
    out, _ = parse("  plain <b>text</b> with a < sign ")
    assert (out.reasoning, out.content) == ("", "plain <b>text</b> with a < sign")


def test_opens_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


@pytest.mark.parametrize("pieces", [None, 1, 5])
def test_xml_tool_call_with_types_from_the_schema(pieces):
    out, parser = parse("I'll check.\n\n" + XML_CALL, tools=WEATHER, pieces=pieces)
    assert out.content == "I'll check."
    assert parser.called_tools
    [call] = out.tool_calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3, "metric": True}


def test_xml_tool_call_streams_name_then_each_parameter():
    parser = OutputParser(False, WEATHER)
    deltas = [parser.feed(ch) for ch in XML_CALL] + [parser.finish()]
    parts = [part for d in deltas for part in d.tool_calls]
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [p["function"]["arguments"] for p in parts[1:]] == ['{"city": "Paris"', ', "days": 3', ', "metric": true', "}"]
    assert all(p["index"] == 0 for p in parts) and "id" not in parts[1]


def test_json_tool_call_and_two_calls_in_a_row():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n<function=get_weather>\n</function>\n</tool_call>')
    out, _ = parse(text, tools=WEATHER, pieces=4)
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [{"city": "Oslo"}, {}]
    assert out.tool_calls[0]["id"] != out.tool_calls[1]["id"] and out.content == ""


def test_missing_parameter_close_tag_is_tolerated():
    text = "<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>\n</tool_call>"
    out, _ = parse(text, tools={"f": {}})
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"a": "x", "b": "y"}


def test_tool_call_after_reasoning():
    out, parser = parse("need weather\n</think>\n\n" + XML_CALL, thinking=True, tools=WEATHER, pieces=7)
    assert out.reasoning == "need weather" and out.content == "" and parser.called_tools


def test_unreadable_tool_call_stays_content():
    out, parser = parse("<tool_call>not a call</tool_call>", tools=WEATHER)
    assert out.content == "<tool_call>not a call</tool_call>" and not out.tool_calls and not parser.called_tools


def test_tool_call_text_is_content_when_tools_are_off():
    out, _ = parse(XML_CALL, tools=None)
    assert out.content == XML_CALL and not out.tool_calls


def test_truncated_tool_call_keeps_finished_parameters():
    out, _ = parse(XML_CALL[: XML_CALL.index("<parameter=days>")] + "<parameter=days>\n3", tools=WEATHER)
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_streaming_never_emits_a_partial_tag():
    parser = OutputParser(True, WEATHER)
    seen = ""
    for ch in "abc</thi":
        seen += parser.feed(ch).reasoning
    assert seen == "abc"
    assert parser.feed("nk>x").content == "x"
