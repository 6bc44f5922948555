"""Property-based requests from the server's own OpenAPI document (schemathesis), valid and invalid ones, against
the real tiny engine in-process: no response may be a 5xx. FLASHTREE_SCHEMATHESIS_EXAMPLES sets the examples per
operation and mode; the default keeps the run cheap (the issue's acceptance run uses 200)."""

import os

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.serve.app import build_app
from tests.serve.conftest import MODEL

EXAMPLES = int(os.environ.get("FLASHTREE_SCHEMATHESIS_EXAMPLES", "5"))


@pytest.fixture(scope="module")
def api_schema(tiny_target):
    # A short context bounds every generation, whatever max_tokens an example asks for.
    engine = Engine(tiny_target, default_config=GenerationConfig(max_new_tokens=4, ctx=96))
    app = build_app(engine, MODEL)
    with TestClient(app):  # runs the lifespan: the scheduler is up while schemathesis calls the app
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


def server_errors(api_schema, examples: int) -> tuple[int, list[str]]:
    """(requests made, a line per 5xx answer) over `examples` valid and `examples` invalid cases per operation."""
    made, errors = 0, []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                      derandomize=True, database=None)
            def call(case):
                nonlocal made
                response = case.call()
                made += 1
                if response.status_code >= 500:
                    errors.append(f"{operation.label} ({mode}): {response.status_code} {response.text[:200]}")

            try:
                call()
            except Unsatisfiable:  # an operation without inputs (GET /health) has no invalid cases
                assert mode == GenerationMode.NEGATIVE
    return made, errors


@pytest.mark.fuzz
def test_no_request_makes_a_server_error(api_schema):
    made, errors = server_errors(api_schema, EXAMPLES)
    print(f"schemathesis: {made} requests, {len(errors)} with status >= 500")
    assert made and not errors, "\n".join(errors[:10])
