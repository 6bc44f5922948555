import _thread
import argparse
import io
import signal

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from flashtree.cli.chat import CHAT_MAX_TOKENS, ChatSession, add_chat_parser, repl, terminal_lines
from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.errors import FlashtreeError
from tests.serve.fakes import ScriptedEngine


class InterruptingEngine(ScriptedEngine):
    """Presses Ctrl-C (a KeyboardInterrupt in the main thread) right after the first streamed piece."""

    def generate(self, prompt_ids, config, on_text=None, cancelled=None):
        pressed = []

        def on_text_then_ctrl_c(text):
            on_text(text)
            if not pressed:
                pressed.append(True)
                _thread.interrupt_main()

        return super().generate(prompt_ids, config, on_text_then_ctrl_c, cancelled)


@pytest.fixture(scope="module")
def target(make_gguf):
    return load_target(make_gguf(), device="cpu")


def run(engine, lines, **session_kwargs) -> tuple[ChatSession, str]:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    session = ChatSession(engine, GenerationConfig(max_new_tokens=64), **session_kwargs)
    repl(session, lines, console)
    return session, console.file.getvalue()


def prompt_of(engine, i=-1) -> str:
    return engine.tokenizer.decode(engine.prompts[i])


def test_reply_streams_reasoning_and_answer_and_keeps_history(target):
    engine = ScriptedEngine(target, script="Simple greeting.\n</think>\n\nHello, human!")
    session, out = run(engine, ["hi", "and again"])
    assert "Simple greeting." in out and "Hello, human!" in out
    assert "tokens ·" in out and "tok/s" in out and "acceptance length 1.00" in out
    assert session.messages[:2] == [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "Hello, human!", "reasoning_content": "Simple greeting."}]
    second = prompt_of(engine)
    assert "<|im_start|>user\nhi<|im_end|>" in second and "Hello, human!" in second  # multi-turn history
    assert second.endswith("<|im_start|>user\nand again<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_slash_commands(target):
    engine = ScriptedEngine(target, script="</think>\n\nOK.")
    lines = ["/help", "/stats", "/system Answer in French.", "/think off", "bonjour", "/stats", "/think maybe",
             "/nope", "/clear", "/think on", "/system", "hello", "/exit", "never read"]
    session, out = run(engine, lines)
    for command in ("/clear", "/system TEXT", "/think on|off", "/set NAME VALUE", "/stats", "/exit", "/bye"):
        assert command in out  # /help
    assert "no reply yet" in out
    first = prompt_of(engine, 0)
    assert first.startswith("<|im_start|>system\nAnswer in French.<|im_end|>")
    assert first.endswith("<think>\n\n</think>\n\n")  # /think off reached the template
    assert "prompt " in out and "target steps" in out  # /stats after a reply
    assert "usage: /think on|off" in out and "unknown command /nope" in out
    last = prompt_of(engine)
    assert "bonjour" not in last and "system" not in last and last.endswith("<think>\n")  # /clear, /system, /think on
    assert len(engine.prompts) == 2 and session.messages[-1]["content"] == "OK."  # /exit stopped the loop


def test_set_temperature_and_bye(target):
    engine = ScriptedEngine(target, script="</think>\n\nOK.")
    lines = ["/set temperature 0.7", "hi", "/set", "/set temperature hot", "/set temperature 3", "/set top_p 0.9",
             "/set top_k -3", "/set bogus 1", "/set temperature 0", "/bye", "never read"]
    session, out = run(engine, lines)
    assert "temperature 0.7: sampling" in out and session.config.sampling.temperature in (0, 0.7)
    assert "usage: /set temperature X (now 0.7)" in out  # kept in the session
    assert "temperature must be a number from 0 to 2, got 'hot'" in out and "got '3'" in out
    assert out.count("usage: /set temperature X") == 2  # "/set" alone and an unknown name
    assert session.config.sampling.top_p == 0.9 and "top_k must be >= 0" in out
    assert "temperature 0: greedy decoding" in out and session.temperature == 0
    assert len(engine.prompts) == 1 and "never read" not in str(session.messages)  # /bye quit
    assert out.count("acceptance length 1.00") == 1 and "tok/s" in out  # one stats line after the answer


@pytest.fixture
def sigint_raises():
    """A process started in the background ignores SIGINT, and then interrupt_main does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_stops_the_reply_and_the_repl_goes_on(target, sigint_raises):
    engine = InterruptingEngine(target, script="word " * 300, delay=0.005)
    session, out = run(engine, ["tell me a story", "/stats"])
    stopped = engine.results[-1]
    assert stopped.finish_reason == "cancelled" and len(stopped.token_ids) < 300
    assert "[stopped]" in out and "no reply yet" not in out
    assert session.last_stats is stopped.stats and f"{stopped.stats.new_tokens} tokens" in out  # /stats of it
    assert session.messages == []  # the stopped turn is forgotten


def test_triple_quoted_block_is_one_message(target):
    engine = ScriptedEngine(target, script="</think>\n\nok")
    session, _ = run(engine, ['"""first line', "second line", 'end"""', '"""one-liner"""'])
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["first line\nsecond line\nend",
                                                                                "one-liner"]


def test_engine_errors_are_printed_not_raised(target):
    engine = ScriptedEngine(target)

    def fail(*args, **kwargs):
        raise FlashtreeError("the prompt is too long")

    engine.generate = fail
    session, out = run(engine, ["hi"])
    assert "error: the prompt is too long" in out and session.messages == []


def test_real_tiny_engine(target):
    session, out = run(Engine(target), ["hello", "/stats"], thinking=False)
    assert session.last_stats is not None and session.last_stats.new_tokens > 0
    assert "target steps" in out and len(session.messages) == 2


def test_terminal_lines_read_a_prompt_with_history(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    with create_pipe_input() as pipe:
        pipe.send_text("hello\r/stats\r")
        lines = terminal_lines(pipe, DummyOutput())
        assert [next(lines), next(lines)] == ["hello", "/stats"]
        pipe.close()
        assert list(lines) == []  # end of input ends the REPL
    assert "hello" in (tmp_path / "flashtree" / "chat_history").read_text()


def test_parser_flags():
    sub = argparse.ArgumentParser().add_subparsers()
    args = add_chat_parser(sub).parse_args(["--system", "Be brief.", "--no-think", "--max-tokens", "64"])
    assert (args.system, args.think, args.max_tokens) == ("Be brief.", False, 64)
    assert args.handler.__name__ == "run_chat"
    defaults = add_chat_parser(argparse.ArgumentParser().add_subparsers()).parse_args([])
    assert (defaults.think, defaults.max_tokens) == (None, CHAT_MAX_TOKENS)  # the template decides; a short reply


def test_set_max_tokens(target):
    session, out = run(ScriptedEngine(target, script="a b c d e f g h"), ["/set max_tokens 3", "hi", "/set max_tokens x"])
    assert session.config.max_new_tokens == 3 and "max_tokens 3" in out
    assert session.last_stats.new_tokens == 3
    assert "max_tokens must be a whole number >= 1, got 'x'" in out
