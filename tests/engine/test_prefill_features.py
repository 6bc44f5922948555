"""Prefill hands each chunk's captured features to the proposer at once (memory flat in prompt length)."""

from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from tests.drafting.test_lossless import OracleProposer


class RecordingProposer(OracleProposer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commits = []

    def commit(self, features, positions):
        self.commits.append((features.shape, positions.tolist()))


def test_prefill_streams_features_chunk_by_chunk(make_gguf):
    target = load_target(make_gguf(), device="cpu")
    prompt = list(range(5, 55))
    proposer = RecordingProposer(prompt, target.config.vocab_size, seed=0)
    config = GenerationConfig(mode="chain", max_new_tokens=1, prefill_chunk=16, ignore_eos=True)
    Engine(target, proposer).generate(prompt, config)
    prefill = proposer.commits[:4]
    assert [len(p) for _, p in prefill] == [16, 16, 16, 2]
    assert sum((p for _, p in prefill), []) == list(range(50))
    assert all(shape[0] <= 16 and shape[1] == target.config.hidden_size for shape, _ in prefill)


def test_long_prompts_show_a_prefill_progress_bar_when_asked(make_gguf, monkeypatch, capsys):
    from flashtree.engine import runner
    from flashtree.engine.prefix_cache import PrefixCache

    monkeypatch.setattr(runner, "PROGRESS_MIN_TOKENS", 40)
    target = load_target(make_gguf(), device="cpu")
    config = GenerationConfig(max_new_tokens=1, prefill_chunk=16, ignore_eos=True)
    engine = Engine(target)
    engine.generate(list(range(5, 55)), config)
    assert "prefill" not in capsys.readouterr().err  # not asked (library use, serve)
    engine.runner.prefill_progress = True
    engine.generate(list(range(5, 35)), config)
    assert "prefill" not in capsys.readouterr().err  # short prompt
    engine.generate(list(range(5, 55)), config)
    assert "prefill" in (err := capsys.readouterr().err) and "/50" in err.replace(".0", "")  # total: 50 tokens
    engine.prefix_cache = PrefixCache(interval=16)  # the cached path prefills chunk by chunk itself
    engine.generate(list(range(5, 55)), config)
    assert "prefill" in capsys.readouterr().err
