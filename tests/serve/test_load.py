"""A bounded load test against a live uvicorn server: many clients at once, a small queue."""

import json
import threading
import time

import httpx

from flashtree.serve.app import build_app
from tests.serve.conftest import MODEL
from tests.serve.fakes import ScriptedEngine, live_server
from tests.serve.test_api import USER

CLIENTS, REQUESTS, QUEUE = 16, 4, 3


def one_request(http: httpx.Client, url: str, i: int) -> tuple[int, str | None]:
    """(status, Retry-After); streamed on odd i, and a 200 must be a complete reply."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 8, "stream": i % 2 == 1}
    if not body["stream"]:
        r = http.post(f"{url}/v1/chat/completions", json=body)
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            assert r.json()["flashtree"]["tokens"] > 0
        else:
            assert r.json()["error"]["type"] == "unavailable_error"
        return r.status_code, r.headers.get("retry-after")
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        if r.status_code == 200:
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
        return r.status_code, r.headers.get("retry-after")


def test_concurrent_clients_get_answers_or_clean_503s(tiny_target):
    engine = ScriptedEngine(tiny_target, script="word " * 20, delay=0.004)  # max_tokens 8: ~35 ms a request
    outcomes: list[tuple[int, str | None]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    started = time.monotonic()
    with live_server(build_app(engine, MODEL, queue_size=QUEUE)) as url:

        def client(c: int) -> None:
            try:
                with httpx.Client(timeout=httpx.Timeout(10.0)) as http:  # a hang fails the test, not the run
                    for i in range(REQUESTS):
                        outcome = one_request(http, url, c + i)
                        with lock:
                            outcomes.append(outcome)
            except BaseException as exc:  # noqa: BLE001 -- re-raised on the main thread below
                with lock:
                    failures.append(exc)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert not failures, failures[0]
        assert len(outcomes) == CLIENTS * REQUESTS
        statuses = [status for status, _ in outcomes]
        assert set(statuses) <= {200, 503}
        assert all(retry_after == "1" for status, retry_after in outcomes if status == 503)
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1  # the queue of 3 overflowed
        assert len(engine.results) == statuses.count(200)  # every accepted request ran, none twice

        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
        deadline = time.monotonic() + 2  # the worker marks itself idle just after posting the last reply
        while "flashtree_requests_running 0" not in (metrics := httpx.get(f"{url}/metrics", timeout=5).text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.01)
        assert f"flashtree_requests_rejected_total {statuses.count(503)}" in metrics
        assert "flashtree_queue_depth 0" in metrics
    assert time.monotonic() - started < 20
