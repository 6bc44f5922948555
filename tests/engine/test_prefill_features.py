"""Prefill hands each chunk's captured features to the proposer at once (memory flat in prompt length)."""

from flashtree.engine.generate import Engine, GenerationConfig
from flashtree.engine.loader import load_target
from tests.spec.test_lossless import OracleProposer


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
