import argparse

import pytest
import torch

from flashtree.engine.config import EngineArgs
from flashtree.engine.loader import load_engine, load_target
from flashtree.models.dflash import DFlashDraft, DraftConfig
from flashtree.train.draft import (DraftTrainConfig, build_prompts, draft_train_forward, feature_layers,
                                   generate_engine, generate_hf, pick_mask_token, train_draft)

PROMPTS = ["def loads(s):", 'def dumps(obj, indent=None):\n    """Serialize obj to a JSON string."""',
           "class JSONDecoder:", "def encode(self, o):", "def scanstring(s, end, strict=True):",
           "def _make_iterencode(markers):"]


def _draft_config(**kw) -> DraftConfig:
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, block_size=8, mask_token_id=3, target_layer_ids=(0, 2),
                num_target_layers=4, layer_types=("full_attention",) * 2, sliding_window=None, vocab_size=50)
    base.update(kw)
    return DraftConfig(**base)


def test_training_forward_matches_inference_block_forward():
    """The batched, masked training forward gives each block exactly what `forward_block` computes at
    inference with the context cache holding the features before the block's anchor."""
    torch.manual_seed(0)
    c = _draft_config()
    draft = DFlashDraft(c).float().eval()
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.2)
    T, blk = 20, c.block_size
    features = torch.randn(T, c.feature_size)
    anchors = [5, 12, 17]
    embeds = torch.randn(len(anchors), blk, c.hidden_size)
    with torch.no_grad():
        train_out = draft_train_forward(draft, features[None], torch.tensor([T]), embeds[None],
                                        torch.tensor([anchors]))[0]
    for n, p in enumerate(anchors):
        cache = draft.new_cache(64)
        draft.append_context(cache, features[:p], torch.arange(p))
        ref = draft.forward_block(cache, embeds[n], p)
        assert torch.allclose(train_out[n], ref, atol=1e-5), (n, (train_out[n] - ref).abs().max())


def test_feature_layers_are_distinct_and_in_range():
    assert feature_layers(8, 3) == (1, 3, 5)  # the recipe's spacing, 1 .. N-3
    assert feature_layers(64, 5) == (1, 16, 31, 46, 61)
    shallow = feature_layers(4, 3)
    assert len(set(shallow)) == 3 and all(0 <= i < 4 for i in shallow)


def test_hf_batched_generation_equals_the_engine(tiny_target):
    target = load_target(tiny_target["path"], "cpu", dtype=torch.float32)
    prompts = build_prompts(target, PROMPTS[:3], 256)
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    eos = target.tokenizer.eos_ids
    hf = generate_hf(tiny_target["path"], prompts, eos, 0, 12, 3, 0.0, "cpu")
    ours = generate_engine(target, prompts, 12)
    assert hf == ours


@pytest.fixture(scope="module")
def trained_draft(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    cfg = DraftTrainConfig(num_layers=1, num_feature_layers=2, head_dim=16, block_size=8, num_prompts=6,
                           max_new_tokens=24, gen_batch_size=6, steps=40, batch_size=4, anchors=8, lr=3e-3,
                           log_every=0)
    return train_draft(tiny_target["path"], out, cfg, "cpu", prompts=PROMPTS, log=lambda m: None)


def test_draft_training_lowers_the_loss(trained_draft):
    losses = trained_draft["losses"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses


def test_exported_draft_loads_and_decodes_losslessly(tiny_target, trained_draft):
    path = trained_draft["path"]
    draft = DFlashDraft.load(path, dtype=torch.float32)
    target = load_target(tiny_target["path"], "cpu")
    assert draft.config.mask_token_id == pick_mask_token(target)
    assert draft.config.vocab_size == target.config.vocab_size
    trained = trained_draft["draft"].state_dict()
    for name, tensor in draft.state_dict().items():  # saved in bf16
        assert torch.allclose(tensor, trained[name].float(), atol=1e-2 * (1 + trained[name].abs().max()))
    engine = load_engine(EngineArgs(tiny_target["path"], path, "cpu"))
    assert engine.default_config.mode == "ddtree"
    for prompt in PROMPTS[:2]:
        ids = engine.encode_prompt(prompt)
        ar = engine.generate(ids, engine.config_for(mode="ar", max_new_tokens=24, ignore_eos=True))
        tree = engine.generate(ids, engine.config_for(mode="ddtree", max_new_tokens=24, ignore_eos=True))
        chain = engine.generate(ids, engine.config_for(mode="chain", max_new_tokens=24, ignore_eos=True))
        assert tree.token_ids == ar.token_ids == chain.token_ids
        assert tree.stats.acceptance_length >= 1.0


def test_training_continues_from_an_existing_draft(tiny_target, trained_draft, tmp_path):
    start = trained_draft["path"]
    cfg = DraftTrainConfig(num_prompts=6, max_new_tokens=24, gen_batch_size=6, steps=10, batch_size=4, anchors=8,
                           lr=1e-3, log_every=0, init_from=str(start), num_layers=3)  # the start's shape wins
    result = train_draft(tiny_target["path"], tmp_path, cfg, "cpu", prompts=PROMPTS, log=lambda m: None)
    continued = DFlashDraft.load(tmp_path, dtype=torch.float32)
    assert continued.config == DFlashDraft.load(start, dtype=torch.float32).config
    first_loss = result["losses"][0]
    assert first_loss < trained_draft["losses"][0] - 0.1  # it starts where the earlier run ended, not from scratch


def test_cli_registers_train_target_and_draft():
    from flashtree.train import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "target", "--out", "d", "--steps", "3", "--shape", '{"num_layers": 4}'])
    assert args.handler is cli.run_target and args.steps == 3
    args = parser.parse_args(["train", "draft", "--target", "t.gguf", "--out", "d", "--generator", "engine"])
    assert args.handler is cli.run_draft and args.generator == "engine"


def test_left_out_train_flags_keep_the_config_defaults(tmp_path, monkeypatch):
    """The train flags' defaults are the configs' own (written there only)."""
    from flashtree.train import cli, draft, target

    seen = {}
    monkeypatch.setattr(target, "train_target", lambda out, shape, train, device, **kw: seen.update(
        target=(train, kw)) or {"summary": {"target": {}}})
    monkeypatch.setattr(draft, "train_draft", lambda path, out, cfg, device, **kw: seen.update(
        draft=cfg) or {"summary": {"draft": {}}})
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    cli.run_target(parser.parse_args(["train", "target", "--out", str(tmp_path), "--device", "cpu", "--lr", "0.01"]))
    train, options = seen["target"]
    assert train == target.TrainConfig(lr=0.01) and set(options) == {"roots", "log"}
    cli.run_draft(parser.parse_args(["train", "draft", "--target", "t.gguf", "--out", str(tmp_path), "--device", "cpu"]))
    assert seen["draft"] == draft.DraftTrainConfig()


def test_hf_batched_features_equal_the_engine_features(tiny_target):
    from flashtree.train.draft import capture_features, capture_features_hf

    target = load_target(tiny_target["path"], "cpu", dtype=torch.float32)
    seqs = [p + [5, 6, 7] for p in build_prompts(target, PROMPTS[:3], 256)]
    layers = (0, 2, 3)  # the last layer too: hidden_states[l + 1] must be the raw (un-normed) layer output
    hf = capture_features_hf(tiny_target["path"], seqs, layers, 2, "cpu")
    for tokens, feats in zip(seqs, hf):
        ours = capture_features(target, tokens, layers)
        assert torch.allclose(feats, ours, atol=1e-4), (feats - ours).abs().max()
