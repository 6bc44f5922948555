"""Sampling parameters at the edges of float32 give a usable distribution (never NaN), or a clear error."""

import pytest
import torch

from flashtree.engine.sampling import SEED_MAX, Sampler, SamplingParams
from flashtree.errors import FlashtreeError

VOCAB = 32
LOGITS = torch.linspace(-20, 30, VOCAB).roll(7).unsqueeze(0)  # the largest logit at id 6
TOP = int(LOGITS.argmax())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-300),
    SamplingParams(temperature=1.0, top_p=5e-324),
    SamplingParams(temperature=1.0, top_p=1e-46),
    SamplingParams(temperature=1.0, repetition_penalty=1e-300),  # the seen token's logit becomes inf
    SamplingParams(temperature=1e-5, repetition_penalty=1e-300, top_p=1e-46),
], ids=["temperature", "top_p-denormal", "top_p-below-float32", "repetition_penalty", "all"])
def test_degenerate_parameters_sample_the_most_likely_token(params):
    sampler = Sampler(params, prompt_ids=[TOP], vocab_size=VOCAB, device="cpu")
    dist = sampler.distribution(LOGITS)
    assert torch.isfinite(dist).all()
    assert sampler.choose(dist[0]) == TOP


def test_a_penalty_that_zeroes_every_logit_still_samples():
    sampler = Sampler(SamplingParams(temperature=2.0, repetition_penalty=1e300), list(range(VOCAB)), VOCAB, "cpu")
    dist = sampler.distribution(LOGITS)
    assert torch.isfinite(dist).all() and float(dist.sum()) == pytest.approx(1)
    sampler.choose(dist[0])


def test_tiny_temperature_is_greedy_and_ordinary_sampling_is_untouched():
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=0.01).greedy
    probs = Sampler(SamplingParams(temperature=1.0), [], VOCAB, "cpu").distribution(LOGITS)
    assert torch.allclose(probs, torch.softmax(LOGITS, -1))


@pytest.mark.parametrize("bad", [dict(seed=SEED_MAX + 1), dict(seed=-(2**63) - 1), dict(temperature=float("inf")),
                                 dict(repetition_penalty=float("inf")), dict(top_p=float("nan"))])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(FlashtreeError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_largest_seeds_are_taken():
    for seed in (SEED_MAX, -(2**63)):
        Sampler(SamplingParams(temperature=1.0, seed=seed), [], VOCAB, "cpu")
