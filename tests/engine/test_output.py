"""Stop conditions and streaming: EOS, stop strings (also across token boundaries), max tokens, UTF-8."""

import pytest

from flashtree.engine.output import OutputTracker, TokenLogprob
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


def test_takes_without_ending_only_where_no_push_can_end_the_output(tok):
    """The speculative loop commits a path before pushing it only when this says the pushes cannot end it."""
    ids, end = tok.encode("a b c"), tok.token_id("<|im_end|>")
    tracker = OutputTracker(tok, tok.eos_ids, (), 5)
    assert tracker.takes_without_ending(ids[:2]) and not tracker.takes_without_ending(ids[:2] + [end])
    tracker.push_many(ids[:3])
    assert tracker.takes_without_ending(ids[:1]) and not tracker.takes_without_ending(ids[:2])  # the 5th ends it
    assert not OutputTracker(tok, (), ("x",), 100).takes_without_ending(ids)  # a stop string may end any push
    assert not OutputTracker(tok, (), (), 100, cancelled=lambda: False).takes_without_ending(ids)
    for tokens in (ids[:1], ids[:2]):  # and what it promises holds
        fresh = OutputTracker(tok, tok.eos_ids, (), 3)
        assert fresh.takes_without_ending(tokens) and fresh.push_many(tokens) == len(tokens) and not fresh.done


def test_cancellation(tok):
    calls = iter([False, False, True])
    tracker = OutputTracker(tok, (), (), 100, cancelled=lambda: next(calls))
    tracker.push_many(tok.encode("one two three four five"))
    assert tracker.finish_reason == "cancelled" and len(tracker.token_ids) == 2


def _with_logprobs(tok, text, stop=()):
    """Tokens of `text` pushed with stand-in log-probabilities (-index), streaming pieces and entries."""
    events = []
    tracker = OutputTracker(tok, (), stop, 1000, lambda piece: events.append(("text", piece)),
                            on_logprobs=lambda entries: events.append(("logprobs", [e.token for e in entries])))
    for i, token in enumerate(tok.encode(text)):
        if tracker.push(token, TokenLogprob(token, -float(i))):
            break
    if not tracker.done:
        tracker._finish("length", flush=True)
    return tracker, events


def test_logprobs_stream_with_the_text_they_complete(tok):
    text = "héllo 你好 🚀 done"
    tracker, events = _with_logprobs(tok, text)
    ids = tok.encode(text)
    assert [e.token for e in tracker.logprobs] == ids  # one entry per token, in order
    assert sum((tokens for kind, tokens in events if kind == "logprobs"), []) == ids  # each streamed once
    texts = "".join(piece for kind, piece in events if kind == "text")
    assert texts == text and events[0][0] == "logprobs"  # entries come before the text they complete
    sent, shown = 0, ""
    for kind, value in events:  # a piece never arrives before the entries of the tokens it shows
        if kind == "logprobs":
            sent += len(value)
        else:
            shown += value
            assert tok.decode(ids[:sent]).startswith(shown)


def test_logprobs_stop_with_the_text_a_stop_string_cuts(tok):
    tracker, events = _with_logprobs(tok, "alpha beta STOP gamma delta", stop=("STOP",))
    kept = [e.token for e in tracker.logprobs]
    assert tracker.text == "alpha beta " and tok.decode(kept).startswith("alpha beta ")
    assert "STOP" not in tok.decode(kept[:-1])  # nothing past the token where the stop string begins
    assert sum((tokens for kind, tokens in events if kind == "logprobs"), []) == kept


def test_special_tokens_are_skipped_in_text_but_kept_in_ids(tok):
    ids = tok.encode("ab<|im_start|>cd")
    assert tok.token_id("<|im_start|>") in ids
    for skip, text in ((True, "abcd"), (False, "ab<|im_start|>cd")):
        pieces = []
        tracker = OutputTracker(tok, (), (), 100, pieces.append, skip_special=skip)
        tracker.push_many(ids)
        tracker._finish("length", flush=True)
        assert tracker.text == "".join(pieces) == text and tracker.token_ids == ids
