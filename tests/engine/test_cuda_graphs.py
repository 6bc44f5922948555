"""Static (graph-ready) decode and verify steps: padded trees, bucketed cache reads, packed inputs.

On the CPU the runner executes the very function a CUDA graph captures, eagerly, so these tests prove
that the static path is lossless against eager autoregressive decoding; on CUDA the graphs themselves
are replayed and compared with the eager CUDA engine.
"""

import pytest
import torch

from flashtree.engine import cuda_graphs, runner
from flashtree.engine.config import GenerationConfig
from flashtree.engine.cuda_graphs import GraphedForward, bucket_rows
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.models.synthetic import tiny_config
from tests.drafting.test_lossless import OracleProposer, prompts, random_draft

N_NEW = 120


@pytest.fixture(scope="module")
def target(make_gguf):
    return load_target(make_gguf("graphs", config=tiny_config(num_layers=4, gdn_v_heads=4)), device="cpu")


def reference(target, prompt, **options):
    config = GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True, **options)
    return Engine(target).generate(prompt, config).token_ids


def static_engine(target, draft=None) -> Engine:
    engine = Engine(target, draft)
    engine.runner._graphs = GraphedForward(target.model, capture_graphs=False)
    return engine


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MIN_BUCKET", 16)  # many bucket crossings in a short generation


