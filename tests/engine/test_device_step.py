"""The whole greedy speculative step as one static function (`GraphedForward.speculative_step`): draft, tree
build, verify, walk and commit on the device. On the CPU the runner runs the function a CUDA graph captures
eagerly (the kernels' reference forms), so these prove it lossless against autoregressive decoding and
equal to the host-side step; on CUDA the graphs replay."""

from dataclasses import replace

import pytest
import torch

from flashtree.engine.config import EngineArgs, GenerationConfig
from flashtree.engine.cuda_graphs import GraphedForward
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_engine
from flashtree.engine.prefix_cache import PrefixCache
from flashtree.engine.sampling import SamplingParams
from flashtree.parallel import placement


@pytest.fixture(scope="module")
def demo():
    """The demo pair with its draft in float32 on any CPU: a bf16 draft's logits (`draft_dtype`, on a CPU with bf16
    instructions) hold exact ties, which the device's float32 tree scores and the host's float64 ones may order
    differently, so the trees could differ where the tokens cannot (`test_a_bf16_draft_...` below)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placement, "cpu_has_bf16_dot", lambda: False)
        return load_engine(EngineArgs(device="cpu"))


def static_engine(demo, **options) -> Engine:
    engine = Engine(demo.target, demo.draft, **options)
    engine.runner._graphs = GraphedForward(demo.target.model, capture_graphs=False)
    return engine


def device_steps(engine: Engine) -> int:
    return sum(key[0] == "speculative" for key in engine.runner._graphs.steps.entries)


PROMPTS = ["def fib(n):", "Write a function that reverses a list.", "def is_prime(n):"]


@pytest.mark.parametrize("mode,budget", [("ddtree", 22), ("ddtree", 7), ("chain", 15)])
def test_device_steps_equal_autoregressive_and_the_host_steps(demo, mode, budget):
    config = GenerationConfig(max_new_tokens=48, mode=mode, budget=budget, ignore_eos=True, adaptive=False)
    engine = static_engine(demo)
    for text in PROMPTS:
        ids = demo.encode_prompt(text)
        ar = demo.generate(ids, GenerationConfig(max_new_tokens=48, mode="ar", ignore_eos=True)).token_ids
        host = demo.generate(ids, config)  # no graph runner on the CPU: the host builds and walks the trees
        device = engine.generate(ids, config)
        assert device.token_ids == host.token_ids == ar, text
        # the same trees (float32 scores on the device, float64 on the host: only near-ties could differ)
        assert device.stats.accepted == host.stats.accepted, text
    assert device.stats.acceptance_length > 2 and device_steps(engine) >= 1


def test_a_bf16_draft_device_steps_equal_autoregressive_and_the_host_steps_tokens(monkeypatch):
    monkeypatch.setattr(placement, "cpu_has_bf16_dot", lambda: True)
    bf16 = load_engine(EngineArgs(device="cpu"))
    assert bf16.draft.fc.weight.dtype == torch.bfloat16
    config = GenerationConfig(max_new_tokens=48, mode="ddtree", budget=22, ignore_eos=True, adaptive=False)
    engine = static_engine(bf16)
    for text in PROMPTS:
        ids = bf16.encode_prompt(text)
        ar = bf16.generate(ids, GenerationConfig(max_new_tokens=48, mode="ar", ignore_eos=True)).token_ids
        assert engine.generate(ids, config).token_ids == bf16.generate(ids, config).token_ids == ar, text
    assert device_steps(engine) >= 1


def test_requests_the_device_step_cannot_serve_take_the_host_step(demo):
    """Sampling, penalties, a logit bias and log-probabilities need the host between verify and walk."""
    ids = demo.encode_prompt(PROMPTS[0])
    for options in ({"logprobs": 2}, {"sampling": SamplingParams(repetition_penalty=1.2)},
                    {"sampling": SamplingParams(logit_bias=((3, 1.0),))},
                    {"sampling": SamplingParams(temperature=0.8, seed=1)}):
        engine = static_engine(demo)
        config = GenerationConfig(max_new_tokens=16, mode="ddtree", ignore_eos=True, adaptive=False, **options)
        reference = demo.generate(ids, config).token_ids
        assert engine.generate(ids, config).token_ids == reference, options
        assert device_steps(engine) == 0, options


def test_a_cache_first_made_for_prompt_logprobs_serves_the_next_request(demo):
    """A graphed engine keeps its cache across requests; the first one made inside `score_prompt` (inference
    mode) was an inference tensor, and the next request's reset failed ("Inplace update to inference tensor
    outside InferenceMode", seen on the H200 after the bench's margin check, 2026-12-01)."""
    ids = demo.encode_prompt(PROMPTS[0])
    engine = static_engine(demo)
    scored = GenerationConfig(max_new_tokens=8, mode="ddtree", ignore_eos=True, adaptive=False, prompt_logprobs=1)
    plain = replace(scored, prompt_logprobs=None)
    assert engine.generate(ids, scored).token_ids == demo.generate(ids, scored).token_ids
    assert engine.generate(ids, plain).token_ids == demo.generate(ids, plain).token_ids


