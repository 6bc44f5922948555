"""One engine, one worker thread, requests served in arrival order from a bounded queue.

The engine is synchronous and not re-entrant, so the event loop hands it work through a queue and
gets text back through `call_soon_threadsafe`. Cancellation (client gone, timeout, shutdown) is a flag
the engine polls once per target step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Sequence

from flashtree.engine.config import GenerationConfig, GenerationResult
from flashtree.errors import FlashtreeError
from flashtree.serve.errors import APIError

log = logging.getLogger("flashtree.serve")


class Job:
    def __init__(self, prompt_ids: Sequence[int], config: GenerationConfig, timeout: float, request_id: str = ""):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.config = config
        self.deadline = time.monotonic() + timeout
        self.timed_out = False
        self.result: GenerationResult | None = None
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    def should_stop(self) -> bool:
        if not self.timed_out and time.monotonic() > self.deadline:
            self.timed_out = True
        return self.timed_out or self._cancel.is_set()

    def post(self, kind: str, value) -> None:
        """From the worker thread: hand an event to the request's coroutine."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is waiting for this job any more
            pass

    async def pieces(self) -> AsyncIterator[tuple[str, list]]:
        """Generated text pieces, each with the log-probability entries of the tokens it completes (empty
        unless asked for; a last piece of "" carries any left); sets `result` at the end or raises the
        job's APIError."""
        entries: list = []
        while True:
            kind, value = await self._events.get()
            if kind == "logprobs":
                entries += value
            elif kind == "text":
                yield value, entries
                entries = []
            elif kind == "error":
                raise value
            else:
                if entries:
                    yield "", entries
                self.result = value
                return

    async def texts(self) -> AsyncIterator[str]:
        """`pieces` without their log-probabilities."""
        async for text, _ in self.pieces():
            if text:
                yield text

    async def wait(self) -> GenerationResult:
        async for _ in self.texts():
            pass
        return self.result


class Metrics:
    """Counters for /metrics; written by the worker thread, read by the event loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self.finished: dict[str, int] = {}  # requests by outcome: stop, length, cancelled, error
        self.rejected = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.target_steps = 0
        self.committed_tokens = 0  # acceptance length = committed tokens / target steps
        self.decode_s = 0.0

    def reject(self) -> None:
        with self._lock:
            self.rejected += 1

    def record(self, outcome: str, result: GenerationResult | None = None) -> None:
        with self._lock:
            self.finished[outcome] = self.finished.get(outcome, 0) + 1
            if result is not None:
                stats = result.stats
                self.prompt_tokens += stats.prompt_tokens
                self.generated_tokens += stats.new_tokens
                self.target_steps += stats.steps
                self.committed_tokens += sum(k * v for k, v in stats.accepted.items())
                self.decode_s += stats.decode_s

    def render(self, waiting: int, running: int) -> str:
        """Prometheus text exposition format."""
        with self._lock:
            rows = [("requests_total", "counter", "Finished generation requests by outcome.",
                     [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.finished.items())] or [("", 0)]),
                    ("requests_rejected_total", "counter", "Requests refused because the queue was full.",
                     [("", self.rejected)]),
                    ("prompt_tokens_total", "counter", "Prompt tokens processed.", [("", self.prompt_tokens)]),
                    ("generation_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)]),
                    ("target_steps_total", "counter", "Target forwards after prefill.", [("", self.target_steps)]),
                    ("decode_seconds_total", "counter", "Time spent decoding after prefill.", [("", self.decode_s)]),
                    ("tokens_per_second", "gauge", "Generated tokens per decode second, over all requests.",
                     [("", self.generated_tokens / self.decode_s if self.decode_s else 0.0)]),
                    ("acceptance_length", "gauge", "Tokens committed per target step, over all requests.",
                     [("", self.committed_tokens / self.target_steps if self.target_steps else 0.0)]),
                    ("queue_depth", "gauge", "Requests waiting for the engine.", [("", waiting)]),
                    ("requests_running", "gauge", "Requests being generated.", [("", running)])]
        lines = []
        for name, kind, help_text, samples in rows:
            lines += [f"# HELP flashtree_{name} {help_text}", f"# TYPE flashtree_{name} {kind}"]
            lines += [f"flashtree_{name}{labels} {value}" for labels, value in samples]
        return "\n".join(lines) + "\n"


class Scheduler:
    def __init__(self, engine, queue_size: int, metrics: Metrics):
        self.engine = engine
        self.queue_size = queue_size
        self.metrics = metrics
        self.running: Job | None = None
        self.accepting = True
        # Unbounded underneath: the cap is enforced in submit, so the shutdown sentinel can always be queued.
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="flashtree-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def submit(self, *jobs: Job) -> None:
        """Queue one request's jobs (one per choice), all or none. Called on the event loop thread only, so
        the size check and the puts cannot race."""
        if not self.accepting:
            raise APIError(503, "the server is shutting down", retry_after=5)
        if len(jobs) > self.queue_size:
            raise APIError(400, f"n={len(jobs)} choices need more than the {self.queue_size} queue places "
                                f"(--max-queued-requests)", param="n")
        if self._jobs.qsize() + len(jobs) > self.queue_size:
            self.metrics.reject()
            raise APIError(503, f"the server is busy: {self._jobs.qsize()} requests are already waiting; retry later",
                           retry_after=1)
        for job in jobs:
            self._jobs.put(job)

    def shutdown(self, grace: float) -> None:
        """Stop taking requests, let queued and running ones finish for up to `grace` seconds, then cancel
        whatever is left (the engine notices within one step)."""
        self.accepting = False
        self._jobs.put(None)
        self._thread.join(grace)
        if self._thread.is_alive():
            with self._jobs.mutex:
                pending = [job for job in self._jobs.queue if job is not None]
            for job in [*pending, self.running]:
                if job is not None:
                    job.cancel()
            self._thread.join()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.running = job
            self._run(job)
            self.running = None

    def _run(self, job: Job) -> None:
        if job.should_stop():  # the client left or the deadline passed while it waited: don't even prefill
            self.metrics.record("cancelled")
            log.info("%s prompt_tokens=%d completion_tokens=0 finish=cancelled (before it started)",
                     job.request_id, len(job.prompt_ids))
            job.post("error", APIError(503, "the request timed out or was cancelled before it started", retry_after=1))
            return
        try:
            streams = {"on_text": lambda text: job.post("text", text), "cancelled": job.should_stop}
            if job.config.logprobs is not None:
                streams["on_logprobs"] = lambda entries: job.post("logprobs", entries)
            result = self.engine.generate(job.prompt_ids, job.config, **streams)
        except FlashtreeError as exc:
            self.metrics.record("error")
            log.info("%s prompt_tokens=%d finish=error (%s)", job.request_id, len(job.prompt_ids), exc)
            job.post("error", APIError(400, str(exc)))
        except Exception as exc:  # the engine keeps serving whatever one request did to it
            log.exception("%s: generation failed", job.request_id)
            self.metrics.record("error")
            job.post("error", APIError(500, f"generation failed: {type(exc).__name__}: {exc}"))
        else:
            self.metrics.record(result.finish_reason, result)
            stats = result.stats
            log.info("%s prompt_tokens=%d completion_tokens=%d tok/s=%.1f AL=%.2f finish=%s", job.request_id,
                     stats.prompt_tokens, stats.new_tokens, stats.tokens_per_s, stats.acceptance_length,
                     result.finish_reason)
            job.post("done", result)
