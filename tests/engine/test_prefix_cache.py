"""Prefix cache across requests: output with a cache hit equals output without the cache (greedy), for
AR, chain and DDTree, through the engine and through the server; the restored recurrent state is the
state at exactly the prefix end."""

import random

import pytest
import torch
from fastapi.testclient import TestClient

from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.prefix_cache import PrefixCache, _restore_recurrent, _restore_rows
from flashtree.serve.app import build_app


def engines(target, draft, mode, **cache_kwargs):
    """(without cache, with cache) engines sharing the weights."""
    d = draft if mode != "ar" else None
    plain, cached = Engine(target, d), Engine(target, d)
    cached.prefix_cache = PrefixCache(**cache_kwargs)
    return plain, cached


def words(rng, vocab, n):
    return [rng.randrange(vocab) for _ in range(n)]


def config(mode, **kw):
    """A fixed tree budget: the adaptive policy's budgets follow measured step times, so two engines' proposals
    would differ with the machine's load (seen in CI: 72 against 64 proposed nodes)."""
    return GenerationConfig(**{"max_new_tokens": 24, "mode": mode, "ignore_eos": True, "prefill_chunk": 32,
                               "budget": 8, "adaptive": False, **kw})


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_multi_turn_identical_with_and_without_cache(target, draft, mode):
    rng = random.Random(1)
    vocab = target.config.vocab_size
    plain, cached = engines(target, draft, mode, interval=64)
    conversation = words(rng, vocab, 90)
    for turn in range(6):
        expected = plain.generate(conversation, config(mode))
        got = cached.generate(conversation, config(mode))
        assert got.token_ids == expected.token_ids, f"turn {turn}"
        # same proposals too: the restored draft context is the one an unbroken prefill builds
        assert (got.stats.accepted, got.stats.proposed) == (expected.stats.accepted, expected.stats.proposed)
        conversation = conversation + got.token_ids + words(rng, vocab, 12)
    stats = cached.prefix_cache.stats
    assert stats.misses == 1 and stats.hits == 5
    # each turn copied only the rows it added: the newest entry's rows chain back through every turn
    newest = next(reversed(cached.prefix_cache.entries.values()))
    segments = list(newest.rows.chain())
    assert len(segments) == 6 and segments[-1].base == 0
    for seg in segments:
        k = next(t for (_, name), t in seg.copies.tensors.items() if name == "k")
        assert k.shape[1] == seg.rows - seg.base and (seg.parent is None or seg.base <= seg.parent.rows)
    # every later turn restored the previous answer's end: prompt + all generated tokens but the last
    assert stats.hit_tokens > 5 * 90


def test_draft_context_ring_wraps(target, draft):
    """A draft window shorter than the conversation: the ring's slots are snapshotted and restored as is."""
    rng = random.Random(8)
    vocab = target.config.vocab_size
    plain, cached = engines(target, draft, "ddtree", interval=32)
    conversation = words(rng, vocab, 50)
    for turn in range(3):
        run = config("ddtree", draft_window=24)
        got, expected = cached.generate(conversation, run), plain.generate(conversation, run)
        assert got.token_ids == expected.token_ids, f"turn {turn}"
        assert got.stats.accepted == expected.stats.accepted
        conversation = conversation + got.token_ids + words(rng, vocab, 6)
    assert cached.prefix_cache.stats.hits == 2
    assert all(e.draft["count"] > e.draft["window"] for e in cached.prefix_cache.entries.values())


