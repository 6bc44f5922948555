"""DFlash draft: parity with the z-lab reference (`dflash.DFlashDraftModel`), cache behaviour,
checkpoint round trips and user-facing errors. Tiny random models, CPU only."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashtree.errors import FlashtreeError
from flashtree.models.dflash import DFlashDraft, DraftConfig, build_target_layer_ids
from tests.kernels.interpreter import run_cases
from tests.models import dflash_kernel_cases as kernel_cases

dflash_ref = pytest.importorskip("dflash.model")
from transformers import DynamicCache  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config  # noqa: E402

HIDDEN, VOCAB, BLOCK, HEAD_DIM = 64, 97, 16, 16
FULL3 = ["full_attention"] * 3
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
# (layer_types, sliding_window, is_causal): the reference makes sliding layers causal by default;
# a window of 12 < block also cuts inside the block when the layer is non-causal.
ATTENTION_CASES = {
    "full": (FULL3, None, None),
    "sliding-default-causal": (MIXED, 12, None),
    "sliding-noncausal": (MIXED, 12, False),
    "all-causal": (MIXED, 12, True),
}


def ref_config(n_ids=2, layer_types=FULL3, window=None, is_causal=None) -> Qwen3Config:
    extra = {} if is_causal is None else {"is_causal": is_causal}
    return Qwen3Config(
        hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, vocab_size=VOCAB,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        layer_types=layer_types, sliding_window=window, use_sliding_window=window is not None,
        num_target_layers=12, block_size=BLOCK,
        dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3, 5, 7, 9][:n_ids]},
        **extra,
    )


def make_pair(cfg: Qwen3Config, seed=0):
    """The reference and our draft holding the same random weights (scaled so attention is peaked)."""
    torch.manual_seed(seed)
    ref = dflash_ref.DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    ours = DFlashDraft(DraftConfig.from_json(cfg.to_dict())).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def inputs(cfg, ctx_len, seed=1):
    g = torch.Generator().manual_seed(seed)
    n_feat = len(cfg.dflash_config["target_layer_ids"]) * HIDDEN
    return torch.randn(ctx_len, n_feat, generator=g), torch.randn(BLOCK, HIDDEN, generator=g)


def ref_block(ref, ctx, emb, first_pos, start, cache=None):
    """One reference draft call: context at [first_pos, start), block at [start, start+BLOCK)."""
    pos = torch.arange(first_pos, start + BLOCK)[None]
    with torch.no_grad():
        return ref(position_ids=pos, noise_embedding=emb[None], target_hidden=ctx[None],
                   past_key_values=cache, use_cache=cache is not None)[0]


def ours_block(model, chunks, emb, max_context=1024):
    cache = model.new_cache(max_context, torch.device("cpu"))
    pos = 0
    for chunk in chunks:
        model.append_context(cache, chunk, torch.arange(pos, pos + len(chunk)))
        pos += len(chunk)
    return model.forward_block(cache, emb, pos)


def assert_parity(ours, ref, lm_head, min_cos=0.9999):
    cos = torch.nn.functional.cosine_similarity(ours.float(), ref.float(), dim=-1)
    assert cos.min().item() >= min_cos, cos
    assert torch.equal((ours.float() @ lm_head.T).argmax(-1), (ref.float() @ lm_head.T).argmax(-1))
    return cos.min().item(), (ours.float() - ref.float()).abs().max().item()


def lm_head(seed=2):
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------


def test_build_target_layer_ids_matches_reference():
    for n_target in (8, 36, 64):
        for n_draft in (1, 2, 5, 8):
            assert build_target_layer_ids(n_target, n_draft) == dflash_ref.build_target_layer_ids(n_target, n_draft)
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]


@pytest.mark.parametrize("n_ids", [2, 5])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_single_call_parity(n_ids, case):
    cfg = ref_config(n_ids, *ATTENTION_CASES[case])
    ref, ours = make_pair(cfg)
    ctx, emb = inputs(cfg, ctx_len=40)
    assert_parity(ours_block(ours, [ctx], emb), ref_block(ref, ctx, emb, 0, 40), lm_head())


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_incremental_parity_with_reference_cache(case):
    """The reference's own loop (DynamicCache, crop back to `start` after each call) fed context in
    chunks vs ours appending the same chunks; also equal to feeding all context at once."""
    cfg = ref_config(5, *ATTENTION_CASES[case])
    ref, ours = make_pair(cfg)
    ctx, _ = inputs(cfg, ctx_len=50)
    ref_cache = DynamicCache(config=cfg)
    ref_cache.activate_past_recording()
    cache = ours.new_cache(64, torch.device("cpu"))
    start = 0
    for i, n in enumerate([23, 1, 7, 16, 3]):
        chunk = ctx[start:start + n]
        _, emb = inputs(cfg, 0, seed=10 + i)
        expected = ref_block(ref, chunk, emb, start, start + n, ref_cache)
        ref_cache.crop(start + n - ref_cache.get_seq_length())
        ours.append_context(cache, chunk, torch.arange(start, start + n))
        start += n
        got = ours.forward_block(cache, emb, start)
        assert_parity(got, expected, lm_head())
    one_shot = ours_block(ours, [ctx], emb)
    torch.testing.assert_close(got, one_shot, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["full", "sliding-default-causal"])
def test_bounded_window_keeps_most_recent_positions(case):
    """A cache of 20 slots fed 50 positions (wrapping mid-chunk and a chunk longer than the ring)
    behaves like the reference seeing only the last 20 positions, at their original positions."""
    cfg = ref_config(2, *ATTENTION_CASES[case])
    ref, ours = make_pair(cfg)
    ctx, emb = inputs(cfg, ctx_len=50)
    got = ours_block(ours, [ctx[:13], ctx[13:17], ctx[17:42], ctx[42:]], emb, max_context=20)
    assert_parity(got, ref_block(ref, ctx[30:], emb, 30, 50), lm_head())


def test_bf16_parity():
    cfg = ref_config(5, *ATTENTION_CASES["sliding-default-causal"])
    ref, ours = make_pair(cfg)
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    ctx, emb = inputs(cfg, ctx_len=40)
    cache = ours.new_cache(64, torch.device("cpu"))
    ours.append_context(cache, ctx, torch.arange(40))
    got = ours.forward_block(cache, emb, 40)
    assert got.dtype == torch.bfloat16
    assert_parity(got, ref_block(ref, ctx.bfloat16(), emb.bfloat16(), 0, 40), lm_head(), min_cos=0.999)


def test_project_context_matches_reference_fc():
    cfg = ref_config(5)
    ref, ours = make_pair(cfg)
    ctx, _ = inputs(cfg, ctx_len=7)
    with torch.no_grad():
        torch.testing.assert_close(ours.project_context(ctx), ref.hidden_norm(ref.fc(ctx)))


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def write_zlab_checkpoint(path, cfg, ref):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(cfg.to_json_string())
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path / "model.safetensors")


def test_load_zlab_checkpoint(tmp_path):
    cfg = ref_config(5, *ATTENTION_CASES["sliding-default-causal"])
    ref, _ = make_pair(cfg)
    write_zlab_checkpoint(tmp_path, cfg, ref)
    model = DFlashDraft.load(tmp_path, dtype=torch.float32)
    assert model.config.sliding_window == 12 and model.config.layer_types == tuple(MIXED)
    ctx, emb = inputs(cfg, ctx_len=30)
    assert_parity(ours_block(model, [ctx], emb), ref_block(ref, ctx, emb, 0, 30), lm_head())


def test_save_load_round_trip(tmp_path):
    _, ours = make_pair(ref_config(2, *ATTENTION_CASES["sliding-noncausal"]))
    ours.save(tmp_path)
    loaded = DFlashDraft.load(tmp_path, dtype=torch.float32)
    assert loaded.config == ours.config
    assert loaded.state_dict().keys() == ours.state_dict().keys()
    for name, t in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert next(DFlashDraft.load(tmp_path).parameters()).dtype == torch.bfloat16


def test_config_defaults_like_zlab():
    d = ref_config(2).to_dict()
    del d["dflash_config"]["target_layer_ids"], d["block_size"]
    c = DraftConfig.from_json(d)
    assert c.target_layer_ids == tuple(build_target_layer_ids(12, 3))
    assert c.block_size == 16 and c.mask_token_id == VOCAB - 1 and c.rope_theta == 10000.0
    legacy = dict(d, rope_theta=1e7, rope_parameters=None, dflash_config={"mask_token_id": 5, "block_size": 8})
    c = DraftConfig.from_json(legacy)
    assert (c.rope_theta, c.block_size, c.mask_token_id) == (1e7, 8, 5)
    assert DraftConfig.from_json(c.to_json()) == c


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_check_target_errors():
    _, ours = make_pair(ref_config(5))
    ours.check_target(HIDDEN, VOCAB, 12)
    with pytest.raises(FlashtreeError, match="hidden_size"):
        ours.check_target(HIDDEN * 2, VOCAB, 12)
    with pytest.raises(FlashtreeError, match="vocab_size"):
        ours.check_target(HIDDEN, VOCAB + 1, 12)
    with pytest.raises(FlashtreeError, match=r"target_layer_ids \[9\]"):
        ours.check_target(HIDDEN, VOCAB, 9)


@pytest.mark.parametrize("key", ["hidden_size", "num_key_value_heads", "vocab_size", "rope_theta",
                                 "mask_token_id", "num_target_layers"])
def test_missing_config_key(key):
    d = ref_config(2).to_dict()
    if key == "rope_theta":
        del d["rope_parameters"]
    elif key == "mask_token_id":
        del d["dflash_config"][key]
    else:
        del d[key]
    with pytest.raises(FlashtreeError, match=key):
        DraftConfig.from_json(d)


@pytest.mark.parametrize("key,value", [("num_key_value_heads", 3), ("hidden_size", 0), ("head_dim", 15),
                                       ("layer_types", ["full_attention"]), ("block_size", 1)])
def test_bad_config_value(key, value):
    with pytest.raises(FlashtreeError, match=key):
        DraftConfig.from_json(dict(ref_config(2).to_dict(), **{key: value}))


def test_bad_target_layer_ids_in_config():
    d = ref_config(2).to_dict()
    d["dflash_config"]["target_layer_ids"] = [1, 12]
    with pytest.raises(FlashtreeError, match="target_layer_ids"):
        DraftConfig.from_json(d)


@pytest.mark.parametrize("edit,match", [
    ("drop", "'layers.1.mlp.up_proj.weight' missing"),
    ("reshape", "'layers.1.mlp.up_proj.weight' has shape"),
    ("extra", "unexpected tensors"),
])
def test_bad_checkpoint_tensors(tmp_path, edit, match):
    cfg = ref_config(2)
    ref, _ = make_pair(cfg)
    write_zlab_checkpoint(tmp_path, cfg, ref)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "layers.1.mlp.up_proj.weight"
    if edit == "drop":
        del tensors[name]
    elif edit == "reshape":
        tensors[name] = tensors[name][:, :-1].contiguous()
    else:
        tensors["embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(FlashtreeError, match=match):
        DFlashDraft.load(tmp_path)


def test_missing_checkpoint_files(tmp_path):
    with pytest.raises(FlashtreeError, match="config.json"):
        DFlashDraft.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(ref_config(2).to_dict()))
    with pytest.raises(FlashtreeError, match="model.safetensors"):
        DFlashDraft.load(tmp_path)


def test_bad_feature_width():
    cfg = ref_config(2)
    _, ours = make_pair(cfg)
    cache = ours.new_cache(8)
    with pytest.raises(FlashtreeError, match="features"):
        ours.append_context(cache, torch.zeros(3, HIDDEN * 5), torch.arange(3))


def test_q8_0_draft_layers_match_the_dequantized_draft():
    """quantize_layers keeps the layers' matrices as Q8_0 blocks; the block pass equals the same draft with
    those blocks dequantized back into float weights."""
    from gguf import GGMLQuantizationType

    from flashtree.formats.quants import dequantize, quantize_q8_0

    torch.manual_seed(0)
    config = DraftConfig.from_json({
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "block_size": 8,
        "vocab_size": 50, "num_target_layers": 4, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]}})
    dense = DFlashDraft(config).float().eval()
    for p in dense.parameters():
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.ones_(p)
    rounded = DFlashDraft(config).float().eval()
    rounded.load_state_dict(dense.state_dict())
    for name, p in rounded.named_parameters():
        if name.startswith("layers.") and p.dim() == 2:
            raw = quantize_q8_0(p.detach())
            p.data = dequantize(raw.reshape(-1), GGMLQuantizationType.Q8_0, tuple(p.shape))
    quantized = dense.quantize_layers()
    assert not any(n.startswith("layers.") and p.dim() == 2 for n, p in quantized.named_parameters())
    features, embeds = torch.randn(6, config.feature_size), torch.randn(config.block_size, 64)
    outs = []
    for model in (rounded, quantized):
        cache = model.new_cache(16)
        model.append_context(cache, features, torch.arange(6))
        outs.append(model.forward_block(cache, embeds, 6))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    with pytest.raises(FlashtreeError, match="q8_0 only"):
        quantized.quantize_layers("q4_k")


@pytest.fixture(scope="module")
def kernel_pass_errors():
    return run_cases("tests.models.dflash_kernel_cases")


@pytest.mark.slow  # the Triton interpreter: about 20 s on 2 cores
@pytest.mark.parametrize("case", kernel_cases.case_ids())
def test_block_pass_attending_in_the_kernel_matches_the_sdpa_pass(kernel_pass_errors, case):
    """`BlockRows` (the block written right after the valid context, read by `tree_attention`) gives the
    SDPA pass's hidden states (block after the rows read, unfilled slots masked), eager and graph-ready,
    in a ring that wrapped or not, for non-causal and causal layers."""
    assert kernel_pass_errors[case] < 1e-5
