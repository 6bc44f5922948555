"""`flashtree chat`: a terminal REPL that streams replies from the same engine the server uses.

torch and the engine are imported inside the functions that run the command: `flashtree --help` builds
every subcommand's parser and must not wait for them."""

from __future__ import annotations

import argparse
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from rich.console import Console

from flashtree.cli.args import (add_parse_special_arg, add_thinking_arg, engine_args, int_range, sampling_from_args,
                                thinking_kwargs)
from flashtree.engine.prefix_cache_flags import add_prefix_cache_args, prefix_cache_settings
from flashtree.errors import FlashtreeError
from flashtree.formats.chat_template import template_or_chatml
from flashtree.serve.parsing import Delta, OutputParser, opens_thinking

if TYPE_CHECKING:  # the engine imports torch, which `flashtree chat --help` must not wait for
    from flashtree.engine.config import GenerationConfig, GenerationResult, GenerationStats

CHAT_MAX_TOKENS = 1024  # a reply's length cap unless --max-tokens or /set max_tokens changes it

HELP = """\
/help              this list
/clear             forget the conversation (the system prompt stays)
/system TEXT       set the system prompt (/system alone removes it)
/think on|off      let the model reason before answering, or not (default: the model's chat template)
/set NAME VALUE    max_tokens (longest reply); sampling: temperature (0 = greedy), top_p, top_k, min_p, seed,
                   repetition_penalty, presence_penalty, frequency_penalty (lossless with speculation)
/stats             tokens, speed and acceptance length of the last reply (also one stopped with Ctrl-C)
/exit, /bye        quit (also Ctrl-D)
Ctrl-C stops a reply; Alt-Enter inserts a newline; a line starting with \"\"\" opens a block that \"\"\" closes."""