def test_bucket_rows_cover_the_need_with_bounded_waste():
    for needed in [1, 15, 16, 17, 100, 1000, 5000, 70000]:
        rows = bucket_rows(needed, 1 << 20)
        assert needed <= rows < needed + max(needed // 4, cuda_graphs.MIN_BUCKET)
    assert bucket_rows(1000, 900) == 900  # never past the capacity


@pytest.mark.parametrize("mode,budget", [("ar", 22), ("chain", 15), ("ddtree", 22), ("ddtree", 5)])
def test_static_steps_equal_eager_autoregressive(target, mode, budget):
    vocab = target.config.vocab_size
    engine = static_engine(target)
    caches = set()
    for i, prompt in enumerate(prompts(vocab)[:5]):
        expected = reference(target, prompt)
        engine.draft = OracleProposer(prompt + expected, vocab, seed=i)
        # fixed trees (adaptive off): the padded tree shapes are what is under test
        config = GenerationConfig(max_new_tokens=N_NEW, mode=mode, budget=budget, ignore_eos=True, adaptive=False)
        result = engine.generate(prompt, config)
        assert result.token_ids == expected, f"prompt {i}"
        caches.add(id(engine.runner._kept_cache[1]))
        if mode == "ddtree":
            assert result.stats.acceptance_length > 2  # real multi-token acceptance through padded trees
    assert len(caches) == 1  # one cache, reset and reused by every request (graphs stay valid)


@pytest.mark.parametrize("options", [{"attn_window": 24}, {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}])
def test_static_steps_with_window_and_quantized_kv(target, options):
    vocab = target.config.vocab_size
    prompt = prompts(vocab)[1]
    expected = reference(target, prompt, **options)
    engine = static_engine(target, random_draft(target))
    config = GenerationConfig(max_new_tokens=N_NEW, mode="ddtree", ignore_eos=True, **options)
    assert engine.generate(prompt, config).token_ids == expected


def test_a_larger_request_reallocates_the_cache(target):
    engine = static_engine(target)
    short = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    engine.generate([1, 2, 3], short)
    first = engine.runner._kept_cache[1]
    engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True))
    assert engine.runner._kept_cache[1] is not first and engine.runner._kept_cache[1].capacity > first.capacity


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_cuda_graph_replay_equals_eager_cuda(make_gguf, mode):
    path = make_gguf("graphs-cuda", config=tiny_config(num_layers=4, gdn_v_heads=4))
    gpu = load_target(path, device="cuda", dtype=torch.float32)
    vocab = gpu.config.vocab_size
    for i, prompt in enumerate(prompts(vocab)[:3]):
        eager = Engine(gpu)
        eager.runner.use_cuda_graphs = False
        expected = eager.generate(prompt, GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True)).token_ids
        graphed = Engine(gpu, OracleProposer(prompt + expected, vocab, seed=i))
        config = GenerationConfig(max_new_tokens=N_NEW, mode=mode, ignore_eos=True)
        assert graphed.generate(prompt, config).token_ids == expected
        assert graphed.runner.graph_runner().steps.capture_graphs and graphed.runner.graph_runner().steps.entries


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_padded_chain_prefill_replays_equal_eager_cuda(make_gguf):
    """A prompt of each padded length's range (`runner.CHAIN_ROWS`, and two runs past 32 tokens) prefilled as
    captured chain verifies and captured commits gives the eager CUDA engine's tokens (float32)."""
    gpu = load_target(make_gguf("graphs-cuda", config=tiny_config(num_layers=4, gdn_v_heads=4)), device="cuda",
                      dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    for n in (2, 7, 16, 23, 33, 47, 64):
        prompt = torch.randint(0, gpu.config.vocab_size, (n,), generator=generator).tolist()
        config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
        eager = Engine(gpu)
        eager.runner.use_cuda_graphs = False
        graphed = Engine(gpu)
        assert graphed.generate(prompt, config).token_ids == eager.generate(prompt, config).token_ids, n
        shapes = {key[0] for key in graphed.runner.graph_runner().steps.entries if key[1] is True}
        runs = [min(32, n - start) for start in range(0, n, 32)]
        assert shapes == {runner.chain_rows(r, 1 << 20) for r in runs if r > 1}, (n, shapes)


def test_static_draft_block_equals_the_eager_one(target):
    """Bucketed context reads with invalid slots masked give the eager block pass's logits, before and
    after the draft's context ring wraps."""
    from flashtree.drafting.proposer import DFlashProposer

    draft = random_draft(target)
    eager = DFlashProposer(target.model, draft, window=40)
    static = DFlashProposer(target.model, draft, window=40, capture_graphs=False)
    features = torch.randn(70, draft.config.feature_size)
    for proposer in (eager, static):
        proposer.start()
    for start, stop in [(0, 21), (21, 33), (33, 70)]:  # 21 and 33 valid slots, then a wrapped ring
        for proposer in (eager, static):
            proposer.commit(features[start:stop], torch.arange(start, stop))
        want, got = eager.propose(7, stop), static.propose(7, stop)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (stop, (got - want).abs().max())


def test_static_draft_pass_and_commit_accept_like_the_eager_ones():
    """The static draft block pass and the static draft commit (one graph with the target commit) feed
    the same context as the eager ones: on the trained demo pair, acceptance is the same."""
    from flashtree.engine.config import EngineArgs
    from flashtree.engine.loader import load_engine

    demo = load_engine(EngineArgs(device="cpu"))
    config = GenerationConfig(max_new_tokens=64, mode="ddtree", ignore_eos=True, adaptive=False)  # trees every step
    for prompt in ["def fib(n):", "Write a function that reverses a list."]:
        ids = demo.encode_prompt(prompt)
        eager = demo.generate(ids, config)
        static = static_engine(demo.target, demo.draft).generate(ids, config)
        assert static.token_ids == eager.token_ids
        assert eager.stats.acceptance_length > 2
        assert abs(static.stats.acceptance_length - eager.stats.acceptance_length) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_the_draft_passes_replay_graphs_on_an_unindexed_gpu(device):
    """`--device cuda` (or auto) names the GPU without its index, while the draft's weights report `cuda:0`:
    the proposer must still see one device, capture its block pass and commit it with the target's, and
    never take the two-device prefetch path."""
    from flashtree.engine.config import EngineArgs
    from flashtree.engine.decode import proposer_for
    from flashtree.engine.loader import load_engine

    demo = load_engine(EngineArgs(device=device))
    assert demo.target.model.device.index is not None
    config = GenerationConfig(max_new_tokens=24, mode="ddtree", ignore_eos=True)
    demo.generate(demo.encode_prompt("def fib(n):"), config)
    proposer = proposer_for(demo.runner, config)
    assert proposer.steps is not None and proposer.steps.capture_graphs
    assert not proposer.overlaps
    # greedy: the block pass is captured inside the whole step's graph (GraphedForward.speculative_step)
    entries = demo.runner.graph_runner().steps.entries
    assert any(key[0] == "speculative" and key[-1] == id(proposer) and entry.graph is not None
               for key, entry in entries.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chain_then_ddtree_on_one_engines_graphs_equal_ar():
    """A commit graph once captured the verify's features as one request's slice of its real nodes and kept
    that bound: after chain requests (16 nodes, then sharing ddtree's padded verify shape) the next tree's
    accepted nodes past it hit an index assert (the demo pair, H200 2026-12-01). Trees smaller than their
    padded shape meet the same graphs within one mode. Here both modes, one after the other on one engine
    in float32, give the AR tokens."""
    from flashtree.engine.config import EngineArgs
    from flashtree.engine.loader import DEMO_DRAFT, DEMO_TARGET, engine_from_target

    demo = engine_from_target(load_target(DEMO_TARGET, device="cuda", dtype=torch.float32),
                              EngineArgs(draft=str(DEMO_DRAFT)))
    prompts_ = [demo.encode_prompt(text) for text in ("def fib(n):", "def is_prime(n):")]
    for mode in ("ar", "chain", "ddtree"):
        config = GenerationConfig(max_new_tokens=96, mode=mode, ignore_eos=True, adaptive=False)
        outputs = [demo.generate(prompt, config) for prompt in prompts_]
        if mode == "ar":
            expected = [result.token_ids for result in outputs]
        else:
            assert [result.token_ids for result in outputs] == expected, mode
            assert max(max(result.stats.accepted) for result in outputs) > 8  # long paths: nodes past a chain's


def test_a_chain_verifies_one_draft_block_not_the_budget(target):
    """A chain is at most one draft block long: at budget 22 its verify pads to 16 rows (15 below the root),
    not 23 (at the 27B shape a 16-row verify took 13.2 ms against 17.0 ms for 23, H200 2026-12-01); a DDTree
    of the same budget keeps its 23. Both give the AR tokens."""
    engine = static_engine(target, random_draft(target))
    prompt = prompts(target.config.vocab_size)[0]
    expected = Engine(target).generate(prompt, GenerationConfig(max_new_tokens=24, ignore_eos=True)).token_ids
    for mode, rows in (("chain", 16), ("ddtree", 23)):
        config = GenerationConfig(max_new_tokens=24, mode=mode, budget=22, ignore_eos=True, adaptive=False)
        assert engine.generate(prompt, config).token_ids == expected
        # greedy: the whole step is one static function (GraphedForward.speculative_step), keyed by its rows
        sizes = {key[2] for key in engine.runner.graph_runner().steps.entries if key[0] == "speculative"}
        assert rows in sizes
    assert sizes == {16, 23}


def _spied_forwards(engine, monkeypatch) -> list[tuple[int, int | None]]:
    """(tokens, padded rows: None for a run) of each static forward the engine runs from here on."""
    calls, graphs = [], engine.runner.graph_runner()
    real = graphs.forward
    monkeypatch.setattr(graphs, "forward", lambda tokens, cache, tree=None, capture=(), pad_to=None:
                        calls.append((len(tokens), None if tree is None else pad_to))
                        or real(tokens, cache, tree, capture, pad_to))
    return calls


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_a_short_prefill_chunk_is_one_padded_chain_verify(target, mode, monkeypatch):
    """A prefill chunk of 2-32 tokens runs as one chain verify padded to the next of CHAIN_ROWS and the commit
    of its tokens (23 tokens: 24 rows), not one eager forward; the output stays the eager engine's,
    and in a speculative request the draft is handed every prompt position's features."""
    engine = static_engine(target, random_draft(target) if mode != "ar" else None)
    calls = _spied_forwards(engine, monkeypatch)
    prompt = (prompts(target.config.vocab_size)[0] * 23)[:23]
    config = GenerationConfig(max_new_tokens=6, mode=mode, ignore_eos=True, adaptive=False)
    assert engine.generate(prompt, config).token_ids == reference(target, prompt)[:6]
    assert calls[0] == (23, 24)
    if mode == "ar":
        assert set(calls[1:]) == {(1, None)}
    else:
        assert engine.runner.graph_runner().proposer.cache.count >= 23


def test_chain_rows_pad_to_the_next_length_that_fits():
    assert [runner.chain_rows(n, 1000) for n in (1, 2, 4, 5, 23, 32)] == [1, 4, 4, 8, 24, 32]
    assert runner.chain_rows(33, 1000) is None  # longer: not one run
    assert runner.chain_rows(23, 23) is None and runner.chain_rows(23, 24) == 24  # the padding must fit the cache


def test_a_chunk_of_more_than_32_tokens_runs_as_two_padded_chains(target, monkeypatch):
    """40 tokens: a chain of 32 and one of 8 rows; 33: a chain of 32 and the decode step; the eager tokens."""
    for n, runs in ((40, [(32, 32), (8, 8)]), (33, [(32, 32), (1, None)])):
        engine = static_engine(target)
        calls = _spied_forwards(engine, monkeypatch)
        prompt = (prompts(target.config.vocab_size)[1] * n)[:n]
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True)).token_ids == \
            reference(target, prompt)[:4]
        assert calls[:2] == runs


