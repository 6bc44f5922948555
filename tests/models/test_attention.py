"""Gated attention over a quantized cache: a prefill chunk after a long prefix attends to it in pieces merged by
their log-sum-exp (bounded dequantized scratch), and that equals attending to the whole prefix at once."""

import math

import pytest
import torch

from flashtree.kernels.kv_quant import kv_type
from flashtree.models.attention import GatedAttention, _query_normed_apart
from flashtree.models.cache import AttentionKV
from flashtree.models.layers import Linear
from flashtree.models.step import Step
from flashtree.models.synthetic import tiny_config

CAPACITY = 128
CHUNKS = (13, 9, 20, 16, 1, 30)  # prefill chunks (and one decode step) whose ends no piece boundary matches
PIECE = 7  # prefix rows per piece in the split layer


def _layers(num_heads, num_kv_heads, head_dim, dtype, piece_bytes, seed=0):
    """The same weights twice: one layer with the default scratch bound (every prefix here fits it, so it
    attends to the whole prefix at once), one whose bound holds `piece_bytes`."""
    c = tiny_config(head_dim=head_dim, rope_dim=16, num_heads=num_heads, num_kv_heads=num_kv_heads, hidden_size=64)
    g = torch.Generator().manual_seed(seed)

    def lin(o, i):
        return Linear((torch.randn(o, i, generator=g) / math.sqrt(i)).to(dtype))

    weights = (lin(2 * c.num_heads * head_dim, c.hidden_size), lin(c.num_kv_heads * head_dim, c.hidden_size),
               lin(c.num_kv_heads * head_dim, c.hidden_size), lin(c.hidden_size, c.num_heads * head_dim),
               torch.ones(head_dim), torch.ones(head_dim))
    return c, GatedAttention(c, *weights), GatedAttention(c, *weights, dequant_bytes=piece_bytes)


def _cache(c, k_type, v_type, window=0):
    tk, tv = kv_type(k_type), kv_type(v_type)
    return AttentionKV(tk.allocate(c.num_kv_heads, CAPACITY, c.head_dim, "cpu"),
                       tv.allocate(c.num_kv_heads, CAPACITY, c.head_dim, "cpu"), tk, tv, window)


def _piece_bytes(c, dtype, k_type, v_type):
    """The bound that lets PIECE rows of the sides that are dequantized (copied) through at a time."""
    sides = sum(kv_type(t).name != kv_type(dtype).name for t in (k_type, v_type))
    return PIECE * sides * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8


def _run(whole, split, c, cache_whole, cache_split, dtype, chunks=CHUNKS, window=0):
    """Both layers over the same chunks: [(whole output, split output)] per chunk."""
    g = torch.Generator().manual_seed(1)
    start, outs = 0, []
    for n in chunks:
        x = torch.randn(n, c.hidden_size, generator=g).to(dtype)
        step = Step.sequence(start, n, "cpu")
        outs.append((whole(x, step, cache_whole), split(x, step, cache_split)))
        start += n
    return outs


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("tq3_0", "tq3_0"), ("q4_0", "f16"), ("f16", "f32")])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (4, 4), (8, 1)])  # GQA groups of 3, none, 8
def test_prefix_in_pieces_equals_the_whole_prefix(k_type, v_type, num_heads, num_kv_heads):
    c, whole, split = _layers(num_heads, num_kv_heads, 128, torch.float32,
                              _piece_bytes(tiny_config(head_dim=128, num_heads=num_heads, num_kv_heads=num_kv_heads),
                                           torch.float32, k_type, v_type))
    outs = _run(whole, split, c, _cache(c, k_type, v_type), _cache(c, k_type, v_type), torch.float32)
    for i, (expected, got) in enumerate(outs):
        assert torch.allclose(got, expected, atol=2e-6, rtol=1e-5), (i, (got - expected).abs().max())
    # the pieces really ran after the first chunk: their float32 sums are rounded in another order
    assert torch.equal(outs[0][1], outs[0][0]) and not torch.equal(outs[-1][1], outs[-1][0])


def test_prefix_in_pieces_in_bf16():
    c, whole, split = _layers(6, 2, 128, torch.bfloat16, _piece_bytes(tiny_config(head_dim=128, num_heads=6),
                                                                      torch.bfloat16, "q8_0", "q8_0"))
    outs = _run(whole, split, c, _cache(c, "q8_0", "q8_0"), _cache(c, "q8_0", "q8_0"), torch.bfloat16)
    for expected, got in outs:
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_a_chunk_longer_than_a_piece_attends_to_its_own_rows_as_one_causal_piece():
    """A piece of 7 rows and chunks of 20-40: the chunk's own rows (causal) stay one piece, the prefix is cut."""
    c, whole, split = _layers(6, 2, 128, torch.float32, _piece_bytes(tiny_config(head_dim=128, num_heads=6),
                                                                     torch.float32, "q8_0", "q8_0"))
    outs = _run(whole, split, c, _cache(c, "q8_0", "q8_0"), _cache(c, "q8_0", "q8_0"), torch.float32,
                chunks=(20, 40, 33))
    for expected, got in outs:
        assert torch.allclose(got, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [8, 50])
def test_window_and_tree_steps_attend_to_their_rows_at_once(window):
    """A window bounds a chunk's rows itself (the masked path, not cut), and a tree verify keeps its mask:
    the split layer gives the very same numbers as the other."""
    c, whole, split = _layers(6, 2, 128, torch.float32, 1)
    a, b = _cache(c, "q8_0", "q8_0", window), _cache(c, "q8_0", "q8_0", window)
    for expected, got in _run(whole, split, c, a, b, torch.float32, window=window):
        assert torch.equal(got, expected)
    start = sum(CHUNKS)
    tree = Step.tree(start, torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]),
                     torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool))
    x = torch.randn(4, c.hidden_size, generator=torch.Generator().manual_seed(5))
    assert torch.equal(split(x, tree, b), whole(x, tree, a))


def test_a_float_cache_in_the_compute_dtype_is_read_whole():
    """Nothing is dequantized (copied) when the cache holds the compute dtype: the bound does not apply."""
    c, whole, split = _layers(6, 2, 128, torch.float32, 1)
    for expected, got in _run(whole, split, c, _cache(c, "f32", "f32"), _cache(c, "f32", "f32"), torch.float32):
        assert torch.equal(got, expected)


def test_a_float32_query_of_several_tokens_is_normed_apart_unless_asked_not_to(monkeypatch):
    """A verify's float32 query against bf16 operands takes its norm and RoPE in `qk_norm_rope`, stored as the
    operands (the fused 64-row tile spilled); a decode's one token, a bf16 model's own-dtype query, float16 operands
    (clamped to their range in the kernel) and FLASHTREE_QUERY_NORM_APART=0 keep the norm at the kernel's load."""
    monkeypatch.delenv("FLASHTREE_QUERY_NORM_APART", raising=False)
    assert _query_normed_apart(23, torch.float32, torch.bfloat16)
    assert _query_normed_apart(2, torch.float32, torch.bfloat16)
    assert not _query_normed_apart(23, torch.float32, torch.float16)
    assert not _query_normed_apart(1, torch.float32, torch.bfloat16)
    assert not _query_normed_apart(23, torch.bfloat16, torch.bfloat16)
    assert not _query_normed_apart(23, torch.float32, torch.float32)
    monkeypatch.setenv("FLASHTREE_QUERY_NORM_APART", "0")
    assert not _query_normed_apart(23, torch.float32, torch.bfloat16)