class ChatSession:
    """A conversation: system prompt, thinking switch (None: the chat template's default), message history,
    and the last reply's stats."""

    def __init__(self, engine, config: GenerationConfig, system: str | None = None, thinking: bool | None = None):
        self.engine = engine
        self.config = config
        self.system = system
        self.thinking = thinking
        self.template = template_or_chatml(engine.target.chat_template)
        self.messages: list[dict] = []
        self.last_stats: GenerationStats | None = None

    @property
    def temperature(self) -> float:
        return self.config.sampling.temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.config = replace(self.config, sampling=replace(self.config.sampling, temperature=value))

    def prompt(self) -> tuple[str, list[int]]:
        """The conversation's prompt text and token ids (the user's text never makes control tokens)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return self.engine.tokenizer.encode_chat(self.template, system + self.messages,
                                                 parse_special=self.engine.parse_special,
                                                 **thinking_kwargs(self.thinking))

    def reply(self, text: str, show: Callable[[Delta], None]) -> GenerationResult:
        """Answers `text`, passing reasoning/content deltas to `show` as they stream. A reply stopped by
        Ctrl-C (KeyboardInterrupt) or an error is not kept in the conversation."""
        self.messages.append({"role": "user", "content": text})
        try:
            prompt, ids = self.prompt()
            parser = OutputParser(opens_thinking(prompt))
            message = Delta()

            def on_text(piece: str) -> None:
                delta = parser.feed(piece)
                message.add(delta)
                show(delta)

            result = _cancellable(lambda cancelled: self.engine.generate(ids, self.config, on_text, cancelled))
        except ReplyStopped as stopped:
            self.messages.pop()
            self.last_stats = stopped.result.stats if stopped.result is not None else self.last_stats
            raise
        except BaseException:
            self.messages.pop()
            raise
        tail = parser.finish()
        message.add(tail)
        show(tail)
        self.messages.append({"role": "assistant", "content": message.content, "reasoning_content": message.reasoning})
        self.last_stats = result.stats
        return result


class ReplyStopped(KeyboardInterrupt):
    """Ctrl-C stopped a reply; `result` is what the engine had generated (None if it failed meanwhile)."""

    def __init__(self, result: GenerationResult | None):
        super().__init__()
        self.result = result


def _cancellable(generate: Callable[[Callable[[], bool]], GenerationResult]) -> GenerationResult:
    """Runs generation off the main thread, so that Ctrl-C reaches us here and stops it within one step;
    then raises ReplyStopped with the partial result."""
    cancel = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(generate, cancel.is_set)
        try:
            while True:
                try:
                    return future.result(timeout=0.1)  # short waits let the KeyboardInterrupt through
                except FutureTimeout:
                    continue
        except KeyboardInterrupt:
            cancel.set()
            failed = future.exception()  # waits for the engine to stop
            raise ReplyStopped(None if failed else future.result()) from None


class _Printer:
    """Streams deltas to the console: reasoning dimmed, a line break where the answer starts."""

    def __init__(self, console: Console):
        self.console = console
        self.section = ""

    def __call__(self, delta: Delta) -> None:
        for section, text, style in (("reasoning", delta.reasoning, "dim italic"), ("content", delta.content, "")):
            if text:
                if self.section not in ("", section):
                    self.console.print("\n")
                self.section = section
                self.console.print(text, style=style, end="", markup=False, highlight=False)

    def end(self) -> None:
        if self.section:
            self.console.print()


def _stats_line(stats: GenerationStats) -> str:
    return (f"{stats.new_tokens} tokens · {stats.tokens_per_s:.1f} tok/s · "
            f"acceptance length {stats.acceptance_length:.2f}")


def _cmd_help(session: ChatSession, arg: str, console: Console) -> None:
    console.print(HELP, markup=False, highlight=False)


def _cmd_clear(session: ChatSession, arg: str, console: Console) -> None:
    session.messages.clear()
    console.print("conversation cleared")


def _cmd_system(session: ChatSession, arg: str, console: Console) -> None:
    session.system = arg or None
    console.print("system prompt set" if arg else "system prompt removed")


def _cmd_think(session: ChatSession, arg: str, console: Console) -> None:
    if arg not in ("on", "off"):
        console.print("usage: /think on|off")
        return
    session.thinking = arg == "on"
    console.print(f"thinking {arg}")


_SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int,
             "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float}


def _cmd_set(session: ChatSession, arg: str, console: Console) -> None:
    name, _, value = arg.partition(" ")
    if name == "max_tokens" and value.strip():
        _set_max_tokens(session, value, console)
        return
    if name not in _SETTABLE or not value.strip():
        now = ", ".join(f"{k}={getattr(session.config.sampling, k)}" for k in _SETTABLE)
        console.print(f"usage: /set temperature X (now {session.temperature:g}); also max_tokens, "
                      f"{', '.join(list(_SETTABLE)[1:])}\nnow: max_tokens={session.config.max_new_tokens}, {now}",
                      markup=False)
        return
    if name == "temperature":
        _set_temperature(session, value, console)
        return
    try:
        sampling = replace(session.config.sampling, **{name: _SETTABLE[name](value)})
    except (ValueError, FlashtreeError) as exc:
        console.print(f"/set {name}: {exc}", markup=False)
        return
    session.config = replace(session.config, sampling=sampling)
    console.print(f"{name} {value.strip()}")


def _set_max_tokens(session: ChatSession, value: str, console: Console) -> None:
    if not value.strip().isdigit() or int(value) < 1:
        console.print(f"max_tokens must be a whole number >= 1, got {value.strip()!r}", markup=False)
        return
    session.config = replace(session.config, max_new_tokens=int(value))
    console.print(f"max_tokens {int(value)}: replies stop after {int(value)} tokens")


def _set_temperature(session: ChatSession, value: str, console: Console) -> None:
    try:
        temperature = float(value)
    except ValueError:
        temperature = -1.0
    if not 0 <= temperature <= 2:  # also rejects nan
        console.print(f"temperature must be a number from 0 to 2, got {value.strip()!r}", markup=False)
        return
    session.temperature = temperature
    console.print("temperature 0: greedy decoding" if temperature == 0 else f"temperature {temperature:g}: sampling")


def _cmd_stats(session: ChatSession, arg: str, console: Console) -> None:
    stats = session.last_stats
    if stats is None:
        console.print("no reply yet")
        return
    console.print(f"{_stats_line(stats)} · prompt {stats.prompt_tokens} tokens · prefill {stats.prefill_s:.3f} s · "
                  f"{stats.steps} target steps", markup=False)


COMMANDS = {"/help": _cmd_help, "/?": _cmd_help, "/clear": _cmd_clear, "/system": _cmd_system,
            "/think": _cmd_think, "/set": _cmd_set, "/stats": _cmd_stats}
EXIT = ("/exit", "/quit", "/bye")


def _blocks(lines: Iterable[str]) -> Iterator[str]:
    """Joins a \"\"\"-delimited block of lines into one message (ollama's multi-line convention)."""
    lines = iter(lines)
    for line in lines:
        if not line.lstrip().startswith('"""'):
            yield line
            continue
        block = [line.lstrip()[3:]]
        while not block[-1].rstrip().endswith('"""'):
            more = next(lines, None)
            if more is None:
                break
            block.append(more)
        yield "\n".join(block).rstrip().removesuffix('"""')


