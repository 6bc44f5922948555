"""KV cache types end to end: greedy speculative output equals greedy autoregressive output with every
KV type (same engine, same cache type), the attention window, config/CLI validation, and the planner."""

import json

from dataclasses import replace

import numpy as np
import pytest
import torch

from flashtree.cli.main import build_parser, main
from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.engine.planner import (PlanRequest, _activation_parts, kv_bytes_per_token, max_ctx, parse_size,
                                      per_device, per_rank, plan, target_from_preset)
from flashtree.errors import FlashtreeError
from flashtree.models.attention import PREFILL_DEQUANT_BYTES
from flashtree.models.synthetic import tiny_config
from tests.drafting.test_lossless import OracleProposer, random_draft

N_NEW = 48
KV_COMBOS = [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"),
             ("tq3_0", "tq3_0"), ("tq3_0", "q8_0")]


@pytest.fixture(scope="module")
def target(make_gguf):  # head_dim 128: one TQ3_0 group per row
    return load_target(make_gguf("kvtypes", config=tiny_config(num_layers=4, gdn_v_heads=4, head_dim=128)), device="cpu")


def _prompts(vocab):
    rng = np.random.default_rng(11)
    return [rng.integers(0, vocab, size=rng.integers(3, 30)).tolist() for _ in range(4)]


def _config(**kw):
    return GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True, **kw)


@pytest.mark.parametrize("k,v", KV_COMBOS)
def test_speculative_equals_autoregressive_with_every_kv_type(target, k, v):
    types = dict(cache_type_k=k, cache_type_v=v)
    draft = random_draft(target)
    for i, prompt in enumerate(_prompts(target.config.vocab_size)):
        expected = Engine(target).generate(prompt, _config(**types)).token_ids
        assert Engine(target, draft).generate(prompt, _config(mode="ddtree", budget=22, **types)).token_ids == expected
        oracle = OracleProposer(prompt + expected, target.config.vocab_size, seed=i)
        for mode in ("chain", "ddtree"):
            result = Engine(target, oracle).generate(prompt, _config(mode=mode, budget=15, adaptive=False, **types))
            assert result.token_ids == expected, (mode, i)
        assert result.stats.acceptance_length > 1.5  # long accepted paths were committed through the types


