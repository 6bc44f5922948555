"""Engine and sampling flags shared by run, serve, chat and bench."""

import pytest

from flashtree.cli.args import engine_args, sampling_from_args
from flashtree.cli.main import build_parser
from flashtree.engine.config import EngineArgs
from flashtree.engine.loader import load_engine
from flashtree.engine.sampling import SamplingParams
from flashtree.errors import FlashtreeError


def test_enforce_eager_turns_cuda_graphs_off():
    args = build_parser().parse_args(["run", "--enforce-eager", "hi"])
    assert engine_args(args).enforce_eager
    assert engine_args(build_parser().parse_args(["run", "hi"])) == EngineArgs()
    assert not load_engine(engine_args(args, device="cpu")).runner.use_cuda_graphs
    assert load_engine(EngineArgs(device="cpu")).runner.use_cuda_graphs


def test_flags_become_the_engine_settings():
    args = build_parser().parse_args(["serve", "--budget", "15", "--topk", "4", "-c", "4096", "-ctk", "q8_0"])
    settings = engine_args(args, max_new_tokens=32)
    assert (settings.budget, settings.topk, settings.ctx, settings.cache_type_k) == (15, 4, 4096, "q8_0")
    engine = load_engine(EngineArgs(device="cpu", spec="ar", budget=15, max_new_tokens=32, prefill_progress=True,
                                    prefix_cache=True, prefix_cache_entries=5))
    assert (engine.default_config.budget, engine.default_config.max_new_tokens) == (15, 32)
    assert engine.runner.prefill_progress and engine.prefix_cache.max_entries == 5
    assert load_engine(EngineArgs(device="cpu", spec="ar")).prefix_cache is None


@pytest.mark.parametrize("bad", [{"budget": 0}, {"topk": 0}, {"spec": "beam"}, {"tensor_parallel": 0}, {"ctx": 1},
                                 {"attn_window": -1}, {"gpus": 0}])
def test_engine_args_are_checked_on_construction(bad):
    with pytest.raises(FlashtreeError):
        EngineArgs(**bad)


def test_left_out_sampling_flags_keep_the_sampling_defaults():
    assert sampling_from_args(build_parser().parse_args(["run", "hi"])) == SamplingParams()
    given = sampling_from_args(build_parser().parse_args(["run", "hi", "--temp", "0.7", "--top-k", "5"]))
    assert given == SamplingParams(temperature=0.7, top_k=5)