@pytest.mark.parametrize("window", [4096, 24])
def test_restored_draft_context_equals_a_fresh_prefill(target, draft, window):
    """The draft's context cache after a hit is the one an unbroken prefill builds (the seed's other bug:
    a restore that leaves the draft's feature mirror stale)."""
    from flashtree.engine.decode import proposer_for

    rng = random.Random(9)
    plain, cached = engines(target, draft, "ddtree", interval=32)
    run = config("ddtree", draft_window=window)
    prompt = words(rng, target.config.vocab_size, 70)
    answer = cached.generate(prompt, run).token_ids
    follow = prompt + answer + words(rng, target.config.vocab_size, 9)

    def draft_context(engine):
        proposer = proposer_for(engine.runner, run)
        cache = target.model.new_cache(engine.runner.context_size(len(follow), run))
        engine.runner.prefill_prompt(cache, follow, run, proposer)
        return proposer.cache

    want, got = draft_context(plain), draft_context(cached)
    assert cached.prefix_cache.stats.hit_tokens == len(prompt) + len(answer) - 1
    assert got.count == want.count == len(follow) and got.length == want.length
    n = want.length
    assert torch.equal(got.positions[:n], want.positions[:n])
    torch.testing.assert_close(got.keys[:, :, :n], want.keys[:, :, :n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.values[:, :, :n], want.values[:, :, :n], rtol=1e-4, atol=1e-5)


def test_restored_state_is_the_state_at_exactly_the_prefix_end(target):
    """The seed's bug class: a prompt that leaves a cached sequence mid-way (here inside the cached
    answer) must restore the longest snapshot ending at or before the divergence, never the longer
    entry's recurrent state."""
    rng = random.Random(2)
    vocab = target.config.vocab_size
    plain, cached = engines(target, None, "ar", interval=1 << 20)
    prompt = words(rng, vocab, 30)
    answer = cached.generate(prompt, config("ar", max_new_tokens=20)).token_ids
    assert sorted(e.length for e in cached.prefix_cache.entries.values()) == [30, 49]
    question = (prompt + answer)[:40] + words(rng, vocab, 5)
    assert cached.prefix_cache.lookup(question, touch=False).length == 30

    model = target.model
    fresh, restored = model.new_cache(64), model.new_cache(64)
    want = plain.runner.prefill_prompt(fresh, question, config("ar"))
    got = cached.runner.prefill_prompt(restored, question, config("ar"))
    assert restored.length == fresh.length == len(question)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for i in fresh.deltanet:
        torch.testing.assert_close(restored.deltanet[i].ssm, fresh.deltanet[i].ssm, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(restored.deltanet[i].conv, fresh.deltanet[i].conv, rtol=1e-4, atol=1e-5)
    for i in fresh.attention:
        torch.testing.assert_close(restored.attention[i].k[:, :45], fresh.attention[i].k[:, :45], rtol=1e-4, atol=1e-5)

    # the check has teeth: the seed's restore (rows cut at 40, recurrent state of the 49-token entry) is far off
    longer = next(e for e in cached.prefix_cache.entries.values() if e.length == 49)
    buggy = model.new_cache(64)
    _restore_rows(buggy, longer.rows, 40)
    _restore_recurrent(buggy, longer.state)
    buggy.length = 40
    model.forward(torch.tensor(question[40:]), buggy)
    i = next(iter(fresh.deltanet))
    assert not torch.allclose(buggy.deltanet[i].ssm, fresh.deltanet[i].ssm, rtol=1e-3, atol=1e-3)
    assert cached.generate(question, config("ar")).token_ids == plain.generate(question, config("ar")).token_ids


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_interval_snapshots_inside_a_long_prompt(target, draft, mode):
    rng = random.Random(3)
    vocab = target.config.vocab_size
    plain, cached = engines(target, draft, mode, interval=32)
    prompt = words(rng, vocab, 150)
    run = config(mode, prefill_chunk=20, max_new_tokens=8)
    cached.generate(prompt, run)  # chunks end at 20, 40, 60, ...: each interval point takes the chunk end below it
    lengths = sorted(e.length for e in cached.prefix_cache.entries.values())
    assert lengths[:5] == [20, 60, 80, 120, 150]  # for 32, 64, 96, 128 and the prompt end
    other = prompt[:100] + words(rng, vocab, 10)  # a different question after the same long system prompt
    got = cached.generate(other, run)
    assert cached.prefix_cache.stats.hit_tokens == 80
    assert got.token_ids == plain.generate(other, run).token_ids
    # the same prompt again: at least one token is prefilled, so the snapshot below it is used
    again = cached.generate(prompt, run)
    assert cached.prefix_cache.stats.hit_tokens == 80 + 120
    assert again.token_ids == plain.generate(prompt, run).token_ids


@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_hit_after_a_cancelled_request(target, draft, mode):
    rng = random.Random(4)
    vocab = target.config.vocab_size
    plain, cached = engines(target, draft, mode)
    prompt = words(rng, vocab, 40)
    polls = iter(range(100))
    partial = cached.generate(prompt, config(mode, max_new_tokens=50), cancelled=lambda: next(polls) >= 4)
    assert partial.finish_reason == "cancelled" and 0 < len(partial.token_ids) < 50
    follow = prompt + partial.token_ids + words(rng, vocab, 8)
    got = cached.generate(follow, config(mode))
    assert cached.prefix_cache.stats.hits == 1
    assert cached.prefix_cache.stats.hit_tokens >= 40
    if mode == "ar":  # the cancelled answer's own end: prompt + every token it produced (none was cut off)
        assert cached.prefix_cache.stats.hit_tokens == 40 + len(partial.token_ids)
    assert got.token_ids == plain.generate(follow, config(mode)).token_ids


def test_ar_entries_do_not_serve_spec_requests(target, draft):
    rng = random.Random(5)
    plain, cached = engines(target, draft, "ddtree")
    prompt = words(rng, target.config.vocab_size, 40)
    cached.generate(prompt, config("ar"))
    follow = prompt + words(rng, target.config.vocab_size, 5)
    assert cached.generate(follow, config("ddtree")).token_ids == plain.generate(follow, config("ddtree")).token_ids
    assert cached.prefix_cache.stats.hits == 0  # no draft context in the AR entry
    assert cached.generate(follow + [1], config("ar")).token_ids == plain.generate(follow + [1], config("ar")).token_ids
    assert cached.prefix_cache.stats.hits == 1  # a spec entry serves an AR request


def test_bounds_lru_and_shared_rows(target):
    rng = random.Random(6)
    vocab = target.config.vocab_size
    _, cached = engines(target, None, "ar", max_entries=3, interval=16)
    prompt = words(rng, vocab, 40)
    # snapshots at 16, 32, 40, 43: the oldest goes
    cached.generate(prompt, config("ar", max_new_tokens=4, prefill_chunk=16))
    pc = cached.prefix_cache
    assert [e.length for e in pc.entries.values()] == [32, 40, 43] and pc.stats.evictions == 1
    rows = {id(e.rows) for e in pc.entries.values()}
    assert len(rows) == 1  # one copy of the attention rows for all snapshots of a request
    rows_bytes = next(iter(pc.entries.values())).rows.copies.nbytes
    assert pc.nbytes == rows_bytes + sum(e.state.nbytes for e in pc.entries.values())
    longest = next(reversed(pc.entries))
    pc.lookup(list(longest) + [1])  # touch 43: now most recently used
    cached.generate(words(rng, vocab, 10), config("ar", max_new_tokens=2))  # entries 10, 11
    assert [e.length for e in pc.entries.values()] == [43, 10, 11]
    pc.max_bytes = pc.nbytes - 1
    cached.generate(words(rng, vocab, 5), config("ar", max_new_tokens=1))
    assert pc.nbytes <= pc.max_bytes and 43 not in [e.length for e in pc.entries.values()]
    metrics = pc.metrics()
    assert "flashtree_prefix_cache_misses_total 3" in metrics and "flashtree_prefix_cache_entries" in metrics


def _chat_session(client, n_turns, cancel_turn=None):
    messages = [{"role": "system", "content": "You are a terse assistant. " * 20}]
    replies = []
    for turn in range(n_turns):
        messages.append({"role": "user", "content": f"question number {turn}: why is the sky blue?"})
        response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12})
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        replies.append((message.get("content"), message.get("reasoning_content")))
        messages.append({"role": "assistant", "content": message.get("content") or ""})
    return replies


