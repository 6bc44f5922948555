"""Speculative sampling (chain and DDTree) leaves the output distribution equal to autoregressive
sampling; a deliberately biased walk is caught by the same test."""

from collections import Counter

import pytest
import torch

import flashtree.engine.decode as decode
from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.engine.sampling import SamplingParams
from flashtree.models.synthetic import tiny_config
from flashtree.drafting.ddtree import follow
from tests.drafting.test_lossless import OracleProposer

PROMPT = [11, 42, 7, 99, 23]
N_SAMPLES = 600
N_TOKENS = 2
SETTINGS = {
    "t1-topk3": SamplingParams(temperature=1.0, top_k=3),
    "t0.7-topp0.9-minp": SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05),
    "t1-topk4-penalties": SamplingParams(temperature=1.0, top_k=4, repetition_penalty=1.5, frequency_penalty=0.5),
}


@pytest.fixture(scope="module")
def target(make_gguf):
    config = tiny_config(num_layers=2, recurrent_layers=(True, False))
    return load_target(make_gguf("sampling", config=config), device="cpu")


@pytest.fixture(scope="module")
def greedy_continuation(target):
    return Engine(target).generate(PROMPT, GenerationConfig(max_new_tokens=16, ignore_eos=True)).token_ids


def outcomes(target, continuation, mode, params, n=N_SAMPLES):
    counts = Counter()
    for seed in range(n):
        oracle = OracleProposer(PROMPT + continuation, target.config.vocab_size, seed=seed)
        config = GenerationConfig(max_new_tokens=N_TOKENS, mode=mode, budget=22, topk=4, ignore_eos=True,
                                  sampling=SamplingParams(**{**vars(params), "seed": seed}))
        counts[tuple(Engine(target, oracle).generate(PROMPT, config).token_ids)] += 1
    return counts


def homogeneity_p_value(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples come from one distribution (2 x C contingency table)."""
    cats = sorted(set(a) | set(b))
    table = torch.tensor([[a[c] for c in cats], [b[c] for c in cats]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    chi2 = ((table - expected) ** 2 / expected).sum()
    dof = max(len(cats) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2))


@pytest.fixture(scope="module")
def ar_samples(target, greedy_continuation):
    return {name: outcomes(target, greedy_continuation, "ar", params) for name, params in SETTINGS.items()}


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
# the setting with every transform runs by default; the others (2-4 s each) with -m slow
@pytest.mark.parametrize("setting", [pytest.param(name, marks=[] if name == "t1-topk4-penalties" else pytest.mark.slow)
                                     for name in sorted(SETTINGS)])
def test_speculative_sampling_matches_autoregressive(target, greedy_continuation, ar_samples, mode, setting):
    spec = outcomes(target, greedy_continuation, mode, SETTINGS[setting])
    assert len(ar_samples[setting]) > 2  # the setting really samples
    assert homogeneity_p_value(ar_samples[setting], spec) > 1e-3


def test_biased_walk_is_detected(target, greedy_continuation, ar_samples, monkeypatch):
    """Greedy acceptance with only the bonus token sampled (what the seed shipped) is not lossless."""

    def biased_walk(tree, logits, sampler):
        dist = sampler.distribution(logits)
        accepted, _ = follow(tree, dist.argmax(-1).tolist())
        return accepted, sampler.choose(dist[accepted[-1]])

    monkeypatch.setattr(decode, "walk", biased_walk)
    spec = outcomes(target, greedy_continuation, "ddtree", SETTINGS["t1-topk3"])
    assert homogeneity_p_value(ar_samples["t1-topk3"], spec) < 1e-6


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_seed_repeats_and_seeds_differ(target, greedy_continuation, mode):
    def run(seed):
        oracle = OracleProposer(PROMPT + greedy_continuation, target.config.vocab_size, seed=0)
        config = GenerationConfig(max_new_tokens=24, mode=mode, ignore_eos=True,
                                  sampling=SamplingParams(temperature=1.0, seed=seed))
        return Engine(target, oracle).generate(PROMPT, config).token_ids

    assert run(1) == run(1)
    assert len({tuple(run(s)) for s in range(2, 6)}) > 1


def test_same_seed_same_text_across_modes(target, greedy_continuation):
    """One draw per emitted token in the same order: seeded spec sampling couples with AR sampling."""
    identical = 0
    for seed in range(20):
        outputs = []
        for mode in ("ar", "chain", "ddtree"):
            oracle = OracleProposer(PROMPT + greedy_continuation, target.config.vocab_size, seed=0)
            config = GenerationConfig(max_new_tokens=30, mode=mode, ignore_eos=True,
                                      sampling=SamplingParams(temperature=1.0, seed=seed))
            outputs.append(Engine(target, oracle).generate(PROMPT, config).token_ids)
        identical += outputs[0] == outputs[1] == outputs[2]
    assert identical >= 19  # float rounding may, rarely, move one draw across a CDF boundary


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_greedy_with_penalties_is_lossless(target, greedy_continuation, mode):
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    ar = Engine(target).generate(PROMPT, GenerationConfig(max_new_tokens=60, ignore_eos=True, sampling=params)).token_ids
    assert ar != Engine(target).generate(PROMPT, GenerationConfig(max_new_tokens=60, ignore_eos=True)).token_ids
    oracle = OracleProposer(PROMPT + ar, target.config.vocab_size, seed=3)
    config = GenerationConfig(max_new_tokens=60, mode=mode, ignore_eos=True, sampling=params, adaptive=False)
    result = Engine(target, oracle).generate(PROMPT, config)
    assert result.token_ids == ar and result.stats.acceptance_length > 1.5


def test_invalid_parameters_are_refused():
    from flashtree.errors import FlashtreeError

    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(min_p=2), dict(repetition_penalty=0)):
        with pytest.raises(FlashtreeError):
            SamplingParams(**bad)