def test_an_output_that_ends_inside_a_committed_path_keeps_the_prefix_cache_right(demo):
    """The device step commits the accepted path before the host sees its tokens, so a request whose output
    ends inside a path (here its token limit) leaves the cache past the output: the prefix cache must then
    store only the prompt's snapshots, and the next turn, restored from them, must still equal AR."""
    ids = demo.encode_prompt(PROMPTS[1])
    ar = demo.generate(ids, GenerationConfig(max_new_tokens=40, mode="ar", ignore_eos=True)).token_ids
    engine = static_engine(demo, prefix_cache=PrefixCache())
    overran = 0
    for limit in range(9, 17):
        config = GenerationConfig(max_new_tokens=limit, mode="ddtree", ignore_eos=True, adaptive=False)
        assert engine.generate(ids, config).token_ids == ar[:limit], limit
        overran += engine.runner._kept_cache[1].length > len(ids) + limit  # a path committed past the limit
    assert overran >= 1 and engine.prefix_cache.stats.hits >= 1 and device_steps(engine) >= 1
    follow_up = ids + ar[:13] + demo.encode_prompt(PROMPTS[2])[:5]
    expected = demo.generate(follow_up, GenerationConfig(max_new_tokens=24, mode="ar", ignore_eos=True)).token_ids
    config = GenerationConfig(max_new_tokens=24, mode="ddtree", ignore_eos=True, adaptive=False)
    assert engine.generate(follow_up, config).token_ids == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_device_steps_equal_the_host_steps_on_the_gpu(monkeypatch):
    """float32 on the GPU: the replayed one-graph steps (chain and DDTree) give the tokens of the host-side
    steps (the same trees, verify kernels and walk). Against AR they may differ where the target nearly ties:
    a verify row and a decode row round differently on the GPU (the demo pair's chain on "def is_prime(n):"
    differed at a margin of 0.02 on the H200, 2026-12-01); each such difference is a near-tie by the bench's
    rule (bench.fidelity.MARGIN)."""
    from flashtree.bench.divergence import first_difference, margin_after
    from flashtree.bench.fidelity import MARGIN
    from flashtree.engine import decode
    from flashtree.engine.loader import DEMO_DRAFT, DEMO_TARGET, engine_from_target, load_target

    gpu = engine_from_target(load_target(DEMO_TARGET, device="cuda", dtype=torch.float32),
                             EngineArgs(draft=str(DEMO_DRAFT)))
    device_step_runner = decode.device_step_runner
    for text in PROMPTS:
        ids = gpu.encode_prompt(text)
        ar_config = GenerationConfig(max_new_tokens=96, mode="ar", ignore_eos=True)
        ar = gpu.generate(ids, ar_config).token_ids
        for mode in ("chain", "ddtree"):
            config = GenerationConfig(max_new_tokens=96, mode=mode, ignore_eos=True, adaptive=False)
            device = gpu.generate(ids, config)
            monkeypatch.setattr(decode, "device_step_runner", lambda *args: None)
            host = gpu.generate(ids, config)
            monkeypatch.setattr(decode, "device_step_runner", device_step_runner)
            assert device.token_ids == host.token_ids, (text, mode)
            assert device.stats.acceptance_length > 2
            position = first_difference(device.token_ids, ar)
            if position is not None:
                assert margin_after(gpu, ids + ar[: position + 1], ar_config) <= MARGIN, (text, mode, position)
    entries = gpu.runner.graph_runner().steps.entries
    assert any(key[0] == "speculative" and entry.graph is not None for key, entry in entries.items())