class _CancelOnce:
    """Wraps engine.generate: the call numbered `which` is cancelled after a few steps, like a client
    that disconnects mid-answer."""

    def __init__(self, engine, which):
        self.engine, self.which, self.calls = engine, which, 0
        self.generate = engine.generate

    def __call__(self, prompt_ids, config, on_text=None, cancelled=None):
        self.calls += 1
        if self.calls == self.which:
            polls = iter(range(1000))
            return self.generate(prompt_ids, config, on_text, lambda: next(polls) >= 3)
        return self.generate(prompt_ids, config, on_text, cancelled)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_server_multi_turn_same_text_with_and_without_cache(target, draft, mode):
    plain, cached = engines(target, draft, mode)
    results = {}
    for name, engine in (("plain", plain), ("cached", cached)):
        engine.default_config = config(mode, ignore_eos=False)
        engine.generate = _CancelOnce(engine, which=3)
        with TestClient(build_app(engine, "tiny")) as client:
            results[name] = _chat_session(client, 6)
            metrics = client.get("/metrics").text
        if name == "cached":
            assert "flashtree_prefix_cache_hits_total 5" in metrics
            hit_tokens = next(x for x in metrics.splitlines() if x.startswith("flashtree_prefix_cache_hit_tokens"))
            assert int(hit_tokens.split()[-1]) > 5 * 60
        else:
            assert "prefix_cache" not in metrics
    assert results["cached"] == results["plain"]


