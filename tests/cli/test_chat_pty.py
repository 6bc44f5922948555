"""`flashtree chat` as a user runs it: a real process on a pseudo-terminal, keys in, screen out."""

import io
import os
import re
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flashtree
from flashtree.cli.chat import ChatSession, repl
from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target

pty = pytest.importorskip("pty")
termios = pytest.importorskip("termios")
fcntl = pytest.importorskip("fcntl")

ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
MAX_TOKENS = 12


class Screen:
    """The master side of a pty: what the program wrote, with the escape sequences taken out."""

    def __init__(self, fd: int):
        self.fd = fd
        self.raw = b""

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace")).replace("\r", "")

    def wait_for(self, pattern: str, start: int = 0, timeout: float = 15.0) -> int:
        """Reads until `pattern` shows up past `start` (in `text`); returns where its match ends."""
        deadline = time.monotonic() + timeout
        while True:
            if match := re.compile(pattern).search(self.text, start):
                return match.end()
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"{pattern!r} did not appear; the screen so far:\n{self.text}")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], min(timeout, 0.2))
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the program exited and closed its side
            return False
        self.raw += data
        return bool(data)

    def drain(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._read(deadline - time.monotonic()):
            pass

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())


def expected_reply(path: Path) -> tuple[str, int]:
    """The same conversation in-process: the reply text and its token count."""
    from rich.console import Console

    session = ChatSession(Engine(load_target(path, device="cpu")), GenerationConfig(max_new_tokens=MAX_TOKENS),
                          thinking=False)
    repl(session, ["hello"], Console(file=io.StringIO()))
    return session.messages[-1]["content"] or "", session.last_stats.new_tokens


def test_chat_in_a_pseudo_terminal(make_gguf, tmp_path):
    try:
        master, slave = pty.openpty()
    except OSError as exc:
        pytest.skip(f"no pseudo-terminal: {exc}")
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # wide: no wrapped lines
    path = make_gguf()
    src = str(Path(flashtree.__file__).resolve().parents[1])
    env = dict(os.environ, TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1", XDG_STATE_HOME=str(tmp_path),
               PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen([sys.executable, "-m", "flashtree.cli.main", "chat", "--model", str(path),
                                "--device", "cpu", "--no-think", "--max-tokens", str(MAX_TOKENS)],
                               stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    screen = Screen(master)
    try:
        reply, tokens = expected_reply(path)  # while the child loads
        at = screen.wait_for(r">>>", timeout=30)
        # the loading bar redraws one line in place and erases it: only the banner line is left above the prompt
        assert screen.raw[:screen.raw.index(b">>>")].count(b"\n") == 1, screen.text[:at]
        screen.type("hello\r")
        stats_at = screen.wait_for(rf"{tokens} tokens · [\d.]+ tok/s · acceptance length 1\.00\n", at)
        answer = screen.text[at:stats_at].split("hello", 1)[1]  # past the echoed input
        words = re.findall(r"[A-Za-z]{3,}", reply)  # the random model's reply also holds control characters
        assert words and all(word in answer for word in words), (reply, answer)
        at = screen.wait_for(r">>>", stats_at)
        screen.type("/stats\r")
        at = screen.wait_for(rf"{tokens} tokens · .* · prompt \d+ tokens · prefill [\d.]+ s · \d+ target steps", at)
        at = screen.wait_for(r">>>", at)
        screen.type("/exit\r")
        screen.drain()
        assert process.wait(10) == 0, screen.text
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
