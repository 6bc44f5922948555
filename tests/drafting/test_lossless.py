"""Greedy speculative decoding (chain and DDTree) emits exactly the autoregressive greedy tokens."""

import numpy as np
import pytest
import torch

from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.models.dflash import DFlashDraft, DraftConfig
from flashtree.models.synthetic import tiny_config

N_PROMPTS = 20
N_NEW = 200
# One chain and the default tree run by default; the other shapes (5-8 s each) with -m slow.
# The trees of these shapes on every step: adaptive budgets (tests/engine/test_adaptive.py) left out.
FIXED = {"adaptive": False}
CONFIGS = [("chain", 15, 1), ("ddtree", 22, 8)] + [pytest.param(*config, marks=pytest.mark.slow) for config in
                                                   [("ddtree", 4, 4), ("ddtree", 15, 1), ("ddtree", 64, 8), ("ddtree", 22, 4)]]


@pytest.fixture(scope="module")
def target(make_gguf):
    return load_target(make_gguf("spec", config=tiny_config(num_layers=4, gdn_v_heads=4)), device="cpu")


def random_draft(target, seed=0):
    c = target.config
    config = DraftConfig.from_json({
        "hidden_size": c.hidden_size, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "block_size": 16,
        "vocab_size": c.vocab_size, "num_target_layers": c.num_layers,
        "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]}})
    torch.manual_seed(seed)
    draft = DFlashDraft(config)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.ones_(p)
    return draft


class OracleProposer:
    """Knows the greedy continuation and proposes it with controlled mistakes: the true token is
    rank 0, rank 1-2 (sibling acceptance in a tree), or missing (rejection), position by position."""

    block_size = 16
    capture_layers = (1,)

    def __init__(self, reference: list[int], vocab: int, seed: int):
        self.reference, self.vocab, self.seed = reference, vocab, seed

    def start(self):
        pass

    def commit(self, features, positions):
        pass

    def propose(self, bonus: int, position: int) -> torch.Tensor:
        rng = np.random.default_rng((self.seed, position))
        logits = rng.standard_normal((self.block_size - 1, self.vocab)).astype(np.float32)
        for depth in range(self.block_size - 1):
            index = position + 1 + depth
            if index >= len(self.reference):
                break
            truth = self.reference[index]
            rank = rng.choice([0, 1, 2, 9], p=[0.75, 0.1, 0.07, 0.08])
            decoys = [t for t in rng.permutation(self.vocab)[:4].tolist() if t != truth]
            for r, token in enumerate(decoys[:3]):
                logits[depth, token] = 10.0 - r - (r >= rank)
            logits[depth, truth] = 10.0 - rank if rank < 9 else -10.0
        return torch.from_numpy(logits)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, size=rng.integers(3, 40)).tolist() for _ in range(N_PROMPTS)]


@pytest.fixture(scope="module")
def reference_outputs(target):
    engine = Engine(target)
    config = GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True)
    return [engine.generate(p, config).token_ids for p in prompts(target.config.vocab_size)]


@pytest.mark.parametrize("mode,budget,topk", CONFIGS)
def test_random_draft_is_lossless(target, reference_outputs, mode, budget, topk):
    engine = Engine(target, random_draft(target))
    config = GenerationConfig(max_new_tokens=N_NEW, mode=mode, budget=budget, topk=topk, ignore_eos=True, **FIXED)
    for prompt, expected in zip(prompts(target.config.vocab_size)[:10], reference_outputs):
        assert engine.generate(prompt, config).token_ids == expected


@pytest.mark.parametrize("mode,budget,topk", CONFIGS)
def test_oracle_draft_accepts_long_paths_and_stays_lossless(target, reference_outputs, mode, budget, topk):
    accepted_lengths = []
    for i, (prompt, expected) in enumerate(zip(prompts(target.config.vocab_size), reference_outputs)):
        oracle = OracleProposer(prompt + expected, target.config.vocab_size, seed=i)
        config = GenerationConfig(max_new_tokens=N_NEW, mode=mode, budget=budget, topk=topk, ignore_eos=True, **FIXED)
        result = Engine(target, oracle).generate(prompt, config)
        assert result.token_ids == expected, f"prompt {i}"
        accepted_lengths.append(result.stats.acceptance_length)
        if budget >= 15:
            assert max(result.stats.accepted) >= 8  # long accepted paths really happened
    assert np.mean(accepted_lengths) > (2.0 if budget >= 15 else 1.5)


def test_tree_accepts_siblings_that_chain_cannot(target, reference_outputs):
    prompt = prompts(target.config.vocab_size)[0]
    expected = reference_outputs[0]

    def run(mode):
        config = GenerationConfig(max_new_tokens=N_NEW, mode=mode, budget=64, topk=8, ignore_eos=True, **FIXED)
        return Engine(target, OracleProposer(prompt + expected, target.config.vocab_size, seed=0)).generate(prompt, config)

    assert run("ddtree").stats.acceptance_length > run("chain").stats.acceptance_length


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_end_of_generation_inside_an_accepted_chunk(target, reference_outputs, mode):
    for i in range(5):
        prompt, expected = prompts(target.config.vocab_size)[i], reference_outputs[i]
        # a token whose first occurrence is mid-output acts as end-of-generation
        cut = next(k for k in range(30, N_NEW) if expected[k] not in expected[:k])
        stop_id = expected[cut]
        oracle = OracleProposer(prompt + expected, target.config.vocab_size, seed=i)
        config = GenerationConfig(max_new_tokens=N_NEW, mode=mode, budget=22, stop_token_ids=(stop_id,), ignore_eos=True, **FIXED)
        result = Engine(target, oracle).generate(prompt, config)
        assert result.token_ids == expected[:cut]
        assert result.finish_reason == "stop"


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
@pytest.mark.parametrize("n", [1, 2, 17, 37])
def test_max_tokens_is_exact(target, reference_outputs, mode, n):
    prompt, expected = prompts(target.config.vocab_size)[1], reference_outputs[1]
    oracle = OracleProposer(prompt + expected, target.config.vocab_size, seed=1)
    result = Engine(target, oracle).generate(prompt, GenerationConfig(max_new_tokens=n, mode=mode, ignore_eos=True, **FIXED))
    assert result.token_ids == expected[:n]
    assert result.finish_reason == "length"


@pytest.mark.parametrize("mode,budget,topk", CONFIGS[:2])
def test_q8_0_draft_is_lossless(target, reference_outputs, mode, budget, topk):
    """A draft whose layer matrices are Q8_0 blocks (--draft-type q8_0) proposes other tokens, but the output is
    the target's greedy output all the same: acceptance decides what is kept, not the draft."""
    draft = random_draft(target).quantize_layers("q8_0")
    assert not any(name.startswith("layers.") and p.dim() == 2 for name, p in draft.named_parameters())
    engine = Engine(target, draft)
    config = GenerationConfig(max_new_tokens=N_NEW, mode=mode, budget=budget, topk=topk, ignore_eos=True, **FIXED)
    for prompt, expected in zip(prompts(target.config.vocab_size)[:10], reference_outputs):
        assert engine.generate(prompt, config).token_ids == expected