def test_quantized_cache_is_really_used(target):
    cache = target.model.new_cache(40, "tq3_0", "q4_0")
    kv = cache.attention[target.config.attention_layers[0]]
    assert kv.k.dtype == torch.uint8 and kv.k.shape == (target.config.num_kv_heads, 40, 14 * 128 // 32)
    assert kv.v.shape[-1] == 18 * 128 // 32
    default = target.model.new_cache(40).attention[target.config.attention_layers[0]]
    assert default.k.dtype == target.model.dtype and default.type_k.name == "f32"
    prompt = _prompts(target.config.vocab_size)[0]
    logits = {t: target.model.forward(torch.tensor(prompt), target.model.new_cache(64, t, t)).logits for t in ("f32", "tq3_0")}
    assert not torch.equal(logits["f32"], logits["tq3_0"])
    assert torch.allclose(logits["f32"], logits["tq3_0"], atol=0.5 * logits["f32"].abs().max().item())


def test_attention_window_speculative_equals_windowed_autoregressive(target):
    prompt = _prompts(target.config.vocab_size)[1]
    full = Engine(target).generate(prompt, _config()).token_ids
    expected = Engine(target).generate(prompt, _config(attn_window=6)).token_ids
    assert expected != full  # the window changes the output (documented)
    oracle = OracleProposer(prompt + expected, target.config.vocab_size, seed=0)
    assert Engine(target, oracle).generate(prompt, _config(mode="ddtree", attn_window=6)).token_ids == expected
    big = Engine(target).generate(prompt, _config(attn_window=10_000)).token_ids
    assert big == full  # a window longer than the sequence is full attention


def test_config_and_flags_validate(target):
    with pytest.raises(FlashtreeError, match="choose one of f32, f16, bf16, q8_0, q4_0, tq3_0"):
        GenerationConfig(cache_type_k="q3_k")
    with pytest.raises(FlashtreeError, match="attn_window"):
        GenerationConfig(attn_window=-1)
    args = build_parser().parse_args(["run", "hi", "-ctk", "tq3_0", "--cache-type-v", "q8_0", "--attn-window", "64"])
    assert (args.cache_type_k, args.cache_type_v, args.attn_window) == ("tq3_0", "q8_0", 64)


def test_cli_run_with_quantized_cache(target, capsys):
    path = str(target.path)
    assert main(["run", "hello", "-m", path, "--device", "cpu", "-n", "5", "--raw", "--ignore-eos", "--json",
                 "-ctk", "q4_0", "-ctv", "tq3_0"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 5
    assert main(["run", "hello", "-m", path, "--device", "cpu", "-n", "5", "-ctk", "q9"]) == 1
    assert "unknown KV cache type 'q9'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- planner


def _request(ctx=262144, k="tq3_0", v="tq3_0", **kw):
    config, weights, embed, dense, draft, layers = target_from_preset("qwen3.6-27b")
    return PlanRequest(config, weights, embed, draft, ctx, k, v, dense_params=dense, layer_bytes=layers, **kw)


def test_kv_bytes_match_the_spec_table():
    config = _request().config
    assert {t: kv_bytes_per_token(config, t, t) for t in ("f16", "q8_0", "q4_0", "tq3_0")} == {
        "f16": 65536, "q8_0": 34816, "q4_0": 18432, "tq3_0": 14336}
    p = plan(_request(ctx=262144 - 24))  # rows = ctx + budget + 2
    assert p.bytes_of("KV cache") == 14336 * 262144 == int(3.5 * 2**30)


def test_planner_lines_and_scaling():
    p = plan(_request())
    names = [n for n, _, _ in p.lines]
    assert names == ["target weights", "draft weights", "KV cache", "DeltaNet state", "tree buffers",
                     "draft context ring", "prefill feature capture", "activations (estimate)",
                     "CUDA context + libraries"]
    assert 14 * 2**30 < p.bytes_of("target weights") < 17 * 2**30  # 27B Q4_K_M
    conv = 3 * p.request.config.conv_dim * 4  # the conv window holds float32 activations (docs/FIDELITY.md)
    assert p.bytes_of("DeltaNet state") == 48 * (3 * 2**20 + conv)
    assert p.total == sum(b for _, b, _ in p.lines)
    assert 45 * 2**30 < p.dequantized_weights() < 55 * 2**30  # ~26.9 B params in bf16 (+ the quantized embedding)
    assert "tree buffers" not in [n for n, _, _ in plan(replace(_request(), draft=None)).lines]
    small = plan(_request(ctx=32768, k="q8_0", v="q8_0", draft_window=2048))
    assert small.bytes_of("KV cache") == 34816 * (32768 + 24)
    assert small.bytes_of("draft context ring") * 2 == pytest.approx(p.bytes_of("draft context ring"), rel=1e-3)


def test_a_long_prefix_is_planned_dequantized_one_piece_at_a_time():
    """Past PREFILL_DEQUANT_BYTES of one layer's dequantized K/V a prefill chunk attends to the prefix in pieces
    (models/attention.py): the activations stop growing with the context. A tree past the in-place kernel's
    MAX_TREE_QUERIES, and a float32 compute dtype, still dequantize every row."""
    def activations(**kw):
        return plan(_request(**kw)).bytes_of("activations (estimate)")

    per_row = 2 * 4 * 256 * 2  # K and V, 4 KV heads x 256, bf16
    piece_ctx = PREFILL_DEQUANT_BYTES // per_row - 24  # rows = ctx + budget + 2
    assert activations(ctx=131072) == activations(ctx=262144)
    assert activations(ctx=piece_ctx // 2) < activations(ctx=piece_ctx)
    merge = 2 * 24 * 512 * 256 * 4  # the float32 output the pieces are merged into, and one piece's output
    assert activations(ctx=262144) == activations(ctx=piece_ctx) + merge
    # 1.37 with the whole prefix dequantized (1.00 of it); 0.64 in pieces of 64K rows and the whole fused gate/up
    # dequantized (counted as half of it); 0.35 in pieces of 16K rows and blocks of 64 MiB of the weight
    assert round(activations() / 2**30, 2) == 0.35
    # a bf16 model's forward below DENSE_MIN_M tokens holds float32 activations, a longer chunk bf16 ones
    # (Qwen35Model.forward_dtype)
    def forward(chunk, dtype):
        return _activation_parts(_request(prefill_chunk=chunk, dtype=dtype), 1024)["forward"]

    assert forward(256, "bf16") == forward(256, "f32") and forward(2048, "bf16") < forward(2048, "f32")
    assert activations(ctx=262144, budget=200) - activations(ctx=131072, budget=200) == 131072 * per_row
    assert activations(ctx=262144, dtype="f32") > activations(ctx=131072, dtype="f32")
    assert "16384 rows at a time" in dict((n, h) for n, _, h in plan(_request()).lines)["activations (estimate)"]


def test_max_ctx_is_the_largest_fitting_multiple_of_256():
    req = _request()
    budget = 22 * 2**30  # below the 22.98 GiB that 262K tokens need
    n = max_ctx(req, budget)
    assert n % 256 == 0 and 0 < n < req.ctx
    assert plan(replace(req, ctx=n)).total <= budget < plan(replace(req, ctx=n + 256)).total


def test_parse_size():
    assert parse_size("24GiB") == parse_size("24G") == parse_size("24") == 24 * 2**30
    assert parse_size("24GB") == 24 * 10**9 and parse_size("512MiB") == 2**29
    with pytest.raises(FlashtreeError, match="24GiB"):
        parse_size("lots")


def test_plan_command_prints_the_budget(capsys):
    assert main(["plan", "--synthetic", "qwen3.6-27b", "--ctx", "262144", "-ctk", "tq3_0", "-ctv", "tq3_0",
                 "--no-draft", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    for line in ("target weights", "KV cache", "3.50 GiB", "DeltaNet state", "activations", "fits", "stay quantized"):
        assert line in out


def test_plan_command_refuses_what_does_not_fit(capsys):
    assert main(["plan", "--synthetic", "qwen3.6-27b", "--ctx", "262144", "--gpu-memory", "24GiB"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: does not fit: ctx 262144")
    assert "KV 16.00 GiB" in err and "24.00 GiB is available" in err


def test_plan_command_reads_a_gguf_and_a_draft_dir(target, tmp_path, capsys):
    draft = random_draft(target)
    draft.save(tmp_path / "draft")
    assert main(["plan", "-m", str(target.path), "--draft", str(tmp_path / "draft"), "--ctx", "1024",
                 "-ctk", "q8_0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    c = target.config
    assert info["lines"]["KV cache"] == len(c.attention_layers) * c.num_kv_heads * (136 + 256) * (1024 + 24)
    assert info["lines"]["draft weights"] == 2 * sum(p.numel() for p in draft.parameters())
    assert info["lines"]["target weights"] > 0 and info["fits"] and info["target_weights_dequantized"] > 0
    assert main(["plan", "-m", str(target.path), "--ctx", "1024", "--gpu-memory", "1MiB"]) == 1
    assert main(["plan", "-m", str(target.path), "-ctk", "tq3_0", "--ctx", "64", "--json"]) == 0  # head_dim 128 ok


def test_per_device_shares_add_up_and_follow_the_placement():
    req = _request(ctx=65536, k="f16", v="f16")
    p = plan(req)
    one = per_device(p, [64])
    assert len(one) == 1 and one[0] == {name: b for name, b, _ in p.lines}  # one GPU: the plan itself

    split = per_device(p, [32, 32], draft_device=1)
    for name in ("target weights", "KV cache", "DeltaNet state", "tree buffers", "draft weights"):
        assert split[0][name] + split[1][name] == p.bytes_of(name), name
    assert split[0]["KV cache"] == split[1]["KV cache"]  # attention every 4th layer: 8 of 16 per half
    assert split[0]["draft weights"] == 0 and split[1]["draft context ring"] == p.bytes_of("draft context ring")
    head = req.weight_bytes - req.embed_bytes - sum(req.layer_bytes)
    assert split[0]["target weights"] == sum(req.layer_bytes[:32])  # the embedding in pinned host memory
    on_device = per_device(plan(replace(req, embed_on_host=False)), [32, 32], draft_device=1)
    assert on_device[0]["target weights"] == req.embed_bytes + sum(req.layer_bytes[:32])
    assert split[1]["target weights"] == sum(req.layer_bytes[32:]) + head
    # each GPU runs its own layers' intermediates; the logits exist on the last GPU and the first
    assert split[0]["activations (estimate)"] == split[1]["activations (estimate)"] == p.bytes_of("activations (estimate)")

    draft_gpu = per_device(p, [64], draft_device=1)  # the draft on a GPU of its own
    assert draft_gpu[1]["target weights"] == draft_gpu[1]["KV cache"] == 0
    assert sum(draft_gpu[1].values()) == sum(p.bytes_of(n) for n in ("draft weights", "draft context ring",
                                                                       "prefill feature capture",
                                                                       "CUDA context + libraries"))
    with pytest.raises(FlashtreeError, match="does not cover the 64 layers"):
        per_device(p, [32, 31])


def test_per_rank_splits_what_tensor_parallel_splits():
    req = _request(ctx=65536, k="f16", v="f16")
    p = plan(req)
    rank = per_rank(p, 2)
    assert rank["target weights"] == (req.weight_bytes - req.embed_bytes) // 2  # the embedding in host memory
    assert per_rank(plan(replace(req, embed_on_host=False)), 2)["target weights"] == rank["target weights"] + req.embed_bytes
    assert rank["KV cache"] * 2 == p.bytes_of("KV cache") and rank["DeltaNet state"] * 2 == p.bytes_of("DeltaNet state")
    for whole in ("draft weights", "draft context ring", "activations (estimate)"):  # replicas / upper bound
        assert rank[whole] == p.bytes_of(whole)
    with pytest.raises(FlashtreeError, match="4 KV heads"):
        per_rank(p, 8)


def test_plan_command_per_gpu(capsys):
    args = ["plan", "--synthetic", "qwen3.6-27b", "--ctx", "65536", "--layer-split", "1,1", "--draft-device", "cuda:1"]
    assert main(args + ["--gpu-memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "layers per GPU [32, 32]" in out and "cuda:0" in out and "cuda:1" in out
    assert main(args + ["--gpu-memory", "12GiB"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: does not fit: cuda:1 needs") and "cuda:0" not in err
    assert main(args[:-2] + ["--draft-device", "cpu"]) == 1
    assert "plan a GPU as cuda:N" in capsys.readouterr().err
    tp = ["plan", "--synthetic", "qwen3.6-27b", "--ctx", "65536", "-tp", "2", "--gpu-memory", "16GiB"]
    assert main(tp) == 0  # planned in this process: no ranks are started
    assert "tensor parallel 2" in capsys.readouterr().out
    assert main(tp + ["--layer-split", "1,1"]) == 1


def test_prefix_cache_with_quantized_rows(target):
    from flashtree.engine.prefix_cache import PrefixCache

    rng = np.random.default_rng(5)
    draft = random_draft(target)
    plain, cached = Engine(target, draft), Engine(target, draft)
    cached.prefix_cache = PrefixCache(interval=32)
    conversation = rng.integers(0, target.config.vocab_size, 50).tolist()
    for types in (dict(cache_type_k="tq3_0", cache_type_v="q4_0"), dict(cache_type_k="tq3_0", cache_type_v="q4_0"),
                  dict(cache_type_k="q8_0", cache_type_v="q8_0")):
        config = _config(mode="ddtree", budget=8, prefill_chunk=16, **types)
        expected = plain.generate(conversation, config).token_ids
        assert cached.generate(conversation, config).token_ids == expected
        conversation = conversation + expected + [7, 8, 9]
    assert cached.prefix_cache.stats.hits == 1  # the q8_0 turn cannot reuse tq3_0/q4_0 rows


@pytest.mark.parametrize("kv_type", ["f16", "bf16", "q8_0", "q4_0", "tq3_0"])
def test_prefix_cache_hits_are_exact_with_every_kv_type(target, kv_type):
    from flashtree.engine.prefix_cache import PrefixCache

    rng = np.random.default_rng(6)
    draft = random_draft(target)
    plain, cached = Engine(target, draft), Engine(target, draft)
    cached.prefix_cache = PrefixCache(interval=32)
    config = _config(mode="ddtree", budget=8, prefill_chunk=16, cache_type_k=kv_type, cache_type_v=kv_type)
    conversation = rng.integers(0, target.config.vocab_size, 40).tolist()
    for _ in range(3):
        expected = plain.generate(conversation, config).token_ids
        assert cached.generate(conversation, config).token_ids == expected
        conversation = conversation + expected + [7, 8, 9]
    assert cached.prefix_cache.stats.hits == 2


@pytest.mark.parametrize("tied", [False, True])
def test_planned_weights_count_a_tied_head_twice(make_gguf, tied):
    """The loader holds the embedding (row lookups) and the LM head (matmul layout) apart, so a tied head
    (no output.weight in the file) is a second copy of token_embd on the GPU."""
    from flashtree.engine.planner import target_from_gguf
    from flashtree.formats.gguf_file import GGUFFile

    path = make_gguf(f"plan-tied-{tied}", scheme="q8_0", tied=tied)
    tensors = GGUFFile(path).tensors
    assert ("output.weight" in tensors) != tied
    _, weights, embed, _, _ = target_from_gguf(path)
    stored = sum(t.nbytes for t in tensors.values())
    assert embed == tensors["token_embd.weight"].nbytes
    assert weights == stored + (embed if tied else 0)