def repl(session: ChatSession, lines: Iterable[str], console: Console) -> None:
    """The chat loop over input `lines` (the terminal, or a list in tests), writing to `console`."""
    console.print("flashtree chat: /help for commands, Ctrl-C stops a reply, /exit or Ctrl-D quits", style="bold")
    for line in _blocks(lines):
        text = line.strip()
        if not text:
            continue
        name, _, arg = text.partition(" ")
        if name in EXIT:
            return
        if name.startswith("/"):
            command = COMMANDS.get(name)
            if command is None:
                console.print(f"unknown command {name}: /help lists them", markup=False)
            else:
                command(session, arg.strip(), console)
            continue
        _answer(session, text, console)


def _answer(session: ChatSession, text: str, console: Console) -> None:
    printer = _Printer(console)
    try:
        result = session.reply(text, printer)
    except KeyboardInterrupt:
        printer.end()
        console.print("[stopped]", style="yellow", markup=False)
        return
    except FlashtreeError as exc:
        printer.end()
        console.print(f"error: {exc}", style="red", markup=False)
        return
    printer.end()
    console.print(_stats_line(result.stats), style="dim", markup=False)


def _history():
    from prompt_toolkit.history import FileHistory, InMemoryHistory  # deferred as torch: only the chat needs it

    path = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "flashtree" / "chat_history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return FileHistory(str(path))
    except OSError:  # read-only home: history for this session only
        return InMemoryHistory()


def terminal_lines(input=None, output=None) -> Iterator[str]:
    """Lines typed at a prompt_toolkit prompt with persistent history, until Ctrl-D. `input`/`output`
    default to the terminal (tests pass a pipe)."""
    from prompt_toolkit import PromptSession  # deferred as torch: only the chat needs it
    from prompt_toolkit.completion import WordCompleter
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    prompt = PromptSession(history=_history(), key_bindings=keys, input=input, output=output,
                           completer=WordCompleter([*COMMANDS, *EXIT], sentence=True))
    while True:
        try:
            yield prompt.prompt(">>> ")
        except KeyboardInterrupt:  # at the prompt Ctrl-C only clears the line
            continue
        except EOFError:
            return


def add_chat_parser(subparsers) -> argparse.ArgumentParser:
    """Chat flags only; the model flags are added by the caller."""
    p = subparsers.add_parser("chat", help="chat with the model in the terminal",
                              description="Interactive chat; type /help inside for commands.")
    p.add_argument("--system", help="system prompt")
    add_thinking_arg(p)
    p.add_argument("-n", "--max-tokens", "--n-predict", type=int_range(1), default=CHAT_MAX_TOKENS,
                   help=f"longest reply in tokens (default {CHAT_MAX_TOKENS}; /set max_tokens N changes it)")
    add_parse_special_arg(p)
    add_prefix_cache_args(p)
    p.set_defaults(handler=run_chat)
    return p


def run_chat(args: argparse.Namespace) -> int:
    """The chat; also what `flashtree run` without a prompt opens, with its sampling flags."""
    from flashtree.engine.loader import load_engine

    console = Console()
    # The layer bar alone (stderr, erased when done): a spinner drawn beside it left stale lines behind.
    engine = load_engine(engine_args(args, progress=True, prefill_progress=True, parse_special=args.parse_special,
                                     **prefix_cache_settings(args)))
    sampling = sampling_from_args(args) if hasattr(args, "temperature") else None
    config = engine.config_for(max_new_tokens=args.max_tokens or CHAT_MAX_TOKENS, ctx=args.ctx, sampling=sampling)
    repl(ChatSession(engine, config, system=args.system, thinking=args.think), terminal_lines(), console)
    return 0
