"""Our qwen35 target against transformers' Qwen3.5 model carrying the same (dequantized) weights."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from flashtree.engine.loader import load_target
from flashtree.models.step import Step
from flashtree.models.synthetic import tiny_config
from tests.models.hf_oracle import hf_model_from_gguf



def assert_close(ours, ref):
    """float32 throughout: only summation order differs, so the error is a tiny fraction of the logit range
    (a few positions of deep random models amplify rounding, hence the looser bound on the maximum)."""
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs()
    assert err.max().item() < 2e-4 * scale
    assert err.mean().item() < 1e-5 * scale

# Structural variants: q/k heads != value heads (tiled order matters), attention and DeltaNet layers,
# tied and untied heads, and the real quant types of Q4_K_M / UD-Q4_K_XL files.
K_DIMS = dict(hidden_size=256, intermediate_size=512, head_dim=64, rope_dim=16, num_heads=2, num_kv_heads=1,
              gdn_head_dim=32, gdn_qk_heads=2, gdn_v_heads=6)
VARIANTS = {
    "f32-untied": dict(),
    "f32-tied-8layers": dict(tied=True, config=tiny_config(num_layers=8, gdn_v_heads=6)),
    "q8_0": dict(scheme="q8_0"),
    "q4_k_m": dict(scheme="q4_k_m", config=tiny_config(**K_DIMS)),
    "mixed-types": dict(config=tiny_config(**K_DIMS), qtypes={
        "token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K, "blk.0.attn_qkv.weight": Q.Q5_K,
        "blk.0.attn_gate.weight": Q.IQ4_XS, "blk.1.ffn_up.weight": Q.IQ4_NL, "blk.1.ffn_gate.weight": Q.BF16,
        "blk.2.ffn_down.weight": Q.F16, "blk.3.attn_q.weight": Q.Q4_0, "blk.3.attn_k.weight": Q.Q8_0,
        "blk.3.attn_v.weight": Q.Q6_K, "blk.3.attn_output.weight": Q.Q5_0, "blk.2.ssm_out.weight": Q.Q4_1}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, make_gguf):
    path = make_gguf(request.param, **VARIANTS[request.param])
    target = load_target(path, device="cpu")
    return target, hf_model_from_gguf(path, target.config)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def _prompt(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_matches_transformers(pair):
    target, hf = pair
    ids = _prompt(150, target.config.vocab_size)  # > one 64-token DeltaNet chunk
    cache = target.model.new_cache(256)
    ours = target.model.forward(torch.tensor(ids), cache).logits
    ref = _hf_logits(hf, ids)
    assert_close(ours, ref)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_token_by_token_decode_matches_transformers(pair):
    target, hf = pair
    ids = _prompt(40, target.config.vocab_size, seed=1)
    cache = target.model.new_cache(64)
    ours = torch.cat([target.model.forward(torch.tensor([t]), cache).logits for t in ids])
    assert_close(ours, _hf_logits(hf, ids))


def test_prefill_then_decode_hands_state_over(pair):
    target, hf = pair
    ids = _prompt(90, target.config.vocab_size, seed=2)
    cache = target.model.new_cache(128)
    first = target.model.forward(torch.tensor(ids[:70]), cache).logits
    rest = [target.model.forward(torch.tensor([t]), cache).logits for t in ids[70:]]
    ours = torch.cat([first, *rest])
    assert_close(ours, _hf_logits(hf, ids))


def test_captured_features_are_layer_outputs(pair):
    target, hf = pair
    ids = _prompt(12, target.config.vocab_size, seed=3)
    layers = [0, target.config.num_layers - 2]
    out = target.model.forward(torch.tensor(ids), target.model.new_cache(16), capture=layers)
    with torch.no_grad():
        states = hf(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i + 1][0] for i in layers], dim=-1)  # hidden_states[0] is the embedding
    assert_close(out.features, expected)


def test_tree_verify_equals_each_path_run_as_a_sequence(pair):
    target, _ = pair
    model, vocab = target.model, target.config.vocab_size
    prefix = _prompt(20, vocab, seed=4)
    # root 0; 1,2 children of 0; 3 child of 1; 4 child of 3; 5 child of 2
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    tokens = torch.tensor(_prompt(6, vocab, seed=5))
    depths = torch.tensor([0, 1, 1, 2, 3, 2])
    anc = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = int(parents[j])
    cache = model.new_cache(64)
    model.forward(torch.tensor(prefix), cache)
    tree_logits = model.forward(tokens, cache, step=Step.tree(cache.length, parents, depths, anc)).logits
    for leaf, path in ((4, [0, 1, 3, 4]), (5, [0, 2, 5])):
        seq_cache = model.new_cache(64)
        seq = model.forward(torch.tensor(prefix + tokens[path].tolist()), seq_cache).logits[-len(path):]
        assert_close(tree_logits[path], seq)

    # committing a path leaves the cache exactly as decoding that path would
    model.commit(cache, torch.tensor([0, 2, 5]))
    after = model.forward(torch.tensor([7]), cache).logits
    ref_cache = model.new_cache(64)
    ref = model.forward(torch.tensor(prefix + tokens[[0, 2, 5]].tolist() + [7]), ref_cache).logits[-1:]
    assert_close(after, ref)