def test_entries_restore_only_into_the_same_cache_layout(target):
    rng = random.Random(7)
    plain, cached = engines(target, None, "ar")
    prompt = words(rng, target.config.vocab_size, 20)
    cached.generate(prompt, config("ar", max_new_tokens=2))
    follow = prompt + [3, 4]
    assert cached.prefix_cache.lookup(follow, touch=False) is not None
    assert cached.prefix_cache.lookup(follow, touch=False, signature=("another layout",)) is None
    for entry in cached.prefix_cache.entries.values():  # as if made by a cache with other KV types
        entry.signature = ("another layout",)
    assert cached.generate(follow, config("ar")).token_ids == plain.generate(follow, config("ar")).token_ids
    assert cached.prefix_cache.stats.hits == 0


def test_serve_and_chat_flags(monkeypatch):
    import flashtree.engine.loader as loader
    from flashtree.serve.cli import engine_factory
    from tests.serve.test_cli import parse

    monkeypatch.setattr(loader, "load_engine", lambda settings: settings)
    settings = engine_factory(parse(["--prefix-cache-entries", "5", "--prefix-cache-gib", "0.5",
                                     "--prefix-cache-device-gib", "0.25"]))()
    assert (settings.prefix_cache, settings.prefix_cache_entries, settings.prefix_cache_bytes) == (True, 5, 1 << 29)
    assert settings.prefix_cache_device_bytes == 1 << 28
    assert not engine_factory(parse(["--no-prefix-cache"]))().prefix_cache
    from flashtree.cli.main import build_parser

    assert build_parser().parse_args(["chat"]).prefix_cache is True
    assert build_parser().parse_args(["chat", "--no-prefix-cache"]).prefix_cache is False
    assert build_parser().parse_args(["serve", "--no-prefix-cache"]).prefix_cache is False


def test_interval_snapshots_are_capped_per_prompt(target):
    rng = random.Random(10)
    _, cached = engines(target, None, "ar", interval=8, max_interval_snapshots=4, boundaries=0)
    cached.generate(words(rng, target.config.vocab_size, 150), config("ar", max_new_tokens=1, prefill_chunk=8))
    # 150 tokens / (8 x 4): snapshots every 40 tokens (a multiple of the interval), then the prompt end
    assert sorted(e.length for e in cached.prefix_cache.entries.values()) == [40, 80, 120, 150]
