import argparse

import pytest

import flashtree.engine.loader as loader
from flashtree.cli.args import add_model_args
from flashtree.engine.config import EngineArgs
from flashtree.serve import cli
from flashtree.serve.cli import add_serve_parser, engine_factory


def parse(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_model_args(add_serve_parser(sub))
    return parser.parse_args(["serve", *argv])


def test_defaults_bind_loopback():
    args = parse([])
    assert (args.host, args.port, args.api_key, args.max_queued_requests) == ("127.0.0.1", 8000, None, 16)
    assert args.handler is cli.run_serve


@pytest.mark.parametrize("flags", [["--max-queued-requests", "0"], ["--max-request-mb", "0"],
                                   ["--max-request-mb", "inf"], ["--max-request-mb", "lots"]])
def test_bad_limits_are_rejected(capsys, flags):
    with pytest.raises(SystemExit):
        parse(flags)


def test_engine_factory_applies_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(loader, "load_engine", calls.append)
    args = parse(["--model", "m.gguf", "--draft", "d", "--budget", "8", "--ctx", "2048", "--max-tokens", "99"])
    engine_factory(args)()
    assert calls == [EngineArgs(model="m.gguf", draft="d", budget=8, ctx=2048, max_new_tokens=99, progress=True,
                                prefix_cache=True)]


def test_run_serve_hands_the_app_to_uvicorn(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: seen.update(app=app, **kw))
    model = tmp_path / "Qwen3.6-27B-Q4_K_M.gguf"  # a real GGUF header: the server checks it before starting
    model.symlink_to(loader.DEMO_TARGET)
    args = parse(["--model", str(model), "--port", "9001", "--api-key", "k", "--max-request-mb", "2", "--parse-special"])
    assert cli.run_serve(args) == 0
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 9001)
    server = seen["app"].state.server
    assert (server.model_name, server.api_key, server.status) == ("Qwen3.6-27B-Q4_K_M", "k", "loading")
    assert server.parse_special and {"max_bytes": 2 * 2**20} in [m.kwargs for m in seen["app"].user_middleware]


@pytest.mark.parametrize("flags, message", [
    (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf: no such file"),
    (["--draft", "/nonexistent-draft"], "/nonexistent-draft/config.json not found"),
    (["--api-key", ""], "the API key is empty"),
])
def test_missing_files_fail_before_the_server_starts(flags, message, capsys, monkeypatch):
    from flashtree.cli.main import main

    monkeypatch.setattr("uvicorn.run", lambda *a, **k: pytest.fail("the server started"))
    assert main(["serve", *flags]) == 1
    assert message in capsys.readouterr().err


def test_cors_origins_default_to_any_only_on_loopback():
    assert cli.allowed_origins(None, "127.0.0.1") == ["*"] and cli.allowed_origins(None, "localhost") == ["*"]
    assert cli.allowed_origins(None, "0.0.0.0") == []
    assert cli.allowed_origins("http://a.example, http://b.example", "0.0.0.0") == ["http://a.example",
                                                                                    "http://b.example"]
