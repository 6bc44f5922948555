import io
import json
import os
import subprocess
import sys

import pytest

from flashtree.cli.main import main
from flashtree.engine.planner import PlanRequest, target_from_preset
from flashtree.engine.sampling import SamplingParams
from flashtree.errors import FlashtreeError


@pytest.mark.parametrize("argv, message", [
    (["run", "hi", "--budget", "0"], "argument --budget: must be >= 1, got 0"),
    (["run", "hi", "-n", "-1"], "argument -n/--max-tokens/--n-predict: must be >= 0, got -1"),
    (["run", "hi", "--ctx", "1"], "argument -c/--ctx: must be >= 2, got 1"),
    (["run", "hi", "--topk", "many"], "argument --topk: expected an integer, got 'many'"),
    (["serve", "--port", "99999"], "argument --port: must be from 1 to 65535, got 99999"),
    (["plan", "--synthetic", "qwen3.6-27b", "-tp", "0"], "argument -tp/--tensor-parallel: must be >= 1, got 0"),
    (["bench", "--prompts", "0"], "argument --prompts: must be >= 1, got 0"),
    (["train", "target", "--out", "x", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["info", "x.gguf", "--ctx", "0"], "argument --ctx: must be >= 1, got 0"),
    (["run", "hi", "--gpu-memory", "lots"], "argument --gpu-memory: cannot read memory size 'lots'"),
    (["plan", "--synthetic", "qwen3.6-27b", "--gpu-memory", "24Gi"],
     "argument --gpu-memory: cannot read memory size '24Gi'"),
    (["bench", "--cuda-overhead", "lots"], "argument --cuda-overhead: cannot read memory size 'lots'"),
    (["bench", "--modes", "ar,bogus"], "argument --modes: unknown mode(s) bogus; choose from ar, chain, ddtree"),
])
def test_bad_counts_are_refused_by_name_while_parsing(argv, message, capsys):
    """argparse exits (code 2) before any handler runs, so no weight is read for a bad count."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--device", "tpu"], "unknown device 'tpu'; use cpu, cuda, cuda:N or auto"),
    (["--device", "cuda:x"], "unknown device 'cuda:x'"),
    (["--draft-device", "banana"], "unknown device 'banana'"),
    (["--draft-device", "cuda:99"], "device 'cuda:99' requested but"),
])
def test_bad_devices_are_one_line_errors(flags, message, capsys):
    assert main(["run", "hi", "-n", "1", *flags]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--synthetic", "tiny", "--model", "x.gguf"], "--synthetic tiny builds its own model"),
    (["bench", "--spec", "ar", "--modes", "ar,ddtree", "-n", "2"], "--modes ar,ddtree needs a draft model"),
    (["train", "target", "--out", "/proc/flashtree-out", "--steps", "1"], "--out /proc/flashtree-out: cannot create"),
])
def test_conflicting_or_impossible_requests_fail_before_the_work(argv, message, capsys):
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_gpus_without_cuda_devices_say_how_many_there_are(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert main(["run", "hi", "--gpus", "2"]) == 1
    assert "a split over 2 devices needs 2 CUDA devices; this machine has 0" in capsys.readouterr().err


def test_plan_request_checks_its_counts():
    config, weights, embed, dense, draft, layers = target_from_preset("qwen3.6-27b")
    with pytest.raises(FlashtreeError, match="prefill_chunk must be >= 1, got 0"):
        PlanRequest(config, weights, embed, draft, 4096, prefill_chunk=0)
    with pytest.raises(FlashtreeError, match="ctx must be >= 2, got 1"):
        PlanRequest(config, weights, embed, draft, 1)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -1.0, "temperature must be >= 0, got -1.0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
    ("presence_penalty", 3.0, r"presence_penalty must be in \[-2, 2\], got 3.0"),
])
def test_sampling_errors_name_the_field_and_value(field, value, message):
    with pytest.raises(FlashtreeError, match=message):
        SamplingParams(**{field: value})


def test_run_stats_line_for_a_single_token(capsys):
    """One token comes from the prefill alone: no decode step, so no acceptance length to show."""
    assert main(["run", "hi", "-n", "1", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "] 1 token, " in err and "no decode steps" in err and "acceptance length" not in err


def test_help_version_and_argument_errors_do_not_import_torch():
    """They answer at once: torch (seconds to import) loads only when a command runs."""
    code = ("import sys\nfrom flashtree.cli.main import main\n"
            "for argv in (['--help'], ['--version'], ['run', '--bogus'], ['bench', '--help'], ['plan', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_llama_cpp_flags_prompt_n_predict_and_ngl(capsys):
    assert main(["run", "-p", "def fib(n):", "--n-predict", "1", "-ngl", "99", "--device", "cpu", "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["token_ids"]) == 1
    assert err.count("\n") == 1 and "-ngl 99 ignored" in err  # one line, and no other output with --json


def test_a_prompt_given_twice_is_refused(capsys):
    assert main(["run", "one", "-p", "two"]) == 1
    assert "give the prompt once" in capsys.readouterr().err


def test_run_without_a_prompt_opens_the_chat_at_a_terminal(monkeypatch):
    opened = []
    monkeypatch.setattr("flashtree.cli.chat.run_chat", lambda args: opened.append(args) or 0)
    monkeypatch.setattr("sys.stdin", io.StringIO("ignored"))
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    assert main(["run", "--model", "demo"]) == 0
    assert opened and opened[0].model == "demo"


def test_run_without_a_prompt_reads_piped_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("def fib(n):"))
    assert main(["run", "-n", "2", "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] > 0


def test_special_tokens_stay_in_run_text_only_with_special(capsys, monkeypatch):
    from flashtree.engine.generate import Engine

    def generate(engine, prompt_ids, config, on_text=None, **kwargs):
        # what a model that writes <|im_start|> gets from the tracker: the same ids, text by --special
        from flashtree.engine.config import GenerationResult, GenerationStats
        from flashtree.engine.output import OutputTracker

        out = OutputTracker(engine.tokenizer, (), (), 10, skip_special=config.skip_special_tokens)
        ids = engine.tokenizer.encode("a<|im_start|>b")
        out.push_many(ids)
        out._finish("length", flush=True)
        return GenerationResult(out.token_ids, out.text, "length", GenerationStats())

    monkeypatch.setattr(Engine, "generate", generate)
    texts = []
    for flags in ([], ["--special"]):
        assert main(["run", "hi", "--json", "--device", "cpu", "--spec", "ar", *flags]) == 0
        texts.append(json.loads(capsys.readouterr().out))
    assert [t["text"] for t in texts] == ["ab", "a<|im_start|>b"] and texts[0]["token_ids"] == texts[1]["token_ids"]


def test_info_and_plan_take_the_demo_name(capsys):
    assert main(["info", "demo", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] and info["chat_template"]
    assert main(["plan", "--model", "demo", "--ctx", str(2 * info["context_length"]), "--json"]) == 0
    err = capsys.readouterr().err
    assert f"past the model's trained context ({info['context_length']} tokens)" in err


def test_bench_writes_json_only_where_out_says_and_names_the_draft(tmp_path, monkeypatch, capsys):
    from flashtree.engine.loader import DEMO_DRAFT

    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--prompts", "1", "-n", "4", "--device", "cpu", "--modes", "ar,ddtree"]
    assert main(argv) == 0
    assert list(tmp_path.iterdir()) == [] and "add --out FILE.json" in capsys.readouterr().err
    assert main(argv + ["--out", "report.json"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["draft"] == str(DEMO_DRAFT) and "wrote report.json" in capsys.readouterr().err
    assert set(report["warmup_s"]) == {"ar", "ddtree"} and all(s > 0 for s in report["warmup_s"].values())


def test_output_into_a_closed_pipe_is_no_traceback():
    """`flashtree info demo | head -1`: the reader is gone before flashtree writes; it stops without a word."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "flashtree.cli.main", "info", "demo"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert done.returncode == 141 and done.stderr == ""


def test_run_stats_line_says_when_speculation_fell_back(capsys):
    # the demo pair's draft guesses poorly after this raw prompt: the adaptive policy runs AR steps a while
    argv = ["run", "--raw", "-n", "64", "--device", "cpu", "Hello there, how"]
    assert main(argv) == 0
    assert "AR steps" in capsys.readouterr().err
    assert main(argv + ["--no-adaptive"]) == 0
    assert "AR steps" not in capsys.readouterr().err


def test_out_of_gpu_memory_is_one_line_with_what_to_try(monkeypatch, capsys):
    """torch's OutOfMemoryError ends the command with one line (what was asked, what is allowed) and what to
    try, not a traceback; any other RuntimeError keeps its traceback (a bug)."""
    import torch

    import flashtree.bench.steps as steps

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB. 22.20 GiB allowed; Of the "
                                     "allocated memory 21.49 GiB is allocated by PyTorch")

    monkeypatch.setattr(steps, "run_steps", no_memory)
    assert main(["bench", "--synthetic", "tiny", "--steps", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 MiB. 22.20 GiB "
                          "allowed); try a smaller --ctx")
    assert "Of the allocated" not in err and "Traceback" not in err and len(err.splitlines()) == 1

    def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(steps, "run_steps", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["bench", "--synthetic", "tiny", "--steps", "--device", "cpu"])
