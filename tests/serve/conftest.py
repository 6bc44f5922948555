import pytest
from fastapi.testclient import TestClient

from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.serve.app import build_app
from tests.serve.fakes import ScriptedEngine

MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny_target(make_gguf):
    return load_target(make_gguf(), device="cpu")


@pytest.fixture
def tiny_engine(tiny_target):
    return Engine(tiny_target, default_config=GenerationConfig(max_new_tokens=16))


@pytest.fixture
def scripted(tiny_target):
    return ScriptedEngine(tiny_target)


@pytest.fixture
def client(scripted):
    with TestClient(build_app(scripted, MODEL)) as c:
        yield c


@pytest.fixture
def real_client(tiny_engine):
    with TestClient(build_app(tiny_engine, MODEL)) as c:
        yield c
