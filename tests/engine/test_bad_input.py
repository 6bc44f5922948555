"""Every kind of bad input ends in one clear FlashtreeError (and, from the CLI, one line, exit 1)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from flashtree.cli.main import main
from flashtree.engine.config import EngineArgs, GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_engine, load_target
from flashtree.errors import FlashtreeError
from flashtree.models.gguf_writer import write_qwen35_gguf
from flashtree.models.synthetic import random_tensors, tiny_config


def _write(tmp_path, name, tokenizer_spec, mutate=None, arch=None, qtypes=None, hidden=64):
    config = tiny_config(vocab_size=len(tokenizer_spec.tokens), hidden_size=hidden)
    tensors = random_tensors(config)
    if mutate:
        mutate(tensors)
    path = write_qwen35_gguf(tmp_path / f"{name}.gguf", config, tensors, qtypes, tokenizer_spec)
    if arch:  # same length as "qwen35" so offsets stay valid
        data = path.read_bytes().replace(b"qwen35", arch.encode(), 1)
        path.write_bytes(data)
    return path


def _q2k_bytes(rows, cols):
    """Any bytes form a valid Q2_K block stream for a reader; the engine must refuse the type."""
    import gguf

    return np.zeros((rows, cols // 256 * gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), np.uint8)


@pytest.mark.parametrize("case,pattern", [
    ("missing", "tensor 'blk.1.ssm_a' is missing"),
    ("misshaped", r"blk.0.ffn_up.weight has shape \(100, 64\), expected \(128, 64\)"),
    ("arch", "unsupported architecture 'llama3'"),
    ("unsupported-type", "blk.2.ffn_gate.weight uses quant type Q2_K"),
])
def test_bad_model_files(tmp_path, tokenizer_spec, case, pattern):
    kwargs = {
        "missing": dict(mutate=lambda t: t.pop("blk.1.ssm_a")),
        "misshaped": dict(mutate=lambda t: t.update({"blk.0.ffn_up.weight": np.zeros((100, 64), np.float32)})),
        "arch": dict(arch="llama3"),
        "unsupported-type": dict(mutate=lambda t: t.update({"blk.2.ffn_gate.weight": _q2k_bytes(128, 256)}),
                                 qtypes={"blk.2.ffn_gate.weight": Q.Q2_K}, hidden=256),
    }[case]
    path = _write(tmp_path, case, tokenizer_spec, **kwargs)
    with pytest.raises(FlashtreeError, match=pattern):
        load_target(path, device="cpu")


def test_truncated_and_wrong_magic(tmp_path, make_gguf):
    good = make_gguf()
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 1000])
    with pytest.raises(FlashtreeError, match="truncated"):
        load_target(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    with pytest.raises(FlashtreeError, match="truncated or corrupt"):
        load_target(header_only)
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGML" + data[4:])
    with pytest.raises(FlashtreeError, match="not a GGUF file"):
        load_target(wrong)
    with pytest.raises(FlashtreeError, match="no such file"):
        load_target(tmp_path / "absent.gguf")


def test_prompt_longer_than_context(make_gguf):
    engine = Engine(load_target(make_gguf(), device="cpu"))
    with pytest.raises(FlashtreeError, match="the prompt has 50 tokens but the context holds 40"):
        engine.generate(list(range(5, 55)), GenerationConfig(ctx=40))
    # a prompt that fits is cut at the context limit instead of failing mid-way
    result = engine.generate(list(range(5, 35)), GenerationConfig(ctx=40, max_new_tokens=100, ignore_eos=True))
    assert len(result.token_ids) == 10 and result.finish_reason == "length"


def test_draft_that_does_not_fit_the_target(tmp_path, make_gguf):
    from tests.drafting.test_lossless import random_draft

    target = load_target(make_gguf(), device="cpu")
    draft = random_draft(target)
    draft.config = draft.config.__class__(**{**vars(draft.config), "num_target_layers": 12, "target_layer_ids": (0, 9)})
    draft.save(tmp_path / "draft")
    with pytest.raises(FlashtreeError, match="target_layer_ids"):
        load_engine(EngineArgs(make_gguf(), tmp_path / "draft", device="cpu"))


def test_cli_reports_one_line(tmp_path, capsys):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    assert main(["run", "--model", str(bad), "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_run_json_and_info(make_gguf, capsys):
    import json

    path = str(make_gguf())
    assert main(["run", "--model", path, "--device", "cpu", "-n", "7", "--ignore-eos", "--json", "def fib(n):"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 7 and out["finish_reason"] == "length" and out["stats"]["new_tokens"] == 7
    assert main(["info", path, "--json", "--tensors"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "qwen35" and info["deltanet_layers"] == 3 and info["attention_layers"] == 1
    assert any(t["name"] == "blk.0.attn_qkv.weight" for t in info["tensors"])
