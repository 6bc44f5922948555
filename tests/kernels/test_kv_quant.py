"""KV cache storage types: byte layout, round-trip error, TQ3_0 rotated-domain attention."""

import math

import pytest
import torch

from flashtree.models.cache import AttentionKV
from flashtree.errors import FlashtreeError
from flashtree.kernels.kv_quant import KV_TYPES, TQ3_LEVELS, FloatKV, kv_type, rotate, unrotate
from flashtree.models.attention import GatedAttention
from flashtree.models.layers import Linear
from flashtree.models.step import Step
from flashtree.models.synthetic import tiny_config

# relative RMS error bound of a round trip of Gaussian rows; bytes per 256-value row
EXPECTED = {"f32": (0.0, 1024), "f16": (1e-3, 512), "bf16": (5e-3, 512), "q8_0": (0.01, 272),
            "q4_0": (0.12, 144), "tq3_0": (0.26, 112)}


def _rows(seed=0, shape=(3, 50, 256)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 4


def _roundtrip(t, x):
    y = t.dequantize(t.quantize(x))
    return unrotate(y) if t.rotated else y


@pytest.mark.parametrize("name", list(KV_TYPES))
def test_round_trip_within_expected_error(name):
    t = kv_type(name)
    x = _rows()
    stored = t.quantize(x)
    assert stored.shape[:-1] == x.shape[:-1] and stored.shape[-1] * stored.element_size() == EXPECTED[name][1]
    assert t.row_bytes(256) == EXPECTED[name][1]
    rel = (_roundtrip(t, x) - x).norm(dim=-1) / x.norm(dim=-1)
    assert rel.max().item() <= EXPECTED[name][0]
    if name == "tq3_0":  # ~ the 8-level Lloyd-Max error on a rotated (near-Gaussian) unit vector, sqrt(0.0345)
        assert 0.15 < rel.mean().item() < 0.21


def test_bits_per_value():
    assert {n: t.bits_per_value() for n, t in KV_TYPES.items()} == {
        "f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q4_0": 4.5, "tq3_0": 3.5}


def test_q8_0_and_q4_0_match_the_block_formulas():
    x = _rows(1, (4, 32))
    q8 = KV_TYPES["q8_0"].quantize(x)
    d = x.abs().amax(-1) / 127
    assert torch.allclose(q8[:, :2].contiguous().view(torch.float16).squeeze(-1).float(), d, rtol=1e-3)
    assert torch.equal(q8[:, 2:].view(torch.int8).float(), torch.round(x / d[:, None]))
    q4 = KV_TYPES["q4_0"].quantize(x)
    y = KV_TYPES["q4_0"].dequantize(q4)
    big = x.gather(1, x.abs().argmax(1, keepdim=True))
    assert torch.allclose(y.gather(1, x.abs().argmax(1, keepdim=True)), big, rtol=2e-3)  # max value exact (-8 d)
    nib = torch.cat([q4[:, 2:] & 15, q4[:, 2:] >> 4], 1)  # byte j = q[j] | q[j + 16] << 4
    assert nib.max() <= 15 and torch.allclose((nib.float() - 8) * (big / -8), y, rtol=1e-3, atol=1e-6)


def test_tq3_0_layout_and_codebook():
    t = KV_TYPES["tq3_0"]
    x = _rows(2, (5, 256))
    stored = t.quantize(x).reshape(5, 8, 14)  # 2 groups x 4 blocks of 14 bytes
    norms = stored[..., :2].contiguous().view(torch.float16).squeeze(-1).reshape(5, 2, 4)
    assert torch.equal(norms, norms[..., :1].expand(-1, -1, 4))  # one norm repeated in the group's 4 blocks
    index, norm = t.codes(x)
    assert index.min() >= 0 and index.max() <= 7
    levels = torch.tensor(TQ3_LEVELS)
    centroids = torch.cat([levels, -levels])[index]
    # the stored norm rescales the codeword to the input's norm
    assert torch.allclose((centroids * norm[..., None]).norm(dim=-1), x.reshape(5, 2, 128).norm(dim=-1), rtol=1e-3)
    # bit layout: low 2 bits of element j at bits 2(j%4) of qs byte j/4, high bit at bit j%8 of signs byte j/8
    blocks = index.reshape(5, 8, 32)
    j = torch.arange(32)
    low = (stored[..., 2 + j // 4] >> (2 * (j % 4))) & 3
    hi = (stored[..., 10 + j // 8] >> (j % 8)) & 1
    assert torch.equal(low.long() | (hi.long() << 2), blocks)
    # nearest centroid in the rotated domain
    u = rotate(x / x.reshape(5, 2, 128).norm(dim=-1).repeat_interleave(128, -1))
    nearest = (u.reshape(5, 2, 128, 1) - torch.cat([levels, -levels])).abs().argmin(-1)
    assert (nearest == index).float().mean() > 0.999


def test_rotation_is_orthogonal_per_group():
    x = _rows(3, (7, 256)).double().float()
    assert torch.allclose(unrotate(rotate(x)), x, atol=1e-5)
    assert torch.allclose(rotate(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    q, k = _rows(4, (9, 256)), _rows(5, (11, 256))
    assert torch.allclose(rotate(q) @ rotate(k).T, q @ k.T, atol=1e-3)


def test_zero_rows_stay_zero():
    for t in KV_TYPES.values():
        assert torch.count_nonzero(_roundtrip(t, torch.zeros(2, 256))) == 0


def test_unknown_type_names_the_choices():
    with pytest.raises(FlashtreeError, match="f32, f16, bf16, q8_0, q4_0, tq3_0"):
        kv_type("q5_k")
    assert kv_type("Q8_0") is KV_TYPES["q8_0"] and kv_type(torch.bfloat16) is KV_TYPES["bf16"]
    with pytest.raises(FlashtreeError, match="multiple of 128"):
        KV_TYPES["tq3_0"].allocate(2, 8, 64, "cpu")


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "tq3_0"])
def test_commit_style_row_moves_work_on_quantized_rows(name):
    t = kv_type(name)
    store = t.allocate(2, 16, 256, "cpu")
    x = _rows(6, (2, 10, 256))
    store[:, 4:14] = t.quantize(x)
    path = torch.tensor([0, 3, 7])
    store[:, 4:7] = store[:, 4 + path]
    assert torch.equal(t.dequantize(store[:, 4:7]), t.dequantize(t.quantize(x[:, path])))


class _DequantizedTQ3(FloatKV):
    """Stores TQ3_0's round trip as plain f32: attention over the dequantized (un-rotated) cache."""

    def __init__(self):
        super().__init__("tq3_0-dequantized", torch.float32)

    def quantize(self, x):
        t = KV_TYPES["tq3_0"]
        return unrotate(t.dequantize(t.quantize(x)))


def _attention_layer(seed=0):
    c = tiny_config(head_dim=256, rope_dim=64, num_heads=4, num_kv_heads=2, hidden_size=64)
    g = torch.Generator().manual_seed(seed)

    def lin(o, i):
        return Linear(torch.randn(o, i, generator=g) / math.sqrt(i))

    return c, GatedAttention(c, lin(2 * c.num_heads * c.head_dim, c.hidden_size), lin(c.num_kv_heads * c.head_dim, c.hidden_size),
                             lin(c.num_kv_heads * c.head_dim, c.hidden_size), lin(c.hidden_size, c.num_heads * c.head_dim),
                             torch.ones(c.head_dim), torch.ones(c.head_dim))


@pytest.mark.parametrize("k_type,v_type", [("tq3_0", "tq3_0"), ("tq3_0", "f32"), ("f32", "tq3_0"), ("tq3_0", "q8_0")])
def test_tq3_attention_in_the_rotated_domain_equals_attention_over_the_dequantized_cache(k_type, v_type):
    c, attn = _attention_layer()
    dq = _DequantizedTQ3()
    ref_k, ref_v = (dq if k_type == "tq3_0" else kv_type(k_type)), (dq if v_type == "tq3_0" else kv_type(v_type))
    kv = AttentionKV(kv_type(k_type).allocate(2, 64, 256, "cpu"), kv_type(v_type).allocate(2, 64, 256, "cpu"),
                     kv_type(k_type), kv_type(v_type))
    ref = AttentionKV(ref_k.allocate(2, 64, 256, "cpu"), ref_v.allocate(2, 64, 256, "cpu"), ref_k, ref_v)
    g = torch.Generator().manual_seed(1)
    start = 0
    for n in (13, 1, 5):  # prefill, a decode step, a chunk
        x = torch.randn(n, c.hidden_size, generator=g)
        step = Step.sequence(start, n, "cpu")
        out, expected = attn(x, step, kv), attn(x, step, ref)
        assert torch.allclose(out, expected, atol=1e-4, rtol=1e-4), (out - expected).abs().max()
        start += n
    # and a tree step over that cache (scratch rows past the committed end)
    parents = torch.tensor([-1, 0, 0, 1])
    depths = torch.tensor([0, 1, 1, 2])
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    step = Step.tree(start, parents, depths, anc)
    x = torch.randn(4, c.hidden_size, generator=g)
    assert torch.allclose(attn(x, step, kv), attn(x, step, ref), atol=1e-4, rtol=1e-4)


def test_window_hides_old_keys_exactly():
    c, attn = _attention_layer(2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, c.hidden_size, generator=g)
    full = AttentionKV(torch.zeros(2, 64, 256), torch.zeros(2, 64, 256))
    windowed = AttentionKV(torch.zeros(2, 64, 256), torch.zeros(2, 64, 256), window=8)
    out_full = attn(x, Step.sequence(0, 40, "cpu"), full)
    out_win = attn(x, Step.sequence(0, 40, "cpu"), windowed)
    assert torch.allclose(out_full[:8], out_win[:8], atol=1e-5)  # the window is not yet active
    assert not torch.allclose(out_full[8:], out_win[8:], atol=1e-3)
    # query 30 alone over keys 23..30 = the same query after a cache of 30 rows
    tail = AttentionKV(torch.zeros(2, 64, 256), torch.zeros(2, 64, 256), window=8)
    attn(x[:30], Step.sequence(0, 30, "cpu"), tail)
    assert torch.allclose(attn(x[30:31], Step.sequence(30, 1, "cpu"), tail), out_win[30:31], atol=1e-5)
