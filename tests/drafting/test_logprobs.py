"""Log-probabilities of generated tokens: the same in every decoding mode (each token's entry comes from the
row it was chosen from: a decode step, or its parent's row in the verified tree)."""

import math

import pytest

from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.errors import FlashtreeError
from flashtree.models.synthetic import tiny_config
from tests.drafting.test_lossless import OracleProposer, random_draft

PROMPT = [3, 17, 99, 250, 8, 41]


@pytest.fixture(scope="module")
def target(make_gguf):
    return load_target(make_gguf("logprobs", config=tiny_config(num_layers=4, gdn_v_heads=4)), device="cpu")


@pytest.mark.parametrize("mode, proposer", [("ddtree", "oracle"), ("ddtree", "random"), ("chain", "random")])
def test_every_mode_reports_the_autoregressive_logprobs(target, mode, proposer):
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True, logprobs=3)
    ar = Engine(target).generate(PROMPT, config)
    draft = OracleProposer(PROMPT + ar.token_ids, target.config.vocab_size, seed=2) if proposer == "oracle" \
        else random_draft(target)
    spec = Engine(target, draft).generate(PROMPT, GenerationConfig(
        max_new_tokens=40, ignore_eos=True, logprobs=3, mode=mode, budget=15, topk=4, adaptive=False))
    assert spec.token_ids == ar.token_ids
    if proposer == "oracle":
        assert spec.stats.acceptance_length > 2  # most entries come from tree rows, not decode rows
    assert [e.token for e in spec.logprobs] == [e.token for e in ar.logprobs] == ar.token_ids
    for a, s in zip(ar.logprobs, spec.logprobs):
        assert math.isclose(a.logprob, s.logprob, abs_tol=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in s.top] and len(s.top) == 3
        assert s.top[0][0] == s.token and math.isclose(s.top[0][1], s.logprob, abs_tol=1e-6)  # greedy: the argmax
        assert s.logprob <= 0 and sum(math.exp(lp) for _, lp in s.top) <= 1 + 1e-6


def test_off_by_default_and_sampled_tokens_get_theirs(target):
    engine = Engine(target, random_draft(target))
    assert engine.generate(PROMPT, GenerationConfig(max_new_tokens=8, mode="ddtree")).logprobs is None
    from flashtree.engine.sampling import SamplingParams

    config = GenerationConfig(max_new_tokens=30, ignore_eos=True, mode="ddtree", logprobs=0,
                              sampling=SamplingParams(temperature=1.5, seed=7))
    result = engine.generate(PROMPT, config)
    assert [e.token for e in result.logprobs] == result.token_ids
    assert all(e.top == () and -50 < e.logprob <= 0 for e in result.logprobs)
    with pytest.raises(FlashtreeError, match="logprobs must be from 0 to 20, got 21"):
        GenerationConfig(logprobs=21)


def test_logit_bias_changes_both_modes_alike(target):
    from flashtree.engine.sampling import SamplingParams

    plain = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    unbiased = Engine(target).generate(PROMPT, plain).token_ids
    bias = tuple((token, 4.0) for token in (7, 11, 300)) + ((unbiased[0], -100.0),)
    biased = GenerationConfig(max_new_tokens=40, ignore_eos=True, sampling=SamplingParams(logit_bias=bias))
    ar = Engine(target).generate(PROMPT, biased).token_ids
    spec = Engine(target, random_draft(target)).generate(PROMPT, GenerationConfig(
        max_new_tokens=40, ignore_eos=True, mode="ddtree", budget=15, topk=4, sampling=SamplingParams(logit_bias=bias)))
    assert ar != unbiased and ar[0] != unbiased[0] and spec.token_ids == ar
    with pytest.raises(FlashtreeError, match="logit_bias"):
        SamplingParams(logit_bias=((5, 101.0),))


def test_prompt_scores_are_what_decoding_the_prompt_would_report(target):
    """Token i of the prompt scored from the logits after tokens 0..i-1, as if the model had generated it:
    generating from the prompt's first i tokens with token i forced (a logit bias; logprobs are of the raw
    logits) reports the same numbers."""
    from flashtree.engine.sampling import SamplingParams

    prompt = PROMPT + [77, 5, 140, 9, 230, 61, 12]
    scored = Engine(target).generate(prompt, GenerationConfig(max_new_tokens=2, prompt_logprobs=2)).prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None and [e.token for e in scored[1:]] == prompt[1:]
    for i in (1, 3, len(prompt) - 1):
        forced = GenerationConfig(max_new_tokens=1, logprobs=2, sampling=SamplingParams(logit_bias=((prompt[i], 100.0),)))
        [entry] = Engine(target).generate(prompt[:i], forced).logprobs
        assert entry.token == prompt[i] and math.isclose(entry.logprob, scored[i].logprob, abs_tol=1e-4)
        assert [t for t, _ in entry.top] == [t for t, _ in scored[i].top]


def test_prompt_scores_do_not_depend_on_the_chunking(target, monkeypatch):
    import flashtree.engine.runner as runner

    prompt = PROMPT * 3
    config = GenerationConfig(max_new_tokens=1, prompt_logprobs=1)
    whole = Engine(target).generate(prompt, config).prompt_logprobs
    monkeypatch.setattr(runner, "SCORE_CHUNK", 4)
    chunked = Engine(target).generate(prompt, config).prompt_logprobs
    assert [e.token for e in chunked[1:]] == [e.token for e in whole[1:]] == prompt[1:]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(whole[1:], chunked[1:]))