def test_a_chunk_whose_padding_would_pass_the_context_runs_eagerly(target, monkeypatch):
    """At the end of a small context (17 prompt tokens + 1 new + 3 scratch rows = 21 < 24) the chunk cannot be
    padded; it runs eagerly and the output is still the eager engine's."""
    engine = static_engine(target)
    calls = _spied_forwards(engine, monkeypatch)
    prompt = (prompts(target.config.vocab_size)[0] * 17)[:17]
    config = GenerationConfig(max_new_tokens=1, budget=1, ignore_eos=True)
    assert engine.generate(prompt, config).token_ids == reference(target, prompt)[:1]
    assert calls == []


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_warm_up_meets_the_step_shape_of_every_budget_the_policy_can_take(target, mode):
    """`Engine.warm_up` runs the request and a few fixed steps at each smaller rung of the budget ladder, so a
    request on the same prompt that the policy moves to any rung meets no verify shape for the first time
    (on CUDA: no compile, no capture mid-request)."""
    vocab = target.config.vocab_size
    prompt = prompts(vocab)[0]
    engine = static_engine(target, random_draft(target))
    config = GenerationConfig(max_new_tokens=8, mode=mode, budget=22, ignore_eos=True)
    assert engine.warm_up(prompt, config) > 0
    # greedy: each step is one static function (GraphedForward.speculative_step), keyed by its tree's rows
    verify_shapes = lambda: {key[2] for key in engine.runner._graphs.steps.entries if key[0] == "speculative"}  # noqa: E731
    warmed = verify_shapes()
    for budget in (22, 11, 5, 2, 1):
        engine.generate(prompt, GenerationConfig(max_new_tokens=8, mode=mode, budget=budget, ignore_eos=True,
                                                 adaptive=False))
    assert verify_shapes() == warmed and len(warmed) == 5  # one padded tree size per rung
