"""Layer split and draft placement: greedy output identical to one device (two "devices" = the same CPU)."""

import pytest
import torch

from flashtree.parallel import placement
from flashtree.parallel.placement import layer_counts, parse_split, place_layers
from flashtree.engine.config import EngineArgs, GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_engine, load_target
from flashtree.errors import FlashtreeError
from flashtree.models.step import Step
from flashtree.models.synthetic import tiny_config
from tests.drafting.test_lossless import OracleProposer, random_draft

PROMPTS = [[3, 17, 99, 250, 8], [400, 2, 2, 71, 5, 33, 120, 9, 61]]
N_NEW = 40


@pytest.fixture(scope="module")
def gguf(make_gguf):
    return make_gguf("spec", config=tiny_config(num_layers=4, gdn_v_heads=4))


@pytest.fixture(scope="module")
def single(gguf):
    return load_target(gguf, device="cpu")


@pytest.fixture(scope="module")
def expected(single):
    engine = Engine(single)
    config = GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True)
    return [engine.generate(p, config).token_ids for p in PROMPTS]


def test_layer_counts_and_parsing():
    assert layer_counts(64, [1, 1]) == [32, 32]
    assert layer_counts(64, [20, 44]) == [20, 44]  # whole numbers adding up to the layers: counts
    assert layer_counts(64, [3, 1]) == [48, 16]  # otherwise proportions
    assert layer_counts(10, [1, 1, 1]) == [3, 4, 3] and sum(layer_counts(7, [0.3, 0.3, 0.4])) == 7
    assert parse_split("0.75, 0.25") == [0.75, 0.25]
    for bad in ("a,b", "0,0", "-1,2"):
        with pytest.raises(FlashtreeError):
            parse_split(bad)


def test_split_places_layers_and_hops_at_boundaries(gguf, single, monkeypatch):
    split = place_layers(load_target(gguf, device="cpu").model, ["cpu", "cpu"], [1, 3])
    assert split.boundaries == {0: torch.device("cpu"), 1: torch.device("cpu")}
    assert placement.describe(split) == "layers 0-0 on cpu, layers 1-3 on cpu"
    hops = []
    real_to = Step.to
    monkeypatch.setattr(Step, "to", lambda self, d: hops.append(d) or real_to(self, d))
    tokens = torch.tensor([5, 9, 200, 31, 7])
    a = single.model.forward(tokens, single.model.new_cache(32), capture=(1, 2))
    b = split.forward(tokens, split.new_cache(32), capture=(1, 2))
    assert len(hops) == 2
    assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)
    with pytest.raises(FlashtreeError):
        place_layers(load_target(gguf, device="cpu").model, ["cpu", "cpu"], [4, 0])


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_layer_split_and_draft_device_are_lossless(gguf, single, expected, tmp_path, mode):
    draft_dir = tmp_path / "draft"
    random_draft(single).save(draft_dir)
    engine = load_engine(EngineArgs(gguf, draft_dir if mode != "ar" else None, "cpu", spec=mode, budget=15, topk=4,
                                    layer_split="1,1", devices=["cpu", "cpu"], draft_device="cpu"))
    assert sorted(engine.target.model.boundaries) == [0, 2]
    config = engine.config_for(max_new_tokens=N_NEW, ignore_eos=True)
    for prompt, want in zip(PROMPTS, expected):
        assert engine.generate(prompt, config).token_ids == want
    if mode == "ddtree":  # an oracle draft makes long accepted paths: commits across the boundary
        for prompt, want in zip(PROMPTS, expected):
            result = Engine(engine.target, OracleProposer(prompt + want, single.config.vocab_size, seed=1)).generate(
                prompt, config)
            assert result.token_ids == want and max(result.stats.accepted) >= 4


def test_layer_split_with_the_prefix_cache(gguf, single):
    from flashtree.engine.prefix_cache import PrefixCache

    split = load_engine(EngineArgs(gguf, None, "cpu", spec="ar", layer_split="1,3"))  # --device cpu: two "cpu" stages
    split.prefix_cache = PrefixCache()
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prompt = list(range(10, 70))
    for p in (prompt, prompt + [5, 6, 7], prompt[:40] + [9]):  # the later ones reuse cached prefixes
        assert split.generate(p, config).token_ids == Engine(single).generate(p, config).token_ids


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_draft_on_its_own_device_prefetches_the_next_block(gguf, single, expected, tmp_path, monkeypatch, mode):
    """With a draft device of its own, each commit starts the next block pass before the target's commit
    (two "devices" = the CPU here: `overlaps` forced on); output is unchanged and each step's block pass
    runs once, not again in `propose`."""
    from flashtree.drafting.proposer import DFlashProposer

    draft_dir = tmp_path / "draft"
    random_draft(single).save(draft_dir)
    engine = load_engine(EngineArgs(gguf, draft_dir, "cpu", spec=mode, budget=15, topk=4, draft_device="cpu"))
    monkeypatch.setattr(DFlashProposer, "overlaps", property(lambda self: True))
    passes, prefetches = [], []
    real_block, real_prefetch = DFlashProposer._block_hidden, DFlashProposer.prefetch
    monkeypatch.setattr(DFlashProposer, "_block_hidden", lambda self, *a: passes.append(a) or real_block(self, *a))
    monkeypatch.setattr(DFlashProposer, "prefetch", lambda self, *a: prefetches.append(a) or real_prefetch(self, *a))
    config = engine.config_for(max_new_tokens=N_NEW, ignore_eos=True, adaptive=False)  # a tree every step
    for prompt, want in zip(PROMPTS, expected):
        passes.clear(), prefetches.clear()
        result = engine.generate(prompt, config)
        assert result.token_ids == want
        # one prefetch per commit (the last step may end inside its path, before committing); the block
        # passes: the first after the prefill, then only the prefetched ones
        assert result.stats.steps - 1 <= len(prefetches) <= result.stats.steps and result.stats.steps > 2
        assert len(passes) == 1 + len(prefetches)
