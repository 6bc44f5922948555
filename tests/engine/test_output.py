"""Stop conditions and streaming: EOS, stop strings (also across token boundaries), max tokens, UTF-8."""

import pytest

from flashtree.engine.output import OutputTracker
from flashtree.formats.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_spec):
    return Tokenizer(tokenizer_spec)


def run(tok, text, stop=(), max_new=1000, eos=()):
    pieces = []
    tracker = OutputTracker(tok, eos, stop, max_new, pieces.append)
    tracker.push_many(tok.encode(text))
    if not tracker.done:
        tracker._finish("length", flush=True)
    return tracker, "".join(pieces)


def test_stream_equals_text_and_never_splits_characters(tok):
    text = "héllo 你好 🚀🚀 done"
    tracker, streamed = run(tok, text)
    assert streamed == tracker.text == text


def test_stop_string_across_tokens_is_never_streamed(tok):
    tracker, streamed = run(tok, "print(fib(10))\nSTOP here and more", stop=("STOP h",))
    assert tracker.finish_reason == "stop"
    assert tracker.text == streamed == "print(fib(10))\n"


def test_eos_ends_without_emitting_it(tok):
    ids = tok.encode("abc") + [tok.token_id("<|im_end|>")] + tok.encode("zzz")
    pieces = []
    tracker = OutputTracker(tok, tok.eos_ids, (), 100, pieces.append)
    used = tracker.push_many(ids)
    assert used == len(tok.encode("abc")) + 1
    assert tracker.finish_reason == "stop" and "".join(pieces) == "abc"


def test_max_tokens_exact(tok):
    ids = tok.encode("a b c d e f g h")
    tracker = OutputTracker(tok, (), (), 3)
    assert tracker.push_many(ids) == 3 and tracker.token_ids == ids[:3] and tracker.finish_reason == "length"


def test_cancellation(tok):
    calls = iter([False, False, True])
    tracker = OutputTracker(tok, (), (), 100, cancelled=lambda: next(calls))
    tracker.push_many(tok.encode("one two three four five"))
    assert tracker.finish_reason == "cancelled" and len(tracker.token_ids) == 2
