"""What the prefix cache costs: a miss runs exactly the forwards (chunk starts and lengths) of an uncached
prefill, a hit runs forwards only over the tokens after the restored prefix, in the uncached chunks; snapshots
past the device budget move to host RAM, least recently used first, and restore from there."""

import random
from dataclasses import replace

import pytest
import torch

from flashtree.engine.config import GenerationConfig, prefill_chunk_ends
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.engine.planner import PlanRequest, plan, target_from_preset
from flashtree.engine.prefix_cache import PrefixCache
from flashtree.models.synthetic import tiny_config

CHUNK = 32


class ChunkLog:
    """Stands in for `runner.prefill_chunk` and records each forward as (first position, tokens)."""

    def __init__(self, runner):
        self.inner, self.calls = runner.prefill_chunk, []
        runner.prefill_chunk = self

    def __call__(self, cache, token_ids, *args, **kwargs):
        self.calls.append((cache.length, len(token_ids)))
        return self.inner(cache, token_ids, *args, **kwargs)

    def take(self) -> list[tuple[int, int]]:
        calls, self.calls = self.calls, []
        return calls


def engines(target, draft, mode, **cache_kwargs):
    """(without cache, with cache) engines sharing the weights, their chunk forwards logged."""
    d = draft if mode != "ar" else None
    plain, cached = Engine(target, d), Engine(target, d, prefix_cache=PrefixCache(**cache_kwargs))
    return plain, cached, ChunkLog(plain.runner), ChunkLog(cached.runner)


def config(mode, **kw):
    return GenerationConfig(**{"max_new_tokens": 12, "mode": mode, "ignore_eos": True, "prefill_chunk": CHUNK,
                               "budget": 8, **kw})


def prompt_with_headers(target, rng, n, header_positions):
    """Random tokens (never the message header) with the message header `<|im_start|>` at `header_positions`."""
    header = target.tokenizer.token_id("<|im_start|>")
    assert header is not None
    ids = [t for t in (rng.randrange(target.config.vocab_size) for _ in range(3 * n)) if t != header][:n]
    for pos in header_positions:
        ids[pos] = header
    return ids


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_a_miss_runs_exactly_the_uncached_forwards(target, draft, mode):
    """Interval points (40, 80, 120) fall inside 32-token chunks: the cache must not cut a chunk there, only
    snapshot at the chunk end below each. Every prefill, cached or not, ends a chunk before each message
    header (101, 137), so those are snapshots of their own."""
    plain, cached, plain_log, cached_log = engines(target, draft, mode, interval=40)
    prompt = prompt_with_headers(target, random.Random(1), 150, (101, 137))
    expected = plain.generate(prompt, config(mode))
    got = cached.generate(prompt, config(mode))
    assert cached.prefix_cache.stats.misses == 1
    assert cached_log.take() == plain_log.take() == [(0, 32), (32, 32), (64, 32), (96, 5), (101, 27), (128, 9),
                                                     (137, 13)]
    assert got.token_ids == expected.token_ids
    prompt_entries = sorted(e.length for e in cached.prefix_cache.entries.values() if e.length <= len(prompt))
    # 40 -> 32, 80 -> 64, 101 and 120 -> 101, 137, and the prompt end
    assert prompt_entries == [32, 64, 101, 137, 150]


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_a_hit_runs_forwards_only_over_the_new_tokens(target, draft, mode):
    rng = random.Random(2)
    plain, cached, plain_log, cached_log = engines(target, draft, mode, interval=40)
    prompt = prompt_with_headers(target, rng, 150, (101, 137))
    first = cached.generate(prompt, config(mode))
    cached_log.take()

    # another question after the shared start: restores at the last shared message header (137), then runs the
    # uncached chunks from there
    other = prompt[:140] + prompt_with_headers(target, rng, 20, ())
    got = cached.generate(other, config(mode))
    assert cached.prefix_cache.last_request.restored_tokens == 137
    assert got.token_ids == plain.generate(other, config(mode)).token_ids
    assert cached_log.take() == [call for call in plain_log.take() if call[0] >= 137] == [(137, 23)]

    if mode == "ar":  # AR requests also store their answer's end, which is not a chunk end
        follow = prompt + first.token_ids + prompt_with_headers(target, rng, 9, ())
        got = cached.generate(follow, config(mode))
        restored = cached.prefix_cache.last_request.restored_tokens
        assert restored == len(prompt) + len(first.token_ids) - 1
        assert got.token_ids == plain.generate(follow, config(mode)).token_ids
        calls, uncached = cached_log.take(), plain_log.take()
        assert calls[0][0] == restored and sum(n for _, n in calls) == len(follow) - restored
        # past the first chunk boundary above the restored length, the very chunks of the uncached prefill
        assert {start + n for start, n in calls} <= {start + n for start, n in uncached}


