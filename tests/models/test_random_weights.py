"""RandomWeights: a GGUF-like tensor source with random weights, built in memory (no file)."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from flashtree.engine.loader import load_target, random_target
from flashtree.errors import FlashtreeError
from flashtree.formats.quant_mix import quant_types
from flashtree.formats.quants import bytes_for, dequantize
from flashtree.formats.tokenizer import pad_vocab
from flashtree.models.random_weights import SHAPES, RandomWeights, shape_config
from flashtree.models.synthetic import tensor_shapes, tiny_config

# K-quant friendly small dims (rows of 256), so q4_k_m gives the real Q4_K / Q6_K mix
K_DIMS = dict(hidden_size=256, intermediate_size=512, head_dim=64, rope_dim=16, num_heads=2, num_kv_heads=1,
              gdn_head_dim=32, gdn_qk_heads=2, gdn_v_heads=6)


@pytest.mark.parametrize("shape", ["tiny", "qwen3.5-0.8b", "qwen3.6-27b"])
@pytest.mark.parametrize("scheme", ["q4_k_m", "q8_0", "bf16"])
def test_tensor_table_matches_config(shape, scheme):
    config = shape_config(shape)
    weights = RandomWeights(config, scheme)
    shapes = tensor_shapes(config)
    types = quant_types(shapes, scheme)
    assert set(weights.tensors) == set(shapes)
    for name, info in weights.tensors.items():
        assert info.name == name and info.shape == shapes[name] and info.qtype == types[name]
        assert info.nbytes == bytes_for(info.qtype, info.shape) and info.offset == 0
    assert weights.tensor("output_norm.weight").qtype == Q.F32
    with pytest.raises(FlashtreeError, match="missing"):
        weights.tensor("blk.0.nope.weight")
    assert weights.get("general.name", "dflt") == "dflt"
    assert shape in weights.path and scheme in weights.path


def test_q4_k_m_mix_of_the_27b_shape():
    config = shape_config("qwen3.6-27b")
    assert (config.num_layers, config.hidden_size, config.intermediate_size, config.vocab_size) == (64, 5120, 17408, 248320)
    assert config.attention_layers == list(range(3, 64, 4)) and config.gdn_value_dim == 6144
    weights = RandomWeights(config, "q4_k_m")
    types = {info.qtype for info in weights.tensors.values()}
    assert types == {Q.F32, Q.Q4_K, Q.Q6_K}
    assert weights.tensor("output.weight").qtype == Q.Q6_K and weights.tensor("token_embd.weight").qtype == Q.Q4_K
    per_token = weights.nbytes(exclude=("token_embd.weight",))
    # h200-ceilings.md: ~15.3 GB read per token; lucebox-dflash-spec.md: 14.99 GiB on the GPU besides the embedding
    assert 15.0e9 < per_token < 16.3e9, per_token
    assert weights.tensor("token_embd.weight").nbytes == 248320 * 5120 // 256 * 144  # 682 MiB


def test_shape_config_names_and_overrides():
    assert shape_config("tiny") == tiny_config()
    assert shape_config("qwen3.6-27b", context_length=8192).context_length == 8192
    with pytest.raises(FlashtreeError) as err:
        shape_config("nope")
    for name in SHAPES:
        assert name in str(err.value)


@pytest.mark.parametrize("scheme", ["q4_k_m", "q8_0", "f16", "f32"])
def test_raw_bytes_decode_to_the_intended_scale(scheme):
    config = tiny_config(**K_DIMS) if scheme == "q4_k_m" else tiny_config()
    weights = RandomWeights(config, scheme, pool_blocks=512)
    seen = set()
    for name, info in weights.tensors.items():
        raw = weights.raw(name)
        assert raw.dtype == torch.uint8 and raw.shape == (info.nbytes,) and raw.device.type == "cpu"
        values = dequantize(raw, info.qtype, info.shape)
        assert torch.isfinite(values).all(), name
        seen.add(info.qtype)
        std = weights.std(name)
        if std is not None and info.numel >= 4096:
            assert abs(values.std().item() / std - 1) < 0.1, (name, values.std().item(), std)
            assert abs(values.mean().item()) < 0.1 * std, name
        elif name.endswith("ssm_a"):
            assert (values < 0).all()
        elif "norm" in name:
            assert abs(values.mean().item() - 1) < 0.1
    if scheme == "q4_k_m":
        assert {Q.Q4_K, Q.Q6_K} <= seen


def test_deterministic_per_seed():
    config = tiny_config(**K_DIMS)
    a, b, c = (RandomWeights(config, "q4_k_m", seed=s) for s in (0, 0, 1))
    for name in ("blk.0.ffn_up.weight", "output.weight", "blk.0.ssm_a", "token_embd.weight"):
        assert torch.equal(a.raw(name), b.raw(name))
        assert torch.equal(a.raw(name), a.raw(name))  # asking twice: same bytes
        assert not torch.equal(a.raw(name), c.raw(name))
    assert not torch.equal(a.raw("blk.0.ffn_up.weight"), a.raw("blk.0.ffn_gate.weight"))  # tensors differ
    # the order tensors are asked in does not matter
    d = RandomWeights(config, "q4_k_m", seed=0)
    d.raw("output.weight")
    assert torch.equal(d.raw("blk.1.ffn_down.weight"), a.raw("blk.1.ffn_down.weight"))


def _write_same_bytes(path, weights: RandomWeights, spec):
    """The RandomWeights' exact bytes written as a real GGUF file with the project's writer."""
    return weights.write_gguf(path, spec)


@pytest.mark.parametrize("scheme", ["q4_k_m", "q8_0"])
def test_same_logits_as_the_bytes_in_a_gguf_file(tmp_path, tokenizer_spec, scheme):
    config = tiny_config(**K_DIMS, vocab_size=len(tokenizer_spec.tokens) + 16)
    target = random_target(config, scheme=scheme, device="cpu", dtype=torch.float32, seed=5, tokenizer=tokenizer_spec)
    assert target.config == config
    spec = pad_vocab(tokenizer_spec, config.vocab_size)
    path = _write_same_bytes(tmp_path / "same.gguf", RandomWeights(config, scheme, "cpu", seed=5), spec)
    from_file = load_target(path, "cpu", dtype=torch.float32)
    assert from_file.config.vocab_size == config.vocab_size
    ids = target.tokenizer.encode("def fib(n): return n")
    assert ids == from_file.tokenizer.encode("def fib(n): return n")
    tokens = torch.tensor(ids)
    ours = target.model.forward(tokens, target.model.new_cache(64)).logits
    ref = from_file.model.forward(tokens, from_file.model.new_cache(64)).logits
    assert torch.isfinite(ours).all() and ours.std() > 0.1
    assert torch.equal(ours, ref)
    assert target.chat_template is not None
    assert target.chat_template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == \
        from_file.chat_template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_random_target_pads_vocab_to_the_tokenizer(tokenizer_spec):
    target = random_target(tiny_config(vocab_size=16), scheme="f32", tokenizer=tokenizer_spec)
    assert target.config.vocab_size == len(tokenizer_spec.tokens)
    assert "tiny-qwen35" in str(target.path)


def test_bench_synthetic_runs_in_memory(tmp_path, capsys):
    from flashtree.cli.main import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--synthetic", "tiny", "--device", "cpu", "-n", "4", "--prompts", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "<random tiny" in report["model"] and report["rows"][0]["mode"] == "ar"
    assert report["rows"][0]["new_tokens"] == 4
    assert not list(tmp_path.glob("*.gguf"))


def test_bench_synthetic_multi_turn_raises_context(tmp_path):
    from flashtree.cli.main import main

    out = tmp_path / "mt.json"
    assert main(["bench", "--synthetic", "tiny", "--device", "cpu", "--multi-turn", "--turns", "2",
                 "--system-tokens", "5000", "-n", "2", "--out", str(out)]) == 0
    # tiny's context is 4096: a 5000-token system prompt fits only because --multi-turn raised it
    assert shape_config("tiny").context_length < 5000 and out.is_file()
    rows = json.loads(out.read_text())["rows"]
    assert rows[1]["cached_tokens"] > 5000 and all(r["identical"] for r in rows)
    assert all(0 < r["forwards_on_s"] <= r["ttft_on_s"] for r in rows)  # the cached TTFT, split


def test_echo_model_predicts_its_current_token_decisively():
    """The decisive benchmark model: greedy next token = current token, by many logit stds (a plain random
    model's top two logits sit within a fraction of one), with the LM head stored as the scheme's."""
    for config in (tiny_config(**K_DIMS), shape_config("qwen3.6-27b")):  # tensor tables only
        plain, echo = RandomWeights(config, "q4_k_m"), RandomWeights(config, "q4_k_m", echo=True)
        assert "output.weight" not in echo.tensors
        assert echo.tensor("token_embd.weight").qtype == plain.tensor("output.weight").qtype
        assert echo.tensor("token_embd.weight").nbytes == plain.tensor("output.weight").nbytes
    # tiny's default width: with one 256-value block per row (K_DIMS) the block pool repeats whole rows
    config = tiny_config()
    plain, echo = RandomWeights(config, "q4_k_m"), RandomWeights(config, "q4_k_m", echo=True)
    prompt = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    for weights, decisive in ((plain, False), (echo, True)):
        target = random_target(config, "q4_k_m", echo=weights.echo)
        logits = target.model.forward(prompt, target.model.new_cache(64)).logits
        top = logits.topk(2, dim=-1).values
        margin = ((top[:, 0] - top[:, 1]) / logits.std(-1)).min().item()
        assert torch.equal(logits.argmax(-1), prompt) == decisive
        assert (margin > 1.0) == decisive


def test_bench_echo_flag_builds_the_echo_model(tmp_path):
    from flashtree.cli.main import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--synthetic", "tiny", "--echo", "--device", "cpu", "-n", "4", "--prompts", "1",
                 "--out", str(out)]) == 0
    assert "<random echo tiny" in json.loads(out.read_text())["model"]
