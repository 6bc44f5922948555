"""Test doubles for protocol tests: an engine with the real Engine.generate signature that replays
scripted text, so tool-call and reasoning output is deterministic."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from flashtree.engine.config import GenerationConfig, GenerationResult, GenerationStats
from flashtree.engine.generate import Engine
from flashtree.engine.output import OutputTracker


class ScriptedEngine:
    """Replays `script` token by token through the engine's real OutputTracker (so stop strings,
    max_tokens and cancellation behave as in Engine), then ends with end-of-turn.

    `delay`: seconds per token. `gate`: when given, generation waits (polling `cancelled`) until it is
    set. `started` is set when a generation begins; `results` collects every GenerationResult.
    """

    def __init__(self, target, script: str = "Hello!", delay: float = 0.0, gate: threading.Event | None = None):
        self.target = target
        self.script = script
        self.delay = delay
        self.gate = gate
        self.default_config = GenerationConfig(max_new_tokens=256)
        self.parse_special = False  # as Engine's
        self.started = threading.Event()
        self.results: list[GenerationResult] = []
        self.prompts: list[list[int]] = []

    config_for = Engine.config_for

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def generate(self, prompt_ids, config, on_text=None, cancelled=None, on_logprobs=None) -> GenerationResult:
        self.prompts.append(list(prompt_ids))
        self.started.set()
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        out = OutputTracker(self.tokenizer, self.tokenizer.eos_ids, config.stop, config.max_new_tokens, on_text, cancelled,
                            skip_special=config.skip_special_tokens)
        while self.gate is not None and not self.gate.is_set() and not (cancelled and cancelled()):
            time.sleep(0.005)
        started = time.perf_counter()
        tokens = self.tokenizer.encode(self.script) + [min(self.tokenizer.eos_ids)]
        for token in tokens:
            if self.delay:
                time.sleep(self.delay)
            stats.steps += 1
            stats.accepted[1] += 1
            if out.push(token):
                break
        stats.total_s = time.perf_counter() - started
        stats.new_tokens = len(out.token_ids)
        result = GenerationResult(out.token_ids, out.text, out.finish_reason or "stop", stats, out.stop_string)
        self.results.append(result)
        return result


@contextlib.contextmanager
def live_server(app):
    """Runs `app` on uvicorn at a free 127.0.0.1 port in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