def test_snapshots_spill_to_host_least_recently_used_first(target):
    rng = random.Random(3)
    plain, cached, _, _ = engines(target, None, "ar", interval=40)
    pc = cached.prefix_cache
    conversation = prompt_with_headers(target, rng, 70, ())
    cached.generate(conversation, config("ar"))
    pc.device_bytes = 2 * pc.nbytes  # room for the newest entries, not for all
    for turn in range(4):
        got = cached.generate(conversation, config("ar"))
        assert got.token_ids == plain.generate(conversation, config("ar")).token_ids, f"turn {turn}"
        conversation = conversation + got.token_ids + prompt_with_headers(target, rng, 7, ())
    assert pc.stats.hits == 4 and pc.stats.spilled_bytes > 0
    assert pc.device_nbytes <= pc.device_bytes < pc.nbytes
    # least recently used first: every group still on the device was used after every spilled one
    placement = [group.on_device for group in pc._copies()]
    assert placement == sorted(placement) and placement[-1] and not placement[0]
    newest = next(reversed(pc.entries.values()))
    assert newest.state.on_device


def test_a_zero_device_budget_keeps_everything_in_host_ram(target, draft):
    rng = random.Random(4)
    plain, cached, _, _ = engines(target, draft, "ddtree", interval=40, device_bytes=0)
    pc = cached.prefix_cache
    conversation = prompt_with_headers(target, rng, 90, ())
    for turn in range(3):
        got = cached.generate(conversation, config("ddtree"))
        assert got.token_ids == plain.generate(conversation, config("ddtree")).token_ids, f"turn {turn}"
        assert pc.last_request.spilled_bytes > 0
        conversation = conversation + got.token_ids + prompt_with_headers(target, rng, 7, ())
    assert pc.stats.hits == 2 and pc.device_nbytes == 0 and pc.stats.spilled_bytes >= pc.nbytes > 0
    assert "flashtree_prefix_cache_device_bytes 0" in pc.metrics()


def test_request_stats_count_the_copies(target):
    rng = random.Random(5)
    _, cached, _, _ = engines(target, None, "ar", interval=1 << 20)
    pc = cached.prefix_cache
    prompt = prompt_with_headers(target, rng, 40, ())
    cached.generate(prompt, config("ar"))
    miss = pc.last_request
    assert (miss.restored_tokens, miss.restored_bytes, miss.snapshots) == (0, 0, 2)  # the prompt end, the answer end
    assert miss.snapshot_bytes == pc.nbytes and miss.copied_bytes == pc.nbytes
    cached.generate(prompt + [1, 2, 3], config("ar"))
    hit = pc.last_request
    entry = pc.lookup(prompt + [1, 2, 3], touch=False)
    assert hit.restored_tokens == entry.length == len(prompt)
    rows_restored = sum(t.narrow(entry.rows.dims[key], 0, len(prompt)).numel() * t.element_size()
                        for key, t in entry.rows.copies.tensors.items())
    assert hit.restored_bytes == rows_restored + entry.state.nbytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_spill_is_pinned_and_restore_does_not_sync(make_gguf):
    target = load_target(make_gguf("spec", config=tiny_config(num_layers=4, gdn_v_heads=4)), device="cuda",
                         dtype=torch.float32)
    plain, cached, _, _ = engines(target, None, "ar", interval=40, device_bytes=0)
    rng = random.Random(6)
    prompt = prompt_with_headers(target, rng, 70, ())
    cached.generate(prompt, config("ar"))
    entry = next(reversed(cached.prefix_cache.entries.values()))
    assert all(t.device.type == "cpu" and t.is_pinned() for group in entry.copies() for t in group.tensors.values())
    follow = prompt + prompt_with_headers(target, rng, 5, ())
    hit = cached.prefix_cache.lookup(follow)
    cache = cached.runner.new_cache(len(follow), config("ar"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation inside the restore raises
    try:
        cached.prefix_cache._restore(hit, cache, None, cached.prefix_cache.last_request)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cached.generate(follow, config("ar")).token_ids == plain.generate(follow, config("ar")).token_ids


def test_the_plan_counts_the_device_budget():
    config, weights, embed, dense, draft, layers = target_from_preset("qwen3.6-27b")
    request = PlanRequest(config, weights, embed, draft, 8192, dense_params=dense, layer_bytes=layers)
    budget = 3 << 30
    with_cache = plan(replace(request, prefix_cache_device_bytes=budget))
    assert with_cache.total == plan(request).total + budget
    assert with_cache.bytes_of("prefix cache snapshots") == budget


def test_chunks_end_at_multiples_and_before_message_headers_whatever_the_start():
    """A chunk end depends only on its position and the token there: a prefill resumed at any chunk end
    runs the very chunks of an unbroken one (the bits the prefix cache relies on)."""
    header = 7
    tokens = [header, 1, 2, header, 3, 4, 5, 6, 7 - 1, header, 8, 9]  # headers at 0, 3, 9
    whole = prefill_chunk_ends(0, tokens, 4, {header})
    assert whole == [3, 4, 8, 9, 12]  # no cut before position 0: a chunk is never empty
    for start in whole[:-1]:
        assert prefill_chunk_ends(start, tokens[start:], 4, {header}) == [e for e in whole if e > start]
    assert prefill_chunk_ends(0, tokens, 4) == [4, 8, 12]  # no header ids: multiples and the end only
