"""The fragment-ordered Q4_K/Q6_K layout and its CUDA kernels (kernels/quant_matmul/mma.py, mma.cu).

On the CPU: the layout round-trips the GGUF bytes exactly, the kernels' decoding (emulated bit for bit
in torch) gives the float32 dequantization, and NVRTC compiles the CUDA source for sm_90 (where
cuda-python and NVRTC are installed). On a GPU: every row count and launch configuration against the
float32 reference, bit-identical rows whatever M, CUDA-graph capture, the dense dequantization.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.formats import quants
from flashtree.kernels.quant_matmul import (DENSE_BLOCK_BYTES, DENSE_MIN_M, QuantWeight, dense_block_rows, mma,
                                            quant_matmul, quant_matmul_reference, quant_matmul_rounded,
                                            random_quant_weight, x_f16_type)

TYPES = [QType.Q4_K, QType.Q6_K]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _random_rows(qtype: QType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF bytes with random quants and scales and small finite fp16 d (and dmin)."""
    block, size = GGML_QUANT_SIZES[qtype]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // block, size), generator=gen, dtype=torch.uint8)
    d = (torch.rand(blocks.shape[0], 2, generator=gen) * 0.02 + 1e-3).half().view(torch.uint8)
    if qtype == QType.Q4_K:
        blocks[:, 0:4] = d.reshape(-1, 4)
    else:
        blocks[:, 208:210] = d[:, 0:2]
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("shape", [(16, 256), (48, 768), (4096 + 32, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layout_round_trips_the_gguf_bytes(qtype, shape):
    rows = _random_rows(qtype, *shape)
    raw = mma.to_mma_layout(rows, qtype, *shape)
    assert raw.numel() == rows.numel()
    assert not torch.equal(raw, rows.reshape(-1))  # it did rearrange
    assert torch.equal(mma.from_mma_layout(raw, qtype, *shape), rows)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_decoding_gives_the_dequantized_weights(qtype):
    n, k = 48, 768
    rows = _random_rows(qtype, n, k, seed=1)
    ref = quants.dequantize(rows.reshape(-1), qtype, (n, k), torch.float32)
    emulated = mma.dequantize_emulated(mma.to_mma_layout(rows, qtype, n, k), qtype, n, k)
    # Q4_K: a * (128 + q) - (128 a + dmin * mn) rounds once more than a * q - dmin * mn
    assert torch.allclose(emulated, ref, rtol=0, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_tile_aligned_row_range_is_a_weight_of_its_own(qtype):
    """`row_pieces` (prefill's dense weight dequantized in row blocks, `quant_matmul.DENSE_BLOCK_BYTES`): the rows
    [16, 48) of a fragment-ordered weight decode as those rows of the whole; ranges across a tile are refused."""
    n, k = 64, 512
    raw = mma.to_mma_layout(_random_rows(qtype, n, k, seed=3), qtype, n, k)
    whole = mma.dequantize_emulated(raw, qtype, n, k)
    assert torch.equal(mma._decode_emulated(mma.row_pieces(raw, qtype, n, k, 16, 32), qtype, 32, k), whole[16:48])
    for start, count in ((8, 16), (16, 40), (48, 32)):
        with pytest.raises(FlashtreeError, match="whole tiles"):
            mma.row_pieces(raw, qtype, n, k, start, count)


def test_prefill_dequantizes_a_big_weight_in_row_blocks():
    # the 27B's fused gate/up (34816 x 5120, 356 MB in float16) in blocks of at most 64 MiB, whole tiles; a small
    # weight at once
    rows = dense_block_rows(34816, 5120)
    assert rows % 16 == 0 and rows * 5120 * 2 <= DENSE_BLOCK_BYTES < (rows + 16) * 5120 * 2
    assert dense_block_rows(1024, 5120) == 1024 and dense_block_rows(5120, 17408) == 1920


def test_shapes_without_a_layout_are_refused():
    assert not mma.supports(QType.Q4_K, (24, 256)) and not mma.supports(QType.Q8_0, (32, 256))
    with pytest.raises(FlashtreeError, match="N % 16"):
        mma.to_mma_layout(torch.zeros(24 * 144, dtype=torch.uint8), QType.Q4_K, 24, 256)


def test_cpu_weights_keep_the_gguf_field_layout():
    w = QuantWeight.from_gguf_bytes(_random_rows(QType.Q4_K, 32, 256).reshape(-1), QType.Q4_K, (32, 256))
    assert not w.mma_layout and "qs" in w.fields()


def test_warps_and_splits_do_not_depend_on_the_row_count():
    """Where a CTA's warps split K, they and the splits fix a row's summation order, so that rows of a class of row
    counts round the same whatever the other rows. One matrix has a class of its own: the Q6_K LM head at 17-24
    rows runs on 4 warps, not 2 (its chains differ there anyway). Warps that own tiles each sum all of K, whatever
    their count: on a wide Q4_K matrix (17408 x 5120) qmh at 9-32 rows runs one CTA an SM, 9 warps of a tile each;
    on the narrow ones (5120 x 17408) one split of K over a cluster at 9-32 rows."""
    for qtype in TYPES:
        for n, k in [(17408, 5120), (5120, 17408), (1024, 5120), (248320, 5120)]:
            configs = {m: mma.choose_config(qtype, m, n, k) for m in range(1, 33)}
            if qtype == QType.Q6_K and n == 248320:
                assert {(configs[m].warps, configs[m].chains) for m in range(17, 25)} == {(4, 1)}
                configs = {m: c for m, c in configs.items() if not 17 <= m <= 24}
            if qtype == QType.Q4_K and n == 17408:
                assert {configs[m] for m in range(9, 33)} == {mma.MMAConfig(1, 9, 1, 2, own_tiles=2, ring=4)}
            cluster = {m: c for m, c in configs.items() if c.cluster_splits}
            assert len(set(cluster.values())) <= 1 and set(cluster) <= set(range(9, 33)), (qtype, n, k)
            configs = {m: c for m, c in configs.items() if m not in cluster}
            splitting_k = {(c.warps, c.splits) for c in configs.values() if not c.own_tiles}
            assert len(splitting_k) == 1, (qtype, n, k)
            assert {c.splits for c in configs.values()} == {splitting_k.pop()[1]}, (qtype, n, k)


def test_configurations_follow_the_sweep(monkeypatch):
    """The H200 sweeps' choices (docs/PERFORMANCE.md): the LM head on 2 warps, small matrices split K, Q4_K's
    one-row kernel on two accumulator chains, Q6_K's bf16 kernel pairs row tiles from 17 rows, Q4_K's bf16
    kernel at 9-16 and 25-32; Q4_K's float16 kernel at 17-32 rows runs 3 CTAs per SM, its warps owning a tile
    each (x shared in shared memory) where the matrix has a 64-row group per SM, else x a sub-block ahead (one
    chain at 25-32 rows); on the wide Q4_K matrices (at least 5 row tiles per SM) from 9 rows two tiles a warp,
    the weights through a shared-memory ring, at the CTAs per SM whose waves are fullest."""
    assert mma.choose_config(QType.Q6_K, 1, 248320, 5120) == mma.MMAConfig(1, 2, 1)
    assert mma.choose_config(QType.Q6_K, 23, 248320, 5120, kernel="qmm") == mma.MMAConfig(2, 2, 1)
    assert mma.choose_config(QType.Q4_K, 1, 5120, 17408) == mma.MMAConfig(1, 4, 1, chains=2)
    assert mma.choose_config(QType.Q4_K, 1, 1024, 5120) == mma.MMAConfig(1, 4, 4, chains=2)
    assert mma.choose_config(QType.Q4_K, 32, 1024, 5120).rt == 1  # too few tiles to pair
    assert [mma.choose_config(QType.Q4_K, m, 10240, 5120) for m in (8, 16, 23, 32)] == [
        mma.MMAConfig(1, 4, 1, 2), mma.MMAConfig(1, 4, 1, 2), mma.MMAConfig(1, 4, 1, 2, min_blocks=3, own_tiles=2),
        mma.MMAConfig(1, 4, 1, 2, min_blocks=3, own_tiles=2)]
    # the wide matrices (at least 5 row tiles an SM) at 9-32 rows with 8-20 warps an SM: one CTA an SM, a tile a warp,
    # x staged once a super-block: the fused gate + up (2176 tiles: 17 warps, 96 registers, one chain), a DeltaNet
    # layer's qkv + z + beta + alpha (1030: 8, its 129th CTA 6 tiles), an unfused gate or up (1088: 9); the ring
    # deep enough for ~64 KB of weights in flight an SM; at 25-32 rows the fused gate + up's x staged by an 18th warp
    # (own_tiles 4) and its weights through 2 stages
    monkeypatch.delenv("FLASHTREE_QMH_X_PRODUCER", raising=False)
    for n, warps, chains, depth in ((34816, 17, 1, 3), (16480, 8, 2, 4), (17408, 9, 2, 4)):
        one_cta = mma.MMAConfig(1, warps, 1, chains, own_tiles=2, ring=depth)
        produced = mma.MMAConfig(1, warps, 1, chains, own_tiles=4, ring=2) if n == 34816 else one_cta
        assert [mma.choose_config(QType.Q4_K, m, n, 5120) for m in (8, 9, 16, 23, 24, 25, 32)] == [
            mma.MMAConfig(1, 4, 1, 2), one_cta, one_cta, one_cta, one_cta, produced, produced], n
        assert one_cta.row_groups(n) == 128 + (n == 16480) - 7 * (n == 17408)
    monkeypatch.setenv("FLASHTREE_QMH_X_PRODUCER", "0")
    assert mma.choose_config(QType.Q4_K, 32, 34816, 5120) == mma.MMAConfig(1, 17, 1, 1, own_tiles=2, ring=3)
    monkeypatch.setenv("FLASHTREE_QMH_X_PRODUCER", "1")
    assert mma.choose_config(QType.Q4_K, 23, 16480, 5120) == mma.MMAConfig(1, 8, 1, 2, own_tiles=4, ring=4)
    monkeypatch.delenv("FLASHTREE_QMH_X_PRODUCER")
    # q + gate (768 tiles: 6 warps an SM, too few) keeps two tiles a warp through the weight ring (384 CTAs)
    assert [mma.choose_config(QType.Q4_K, m, 12288, 5120) for m in (9, 23, 32)] == [
        mma.MMAConfig(2, 4, 1, 1, min_blocks=3, ring=2)] * 3
    assert mma.MMAConfig(1, 17, 1, 1, own_tiles=2, ring=3).ring_bytes(QType.Q4_K) + mma._shared_x_bytes(3) <= 227 * 1024
    # Q6_K's LM head at 17-24 rows (the verify's) through the weight ring, its down projection not; at 9-16 rows with x
    # resident in shared memory
    assert [mma.choose_config(QType.Q6_K, m, 248320, 5120) for m in (8, 16, 23, 32)] == [
        mma.MMAConfig(1, 2, 1, 2), mma._RESIDENT_X_HEAD, mma.MMAConfig(2, 4, 1, 1, min_blocks=3, ring=2),
        mma.MMAConfig(1, 2, 1, 2)]
    assert mma.choose_config(QType.Q6_K, 23, 5120, 17408) == mma.MMAConfig(1, 4, 1, 1, min_blocks=3, x_ahead=1)
    # the FFN down projection: too few 64-row groups to own tiles
    assert [mma.choose_config(QType.Q4_K, m, 5120, 17408) for m in (16, 23, 32)] == [
        mma.MMAConfig(1, 4, 1, 2), mma.MMAConfig(1, 4, 1, 2, min_blocks=3, x_ahead=1),
        mma.MMAConfig(1, 4, 1, 1, min_blocks=3, x_ahead=1)]
    assert [mma.kernel_for(QType.Q4_K, 3, n, k) for n, k in ((17408, 5120), (1024, 5120))] == ["qmh", "qmm"]
    # the bf16 kernel's own choice on the same matrix (what the sweeps compare qmh with)
    assert [mma.choose_config(QType.Q4_K, m, 17408, 5120, kernel="qmm").rt for m in (8, 16, 23, 32)] == [1, 2, 1, 2]
    assert [mma.choose_config(QType.Q4_K, m, 4096, 1024).rt for m in (8, 16, 23, 32)] == [1, 2, 1, 2]
    assert [mma.choose_config(QType.Q6_K, m, 17408, 5120, kernel="qmm").rt for m in (8, 16, 23, 32)] == [1, 1, 2, 2]


Q6_K_SHAPES = [(5120, 17408), (17408, 5120), (1024, 5120), (248320, 5120)]  # FFN down, a gate/up size, V, LM head


def test_q6_k_takes_the_float16_kernel_where_q4_k_does():
    """2-32 rows of a Q6_K matrix of 8M+ weights go to qmh, smaller ones (attention V) to qmm, one row to qmv;
    the same rule as Q4_K's."""
    for n, k in Q6_K_SHAPES:
        expect = "qmh" if n * k >= mma.QMH_MIN_WEIGHTS else "qmm"
        for qtype in TYPES:
            assert [mma.kernel_for(qtype, tg, n, k) for tg in (1, 2, 3, 4)] == [expect] * 4, (qtype, n, k)
            assert mma.kernel_for(qtype, mma.token_groups(1), n, k) == "qmv"
    assert mma.kernel_for(QType.Q6_K, 3, 1024, 5120) == "qmm" and mma.kernel_for(QType.Q6_K, 3, 5120, 17408) == "qmh"


def test_q6_k_float16_kernel_has_two_classes_of_row_counts():
    """Each class gives a row the same bits whatever the other rows. On 4-warp matrices (the FFN down projections,
    attention V when qmh is asked for it): one tile and two chains at 2-16 rows, one tile and one chain at 17-32
    (3 CTAs per SM, x a sub-block ahead). On the LM head (2 warps): 16 warps walking whole
    tiles over x resident in shared memory at 9-16 rows, 4 warps splitting K and one chain at 17-24 rows (two tiles
    a warp through a weight ring), one tile and two chains elsewhere."""
    for n, k in Q6_K_SHAPES:
        head = n == 248320
        warps = 2 if head else 4
        classes = {m: mma.choose_config(QType.Q6_K, m, n, k, kernel="qmh") for m in range(2, 33)}
        splits = classes[2].splits
        if head:
            assert {classes[m] for m in range(9, 17)} == {mma._RESIDENT_X_HEAD}
            assert {classes[m] for m in range(17, 25)} == {mma.MMAConfig(2, 4, splits, 1, min_blocks=3, ring=2)}
            assert {classes[m] for m in (*range(2, 9), *range(25, 33))} == {mma.MMAConfig(1, warps, splits, 2)}
        else:
            wide = mma.MMAConfig(1, warps, splits, 1, min_blocks=3, x_ahead=1)
            assert {classes[m] for m in range(17, 33)} == {wide}, (n, k)
            assert {classes[m] for m in range(2, 17)} == {mma.MMAConfig(1, warps, splits, 2)}, (n, k)


def test_load_time_compile_plans_the_q6_k_float16_kernel_and_its_x_conversion():
    jobs = dict(mma.instances_for({(QType.Q6_K, 5120, 17408)}, 132))
    assert "prep_x_f16_q6_k" in jobs and "prep_x_f16" not in jobs
    assert sorted(name for name in jobs if name.startswith("qmh")) == [
        "qmh_q6_k_r1_t1_w4_s1_c2", "qmh_q6_k_r1_t2_w4_s1_c2", "qmh_q6_k_r1_t3_w4_s1_c1_b3_x1",
        "qmh_q6_k_r1_t4_w4_s1_c1_b3_x1"]
    assert ("qmh<Q6_K, 1, 3, 4, 1, 1, 1, 0, 0, 0, 0>(xh, nullptr, scale, q, h, s, d,"
            in jobs["qmh_q6_k_r1_t3_w4_s1_c1_b3_x1"])
    assert "prep_x<Q6_K>(x, xh, nullptr, scale, K)" in jobs["prep_x_f16_q6_k"]
    small = [name for name, _ in mma.instances_for({(QType.Q6_K, 1024, 5120)}, 132)]
    assert not any(name.startswith(("qmh", "prep_x")) for name in small)


def _q6_k_rows(q: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF Q6_K bytes [N, row bytes] of quants q [N, K] (0..63), int8 scales [N, K/16] and float16 d [N, K/256]."""
    n, k = q.shape
    rows = mma._pack_q6_k(q.to(torch.uint8), scales.to(torch.int8).view(torch.uint8).reshape(n, k // 256, 16),
                          d.to(torch.float16).view(torch.uint8).reshape(n, k // 256, 2), n, k)
    return rows.reshape(n, -1)


def _exact_q6_k(rows: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """d sc (q - 32) in float64: every Q6_K value exactly."""
    q, scales, d = mma._unpack_q6_k(rows.reshape(-1, 210), n, k)
    sc = scales.view(torch.int8).double().reshape(n, k // 16).repeat_interleave(16, dim=1)
    d = d.contiguous().view(torch.float16).double().reshape(n, k // 256).repeat_interleave(256, dim=1)
    return (q.double() - 32) * sc * d


def test_float16_q6_k_fragments_hold_every_value_exactly():
    """What Q6_K's float16 kernel (qmh) rests on, emulated bit for bit from the fragment layout: every quant
    (0..63) with every int8 scale, in rows g and g + 8 (their own constants), in even and odd MMA steps (the top
    bits' shifts) and at every position of a sub-block (A register and half), splits into two float16 values whose
    sum times 4 d or d / 4 is the value exactly. Row 16 i + 8 h + r (r < 8) of the matrix takes scale 8 i + r - 128
    in every sub-block; value l of sub-block 2c + o takes q = 16 (c % 4) + (l + c // 4) % 16."""
    n, k = 512, 2048
    row, sub, value = torch.arange(n)[:, None], torch.arange(k // 16)[None, :], torch.arange(k)[None, :]
    scales = ((row % 8) + 8 * (row // 16) - 128).expand(n, k // 16)
    q = (16 * ((value // 32) % 4) + (value % 16 + value // 128) % 16).expand(n, k)
    d = torch.rand(n, k // 256, generator=torch.Generator().manual_seed(3)) * 0.02 + 1e-3
    rows = _q6_k_rows(q, scales, d)
    assert set(scales.unique().tolist()) == set(range(-128, 128))
    assert all(set(q[0, l::16].tolist()) == set(range(64)) for l in range(16))  # every quant at every position
    half = mma.dequantize_half_emulated(mma.to_mma_layout(rows, QType.Q6_K, n, k), n, k)
    assert torch.equal(half, _exact_q6_k(rows, n, k))


def test_float16_q6_k_fragments_of_random_blocks_are_exact():
    n, k = 96, 4096
    rows = _random_rows(QType.Q6_K, n, k, seed=5)
    half = mma.dequantize_half_emulated(mma.to_mma_layout(rows, QType.Q6_K, n, k), n, k)
    assert torch.equal(half, _exact_q6_k(rows, n, k))


def test_a_scaled_q6_k_weight_needs_two_float16_values():
    """Why qmh gives Q6_K two MMAs per 16 values: (q - 32) sc can need 12 significant bits, float16 holds 11; its
    two parts ql sc and 16 (qt - 2) sc (ql the low nibble, qt the top 2 bits), at the scalings the kernel uses,
    are exact, and so are the constants its fused multiply-adds subtract."""
    q = torch.arange(64, dtype=torch.float64)[:, None]
    sc = torch.arange(-128, 128, dtype=torch.float64)[None, :]
    whole = (q - 32) * sc
    assert not torch.equal(whole.to(torch.float16).double(), whole)  # e.g. 31 x 127 = 3937
    ql, qt = q % 16, q // 16
    for part in (ql * sc / 4, 4 * ql * sc, 4 * (qt - 2) * sc, 64 * (qt - 2) * sc, -256 * sc, -72 * sc, -384 * sc):
        assert torch.equal(part.to(torch.float16).double(), part)
    assert torch.equal(ql * sc / 4 + 4 * (qt - 2) * sc, whole / 4)


def test_q6_k_x_order_puts_two_steps_of_a_lane_side_by_side():
    """Q6_K's float16 x (prep_x): the 8 values a 16-byte load of lane t at 32j + 8t brings are its B fragments of
    MMA steps 2j and 2j + 1, i.e. the values fragment columns 2t, 2t + 1, 8 + 2t, 8 + 2t + 1 of those steps hold."""
    k = 512
    order = mma.q6_k_x_order(k)
    assert torch.equal(order.sort().values, torch.arange(k))
    columns = mma._lane_columns(QType.Q6_K)
    for sb, j, t, o in itertools.product(range(k // 256), range(8), range(4), range(2)):
        s = 2 * j + o
        loaded = order[256 * sb + 32 * j + 8 * t + 4 * o:][:4]  # b0 (pairs 0, 1), then b1
        held = [256 * sb + columns[16 * s + 8 * half + 2 * t + pair] for half in (0, 1) for pair in (0, 1)]
        assert loaded.tolist() == held, (sb, j, t, o)


def _nvrtc_available() -> bool:
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return False
    try:
        mma.compile_cubin('extern "C" __global__ void probe() {}', "sm_90")
    except Exception:  # no libnvrtc: nothing to compile with
        return False
    return True


@pytest.mark.skipif(not _nvrtc_available(), reason="needs cuda-python and NVRTC")
def test_cuda_source_compiles_for_sm90():
    """CI has no GPU: this is what keeps the CUDA source compiling (one instance of each kind)."""
    wrappers = (mma._wrapper("a", QType.Q4_K, mma.MMAConfig(1, 8, 2, 2), 1, "qmh")
                + mma._wrapper("b", QType.Q6_K, mma.MMAConfig(2, 4, 1), 4, "qmm")
                + mma._wrapper("e", QType.Q4_K, mma.MMAConfig(2, 4, 2), mma.ONE_ROW, "qmv")
                + mma._wrapper("f", QType.Q6_K, mma.MMAConfig(1, 2, 1), mma.ONE_ROW, "qmv")
                + mma._wrapper("g", QType.Q4_K, mma.MMAConfig(2, 4, 2), 3, "qmm")
                + mma._wrapper("h", QType.Q6_K, mma.MMAConfig(1, 4, 2, 2), 4, "qmh")
                + mma._wrapper("i", QType.Q6_K, mma.MMAConfig(2, 2, 1, 1), 2, "qmh")
                + mma._prep_x_wrapper(QType.Q6_K)
                + mma._dequant_wrapper("c", QType.Q4_K, 0) + mma._dequant_wrapper("d", QType.Q6_K, 2)
                + dict(mma.instances_for({(QType.Q4_K, 17408, 5120)}, 132))["prep_x_f16"]
                # float32 x and out (a bf16 model's activations): split K's sums, qmh's store, prep_x's loads
                + mma._wrapper("j", QType.Q4_K, mma.MMAConfig(2, 4, 2), mma.ONE_ROW, "qmv", torch.float32, torch.float32)
                + mma._wrapper("k", QType.Q6_K, mma.MMAConfig(2, 4, 2), 3, "qmm", torch.float32, torch.float32)
                + mma._wrapper("l", QType.Q4_K, mma.MMAConfig(1, 8, 2, 2), 1, "qmh", torch.bfloat16, torch.float32)
                + mma._prep_x_wrapper(QType.Q4_K, torch.float32) + mma._prep_x_wrapper(QType.Q6_K, torch.float32)
                # the weights through a shared-memory ring: qmv, qmh splitting K, qmh with x in shared memory too
                + mma._wrapper("m", QType.Q6_K, mma.MMAConfig(2, 2, 1, ring=3), mma.ONE_ROW, "qmv")
                + mma._wrapper("n", QType.Q4_K, mma.MMAConfig(1, 4, 2, 2, ring=2), 2, "qmh")
                + mma._wrapper("o", QType.Q4_K, mma.MMAConfig(1, 4, 1, 2, 3, own_tiles=2, ring=4), 3, "qmh")
                + mma._wrapper("p", QType.Q6_K, mma.MMAConfig(1, 4, 1, 1, 3, own_tiles=2, ring=3), 4, "qmh")
                # the GLU epilogue (a fused gate + up): qmv, qmh summing its warps, qmh whose warps own tiles
                + mma._wrapper("q", QType.Q4_K, mma.MMAConfig(1, 4, 1, 2), mma.ONE_ROW, "qmv", torch.float32,
                               torch.float32, glu=True)
                + mma._wrapper("r", QType.Q4_K, mma.MMAConfig(2, 4, 1, 1, 3, ring=2), 3, "qmh", glu=True)
                + mma._wrapper("s", QType.Q6_K, mma.MMAConfig(1, 4, 1, 1, 3, own_tiles=2), 3, "qmh", torch.bfloat16,
                               torch.float32, glu=True)
                # K split over a thread-block cluster, the splits' sums added through distributed shared memory
                + mma._wrapper("t", QType.Q4_K, mma.MMAConfig(1, 8, 3, 2, own_tiles=2, ring=3, cluster=True), 4, "qmh")
                + mma._wrapper("u", QType.Q6_K, mma.MMAConfig(1, 4, 8, 1, own_tiles=2, ring=2, cluster=True), 2, "qmh",
                               torch.bfloat16, torch.float32)
                # the same splits through global partials and a ticket
                + mma._wrapper("t2", QType.Q4_K, mma.MMAConfig(1, 16, 6, 2, own_tiles=2, ring=2), 3, "qmh")
                + mma._wrapper("u2", QType.Q6_K, mma.MMAConfig(1, 16, 6, 1, own_tiles=2, ring=2), 3, "qmh",
                               torch.bfloat16, torch.float32)
                # x resident in shared memory, warps walking whole tiles: with register buffers, with a weight ring
                + mma._wrapper("v", QType.Q6_K, mma.MMAConfig(1, 16, 1, 2, own_tiles=3), 2, "qmh")
                + mma._wrapper("w", QType.Q4_K, mma.MMAConfig(1, 8, 1, 2, own_tiles=3, ring=2), 1, "qmh",
                               torch.bfloat16, torch.float32))
    cubin = mma.compile_cubin(mma.source() + wrappers, "sm_90")
    assert cubin[:4] == b"\x7fELF"


def test_the_lm_head_takes_x_resident_at_9_to_16_rows(monkeypatch):
    """The LM head (Q6_K 248320 x 5120) at 9-16 rows takes x resident in shared memory (`_RESIDENT_X_HEAD`: 16 warps
    walking whole tiles, one CTA an SM); not at 1-8 rows (slower there on the H100) or 17+ (24 rows of x would not
    fit), not on other matrices, not with FLASHTREE_QMH_RESIDENT_X=0. Its grid is one CTA an SM at most, its dynamic
    shared memory the 8 or 16 rows of x (rows 64 bytes apart past their 2 K bytes) and Q4_K's sums; a K split is
    refused."""
    monkeypatch.delenv("FLASHTREE_QMH_RESIDENT_X", raising=False)
    assert [mma.choose_config(QType.Q6_K, m, 248320, 5120, 132).own_tiles for m in (1, 2, 8, 9, 16, 17, 23)] == [
        0, 0, 0, 3, 3, 0, 0]
    monkeypatch.setenv("FLASHTREE_QMH_RESIDENT_X", "0")
    assert mma.choose_config(QType.Q6_K, 16, 248320, 5120, 132).own_tiles != 3
    assert mma.choose_config(QType.Q6_K, 16, 5120, 17408, 132).own_tiles != 3
    resident = mma._RESIDENT_X_HEAD
    assert resident.grid(248320, 132) == 132 and resident.grid(2048, 132) == 8
    assert resident.dynamic_shared_bytes(QType.Q6_K, 2, 5120) == 16 * (2 * 5120 + 64)
    assert resident.dynamic_shared_bytes(QType.Q4_K, 1, 5120) == 8 * (2 * 5120 + 64) + 8 * 32 * 20
    assert mma.MMAConfig(1, 8, 1, 2, own_tiles=3, ring=2).dynamic_shared_bytes(QType.Q6_K, 2, 5120) == (
        8 * 2 * 3360 + 16 * (2 * 5120 + 64))
    with pytest.raises(FlashtreeError, match="one split"):
        mma.MMAConfig(1, 8, 2, 2, own_tiles=3)


def test_cluster_split_k_is_a_cluster_of_at_most_8_ctas():
    """qmh's warps owning tiles with x in shared memory split K over a thread-block cluster (`cluster_splits`, asked
    with `cluster`): the instance declares the cluster of its splits, allocates no global partials, and a portable
    cluster caps the splits at 8 (the error says so); without `cluster`, and in other split-K launches, the splits
    keep their tickets; a cluster of anything else is refused."""
    config = mma.MMAConfig(1, 8, 3, 2, own_tiles=2, ring=3, cluster=True)
    assert config.cluster_splits and not mma.MMAConfig(1, 8, 3, 2, own_tiles=2, ring=3).cluster_splits
    assert not mma.MMAConfig(1, 4, 2, 2, own_tiles=1).cluster_splits and not mma.MMAConfig(1, 4, 2).cluster_splits
    wrapper = mma._wrapper("w", QType.Q4_K, config, 3, "qmh")
    assert "__cluster_dims__(1, 3, 1) __launch_bounds__(256)" in wrapper
    for ticket in (mma.MMAConfig(1, 4, 2, 2, own_tiles=1), mma.MMAConfig(1, 8, 3, 2, own_tiles=2, ring=3)):
        assert "__cluster_dims__" not in mma._wrapper("v", QType.Q4_K, ticket, 3, "qmh")
    assert mma._instance(QType.Q4_K, config, 3, "qmh").endswith("_own2_cl_g3")
    with pytest.raises(FlashtreeError, match="at most 8 CTAs"):
        mma.MMAConfig(1, 4, 9, 2, own_tiles=2, cluster=True)
    with pytest.raises(FlashtreeError, match="cluster adds the splits of own_tiles 2"):
        mma.MMAConfig(1, 8, 1, 2, own_tiles=2, cluster=True)
    with pytest.raises(FlashtreeError, match="cluster adds the splits of own_tiles 2"):
        mma.MMAConfig(1, 4, 2, cluster=True)


@pytest.mark.skipif(not _nvrtc_available(), reason="needs cuda-python and NVRTC")
def test_min_blocks_caps_the_registers_ptxas_may_use():
    """`MMAConfig.min_blocks` asks ptxas for that many CTAs per SM: an instance of its own whose cubin keeps
    to the register budget they leave (4 warps, 3 CTAs: 65536 / 384 threads -> at most 170 per thread)."""
    config = mma.MMAConfig(1, 4, 1, 2, min_blocks=3)
    name = mma._instance(QType.Q4_K, config, 3, "qmh")
    assert name.endswith("_c2_b3") and name != mma._instance(QType.Q4_K, mma.MMAConfig(1, 4, 1, 2), 3, "qmh")
    wrapper = mma._wrapper(name, QType.Q4_K, config, 3, "qmh")
    assert "__launch_bounds__(128, 3)" in wrapper
    cubin = mma.compile_cubin(mma.source() + wrapper, "sm_90")
    # the function's register count (EIATTR_REGCOUNT: attribute 0x2f, then its 4-byte size, symbol, value)
    regcount = cubin.find(bytes([0x04, 0x2F, 0x08, 0x00]))
    assert regcount >= 0 and int.from_bytes(cubin[regcount + 8 : regcount + 12], "little") <= 170


@pytest.mark.skipif(not _nvrtc_available(), reason="needs cuda-python and NVRTC")
def test_load_time_compile_covers_every_launch_and_caches(monkeypatch, tmp_path):
    """The instances a model's weights can launch (decode, each verify width, prefill's dequantization)
    compile in parallel into the on-disk cache; once there, none is left to compile (a warm start)."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    jobs = mma.instances_for({(QType.Q4_K, 1024, 512)}, 132)
    names = [name for name, _ in jobs]
    assert len(names) == 6 and names[0].startswith("qmv_q4_k") and names[-1].startswith("dequant_q4_k")
    for m in (1, 2, 9, 23, 32):  # every row count a launch takes is one of them
        tg = mma.token_groups(m)
        config = mma.choose_config(QType.Q4_K, m, 1024, 512, 132)
        assert mma._instance(QType.Q4_K, config, tg, mma.kernel_for(QType.Q4_K, tg, 1024, 512)) in names
    big = [name for name, _ in mma.instances_for({(QType.Q4_K, 17408, 5120)}, 132)]
    assert "prep_x_f16" in big and sum(name.startswith("qmh_q4_k") for name in big) == 4  # its x conversion too
    # a bf16 model's float32 activations: float32 x and out, prefill's dense weight in float16
    float32 = [name for name, _ in mma.instances_for({(QType.Q4_K, 17408, 5120)}, 132, torch.float32)]
    assert float32[0].endswith("_xf32_of32") and "prep_x_f16_xf32" in float32 and "dequant_q4_k_o1" in float32
    assert all(name.endswith("_of32") for name in float32 if name.startswith("qmh"))
    with pytest.raises(FlashtreeError, match="bf16 or float32"):
        mma.instances_for({(QType.Q4_K, 1024, 512)}, 132, torch.float16)
    assert mma.uncompiled(jobs, "sm_90") == jobs
    done = []
    mma.precompile(jobs, "sm_90", workers=2, progress=done.append)
    assert sorted(done) == sorted(names)
    assert mma.uncompiled(jobs, "sm_90") == []


# ---------------------------------------------------------------------------------------------
# GPU


def _check_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within the bf16 rounding of the output (half an ulp, 2^-9 relative) plus float32 accumulation."""
    y, ref = y.float(), ref.float()
    bound = ref.abs() * 2.0**-8 + 1e-5 * ref.abs().max()
    assert bool(((y - ref).abs() <= bound).all()), ((y - ref).abs() / ref.abs().max()).max().item()


def test_float16_weights_hold_every_scaled_q4_k_value_exactly():
    """What the Q4_K float16 kernel (qmh) rests on: q * sc (4-bit q, 6-bit scale) and 16 q sc are float16
    integers, and (1024 + q) sc - 1024 sc, one fused multiply-add, gives them back exactly; the mins too."""
    q = torch.arange(16, dtype=torch.float64)[:, None]
    sc = torch.arange(64, dtype=torch.float64)[None, :]
    for factor in (1, 16):  # rows g (nibble at bits 0-3) and g + 8 (bits 4-7: 1024 + 16 q)
        exact = factor * q * sc
        assert torch.equal(exact.to(torch.float16).double(), exact)
        assert torch.equal(((1024 + factor * q) * sc - 1024 * sc).to(torch.float16).double(), exact)
    assert torch.equal(sc.to(torch.float16).double(), sc)


@pytest.mark.gpu
@gpu
def test_float16_x_is_x_times_a_power_of_two_per_row():
    """prep_x: every bf16 value comes back exactly from the float16 copy, at row magnitudes float16 could
    not hold unscaled, and the sub-block sums (hi + lo) match float64 sums of the scaled values."""
    k = 1024
    x = torch.randn(4, k, device="cuda") * torch.tensor([[1e-6], [1.0], [3e5], [1e30]], device="cuda")
    x = x.to(torch.bfloat16)
    xh, sums, scale = mma.prepare_x(x, QType.Q4_K)
    assert torch.equal(xh.float() * scale[:, None], x.float())
    peak = (xh.float().abs().amax(dim=1))
    assert bool(((peak >= 256) & (peak < 512)).all()), peak
    expect = xh.double().reshape(4, k // 256, 8, 32).sum(-1)  # [row, super-block, sub-block]
    got = sums.double().reshape(4, k // 256, 4, 2, 2)  # [row, sb, t, hi/lo, pair]: sub-block 2t + pair
    got = (got[:, :, :, 0] + got[:, :, :, 1]).reshape(4, k // 256, 8)
    assert torch.allclose(got, expect, rtol=0, atol=2.0**-20 * 512 * 32)


@pytest.mark.gpu
@gpu
def test_float16_q6_k_x_is_x_times_a_power_of_two_in_the_kernels_order():
    """prep_x for Q6_K: every bf16 value comes back exactly, at the position `q6_k_x_order` gives it (the
    order the CPU tests tie to the fragment layout); no sums."""
    k = 1280
    x = torch.randn(4, k, device="cuda") * torch.tensor([[1e-6], [1.0], [3e5], [1e30]], device="cuda")
    x = x.to(torch.bfloat16)
    xh, scale = mma.prepare_x(x, QType.Q6_K)
    assert torch.equal(xh.float() * scale[:, None], x.float()[:, mma.q6_k_x_order(k).cuda()])
    peak = (xh.float().abs().amax(dim=1))
    assert bool(((peak >= 256) & (peak < 512)).all()), peak


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_float16_kernel_rows_of_any_magnitude_match_the_float32_reference(qtype):
    """The float16 kernel's per-row power-of-two scaling: tiny, ordinary and huge rows in one launch (a matrix
    below qmh's size, so asked for by name)."""
    n, k = 256, 2048
    weight = QuantWeight.from_gguf_bytes(_random_rows(qtype, n, k).cuda().reshape(-1), qtype, (n, k))
    dense = quants.dequantize(weight.gguf_bytes(), qtype, (n, k), torch.float32)
    x = torch.randn(6, k, device="cuda") * torch.tensor([[1e-8], [1e-3], [1.0], [7.0], [1e5], [1e20]], device="cuda")
    y = mma.matmul(x.to(torch.bfloat16), weight.raw, qtype, n, k, kernel="qmh")
    ref = x.to(torch.bfloat16).float() @ dense.T
    for row in range(6):
        _check_close(y[row], ref[row])


def _gpu_q6_k(n: int, k: int) -> tuple[QuantWeight, torch.Tensor]:
    """A Q6_K weight of random blocks (every int8 scale, small random d) and its float32 dequantization."""
    weight = QuantWeight.from_gguf_bytes(_random_rows(QType.Q6_K, n, k).cuda().reshape(-1), QType.Q6_K, (n, k))
    return weight, quants.dequantize(weight.gguf_bytes(), QType.Q6_K, (n, k), torch.float32)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(5120, 17408), (17408, 5120), (1024, 5120), (64, 2816), (48, 768)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_q6_k_float16_kernel_matches_the_float32_reference(shape):
    """Q6_K's qmh at 2-32 rows, in its own launch shape (1024x5120 and the small ones below its size, asked for by
    name; 64x2816 splits its 11 super-blocks in two unequal halves)."""
    n, k = shape
    weight, dense = _gpu_q6_k(n, k)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m in (2, 5, 8, 16, 23, 32):
        x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        _check_close(mma.matmul(x, weight.raw, QType.Q6_K, n, k, kernel="qmh"), x.float() @ dense.T)


@pytest.mark.gpu
@gpu
def test_q6_k_float16_kernel_splits_k_unevenly():
    """Split K where the super-blocks do not divide: 5 over 3 and 4 splits (the last CTA of 4 gets none) and more
    warps than a split has super-blocks."""
    n, k = 64, 1280
    weight, dense = _gpu_q6_k(n, k)
    x = torch.randn(23, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ dense.T
    for config in (mma.MMAConfig(1, 4, 3, 2), mma.MMAConfig(1, 4, 4, 2), mma.MMAConfig(2, 8, 4, 1)):
        _check_close(mma.matmul(x, weight.raw, QType.Q6_K, n, k, config, "qmh"), ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES)
def test_warps_owning_tiles_match_the_reference(qtype):
    """qmh with each warp owning a row tile (x through L1, or staged in shared memory by the CTA), split K or
    not, at row counts that fill 2-4 token groups partly, against the float32 dequantization."""
    n, k = 1024, 2560
    weight = random_quant_weight(qtype, n, k, "cuda")
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    for m in (9, 23, 32):
        ref = quant_matmul_reference(x[:m].float(), weight)
        for own, splits, x_ahead in ((1, 1, 1), (2, 1, 0), (2, 2, 0), (2, 5, 0)):
            config = mma.MMAConfig(1, 4, splits, 2, min_blocks=3, x_ahead=x_ahead, own_tiles=own)
            _check_close(mma.matmul(x[:m], weight.raw, qtype, n, k, config, "qmh"), ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES)
def test_weight_ring_gives_the_register_kernels_bits(qtype):
    """The weights through a shared-memory ring change no arithmetic: qmv and qmh (warps splitting K, and warps
    owning tiles with x staged in shared memory too) give the bits of their register-buffered forms, at ring depths
    longer than some warps' share of K (10 super-blocks over 4 warps and up to 3 splits), and stay right."""
    n, k = 1024, 2560
    weight = random_quant_weight(qtype, n, k, "cuda")
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    cases = [("qmv", 1, mma.MMAConfig(1, 4, splits, 2)) for splits in (1, 3)]
    cases += [("qmh", m, mma.MMAConfig(1, 4, splits, 2)) for m in (2, 16) for splits in (1, 2)]
    cases += [("qmh", m, mma.MMAConfig(1, 4, splits, 2, min_blocks=3, own_tiles=2)) for m in (23, 32) for splits in (1, 3)]
    for kernel, m, config in cases:
        plain = mma.matmul(x[:m], weight.raw, qtype, n, k, config, kernel)
        _check_close(plain, quant_matmul_reference(x[:m].float(), weight))
        for ring in (2, 3, 4):
            ringed = mma.matmul(x[:m], weight.raw, qtype, n, k, dataclasses.replace(config, ring=ring), kernel)
            assert torch.equal(ringed, plain), (kernel, m, config, ring)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("warps, chains, ring", [(17, 1, 3), (8, 2, 4), (6, 2, 2)])
def test_one_cta_an_sm_gives_the_bits_of_warps_owning_tiles(warps, chains, ring):
    """The wide Q4_K matrices' launch at 9-32 rows (`_own_tiles_one_cta_an_sm`: CTAs of `warps` warps, a tile each)
    on 52 tiles, so that its last CTA is partly past the matrix: each warp sums its tile's K as a 4-warp CTA of warps
    owning tiles does (the same chains; the weight ring and the warp count change no arithmetic), so every row has
    those bits, and is right against the float32 reference; with the GLU epilogue too."""
    n, k = 832, 2560
    config = mma.MMAConfig(1, warps, 1, chains, own_tiles=2, ring=ring)
    assert n % config.rows_per_cta and config.row_groups(n) == -(-52 // warps)
    weight = random_quant_weight(QType.Q4_K, n, k, "cuda")
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    four_warps = mma.MMAConfig(1, 4, 1, chains, min_blocks=3, own_tiles=2)
    for m in (9, 23, 32):
        y = mma.matmul(x[:m], weight.raw, QType.Q4_K, n, k, config, "qmh")
        assert torch.equal(y, mma.matmul(x[:m], weight.raw, QType.Q4_K, n, k, four_warps, "qmh")), m
        _check_close(y, quant_matmul_reference(x[:m].float(), weight))
        glu = mma.matmul(x[:m], weight.raw, QType.Q4_K, n, k, config, "qmh", glu=True)
        assert torch.equal(glu, mma.matmul(x[:m], weight.raw, QType.Q4_K, n, k, four_warps, "qmh", glu=True)), m


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("warps, chains, ring", [(17, 1, 3), (8, 2, 4), (6, 2, 2)])
def test_x_staged_by_a_warp_of_its_own_gives_the_bits_of_a_cta_barrier(warps, chains, ring):
    """own_tiles 4 (mma.cu `ProducedX`: x's stages filled by one more warp with cp.async, mbarriers instead of a
    CTA barrier a super-block) against own_tiles 2, the same launch otherwise: the same bits at 9-32 rows (2, 3 and
    4 token groups: 3 and 2 stages; 48 and 64 pieces of Q4_K's sums a stage, more than the producer's 32 lanes), with
    the GLU epilogue too, on 52 tiles (a last CTA partly past the matrix) and K of 40 super-blocks (the stages wrap
    many times)."""
    n, k = 832, 10240
    staged = mma.MMAConfig(1, warps, 1, chains, own_tiles=2, ring=ring)
    produced = mma.MMAConfig(1, warps, 1, chains, own_tiles=4, ring=ring)
    assert produced.threads == staged.threads + 32 and produced.row_groups(n) == staged.row_groups(n)
    weight = random_quant_weight(QType.Q4_K, n, k, "cuda")
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    for m in (9, 23, 32):
        y = mma.matmul(x[:m], weight.raw, QType.Q4_K, n, k, produced, "qmh")
        assert torch.equal(y, mma.matmul(x[:m], weight.raw, QType.Q4_K, n, k, staged, "qmh")), m
        glu = mma.matmul(x[:m], weight.raw, QType.Q4_K, n, k, produced, "qmh", glu=True)
        assert torch.equal(glu, mma.matmul(x[:m], weight.raw, QType.Q4_K, n, k, staged, "qmh", glu=True)), m


def test_a_producer_warp_stages_x_for_one_split():
    assert mma.MMAConfig(1, 17, 1, own_tiles=4, ring=3).threads == 18 * 32
    with pytest.raises(FlashtreeError, match="one split"):
        mma.MMAConfig(1, 8, 2, own_tiles=4, ring=2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
@pytest.mark.parametrize("warps, splits, chains, ring, blocks", [(8, 3, 2, 3, 20), (4, 8, 2, 2, 24), (16, 6, 1, 2, 24)])
@pytest.mark.parametrize("cluster", [True, False])
def test_split_k_of_warps_owning_tiles_adds_the_splits_sums_in_split_order(qtype, warps, splits, chains, ring, blocks,
                                                                          cluster):
    """K split for warps owning tiles with x in shared memory, over a thread-block cluster (`MMAConfig.cluster_splits`)
    or through global partials and a ticket: each split sums its super-blocks as the one-split launch of the same
    warps does on those super-blocks alone, and the splits' sums are added in split order. So float32 outputs
    equal the in-order float32 sum of one-split launches on the K slices, bit for bit (every slice holds the row's
    largest |x|, so prep_x scales each slice as the whole row, by a power of two that commutes with the additions);
    and the bf16 outputs are right against the float32 reference."""
    n, k = 32 * warps, 256 * blocks  # two row groups
    weight = random_quant_weight(qtype, n, k, "cuda")
    per = -(-blocks // splits)
    bounds = [(256 * b, 256 * min(blocks, b + per)) for b in range(0, blocks, per)]
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    x[:, [lo for lo, _ in bounds]] = 8.0
    config = mma.MMAConfig(1, warps, splits, chains, own_tiles=2, ring=ring, cluster=cluster)
    one_split = mma.MMAConfig(1, warps, 1, chains, own_tiles=2, ring=ring)
    type_size = weight.gguf_bytes().shape[1] // blocks
    rows = weight.gguf_bytes().reshape(n, blocks, type_size)
    slices = [(lo, hi, QuantWeight.from_gguf_bytes(rows[:, lo // 256:hi // 256].reshape(-1, type_size), qtype,
                                                   (n, hi - lo)).raw) for lo, hi in bounds]
    for m in (2, 9, 23, 32):
        y = mma.matmul(x[:m], weight.raw, qtype, n, k, config, "qmh", out_dtype=torch.float32)
        total = torch.zeros_like(y)
        for lo, hi, raw in slices:
            total += mma.matmul(x[:m, lo:hi].contiguous(), raw, qtype, n, hi - lo, one_split, "qmh",
                                out_dtype=torch.float32)
        assert torch.equal(y, total), m
        _check_close(mma.matmul(x[:m], weight.raw, qtype, n, k, config, "qmh"),
                     quant_matmul_reference(x[:m].float(), weight))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
@pytest.mark.parametrize("warps, chains, ring", [(4, 2, 0), (8, 2, 2), (16, 1, 0)])
def test_resident_x_gives_the_bits_of_warps_owning_tiles(qtype, warps, chains, ring):
    """x resident in shared memory (own_tiles 3): each warp sums its tiles' K in the order of warps owning tiles with
    one split (own_tiles 2, the same chains), so every row has those bits, and is right against the float32
    reference; on 1088 row tiles, more than 132 CTAs of 4 or 8 warps hold, so warps walk several tiles."""
    n, k = 17408, 5120
    weight = random_quant_weight(qtype, n, k, "cuda")
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    config = mma.MMAConfig(1, warps, 1, chains, own_tiles=3, ring=ring)
    owning = mma.MMAConfig(1, 4, 1, chains, own_tiles=2)
    for m in (2, 8, 9, 16):
        y = mma.matmul(x[:m], weight.raw, qtype, n, k, config, "qmh")
        assert torch.equal(y, mma.matmul(x[:m], weight.raw, qtype, n, k, owning, "qmh")), m
        _check_close(y, quant_matmul_reference(x[:m].float(), weight))


@pytest.mark.gpu
@gpu
def test_the_lm_heads_verify_shape_keeps_the_bits_of_its_class():
    """Q6_K's LM head at 17-24 rows takes two tiles a warp through a weight ring (`_Q6_K_HEAD_VERIFY`): the K order
    and the chain of the one-tile form it replaced, so a row keeps its bits (on a smaller matrix, same K)."""
    n, k = 2048, 5120
    weight = random_quant_weight(QType.Q6_K, n, k, "cuda")
    x = torch.randn(24, k, device="cuda", dtype=torch.bfloat16)
    one_tile = mma.MMAConfig(1, 4, 1, 1, min_blocks=3, x_ahead=1)
    for m in (17, 23, 24):
        ringed = mma.matmul(x[:m], weight.raw, QType.Q6_K, n, k, mma._Q6_K_HEAD_VERIFY, "qmh")
        assert torch.equal(ringed, mma.matmul(x[:m], weight.raw, QType.Q6_K, n, k, one_tile, "qmh")), m
    _check_close(ringed, quant_matmul_reference(x.float(), weight))


def test_without_one_cta_an_sm_the_wide_matrices_take_the_two_tile_ring(monkeypatch):
    """FLASHTREE_QMH_ONE_CTA=0 (A/B timings) keeps the launch before it: two tiles a warp through a weight ring at the
    CTAs per SM whose waves are fullest, or the register-buffered qmh where no count fills them."""
    monkeypatch.setenv("FLASHTREE_QMH_ONE_CTA", "0")
    ring = mma.MMAConfig(2, 4, 1, 1, min_blocks=3, ring=2)
    # the fused gate + up (1088 CTAs of 32 rows: 2.75 waves at 3 per SM) and q + gate (384: 0.97)
    for n in (34816, 12288):
        assert [mma.choose_config(QType.Q4_K, m, n, 5120) for m in (8, 9, 16, 23, 32)] == [
            mma.MMAConfig(1, 4, 1, 2), ring, ring, ring, ring], n
    # a DeltaNet layer's qkv + z + beta + alpha (515 CTAs): 4 per SM at 2 token groups (0.98 of a wave), 2 at 3 and 4
    assert [mma.choose_config(QType.Q4_K, m, 16480, 5120) for m in (16, 23, 32)] == [
        dataclasses.replace(ring, min_blocks=4), dataclasses.replace(ring, min_blocks=0),
        dataclasses.replace(ring, min_blocks=0)]
    assert mma._wave_fill(515, 528) == 515 / 528 and mma._wave_fill(1088, 396) == 1088 / 1188
    # an unfused gate or up (544 CTAs: 0.69 of their waves at 2, 3 or 4 per SM) keeps the register-buffered qmh
    assert [mma.choose_config(QType.Q4_K, m, 17408, 5120) for m in (16, 23)] == [
        mma.MMAConfig(1, 4, 1, 2), mma.MMAConfig(1, 4, 1, 2, min_blocks=3, own_tiles=2)]


def test_only_warps_owning_tiles_in_one_split_take_a_partial_last_cta():
    """A launch's CTAs along N: whole CTAs, except where the warps own tiles and K is one split (the last CTA's spare
    warps walk the last tile again and store nothing); a row count that is not whole tiles is refused."""
    own = mma.MMAConfig(1, 8, 1, 2, own_tiles=2, ring=4)
    assert own.row_groups(16480) == 129 and own.row_groups(16384) == 128
    for config, n in ((mma.MMAConfig(1, 8, 2, 2, own_tiles=2), 16480), (mma.MMAConfig(2, 4, 1), 16400),
                      (own, 16488)):
        with pytest.raises(FlashtreeError, match="needs N %"):
            config.row_groups(n)
    assert mma.MMAConfig(2, 4, 1).row_groups(16384) == 512


def test_a_weight_ring_of_one_stage_is_refused():
    with pytest.raises(FlashtreeError, match="at least 2 stages"):
        mma.MMAConfig(1, 4, 1, ring=1)
    assert mma.MMAConfig(1, 4, 1, ring=3).ring_bytes(QType.Q4_K) == 4 * 3 * 2304
    assert mma.MMAConfig(2, 2, 1, ring=2).ring_bytes(QType.Q6_K) == 2 * 2 * 2 * 3360


@pytest.mark.gpu
@gpu
def test_q6_k_takes_the_float16_kernel_and_a_row_keeps_its_bits():
    """The down projection's verify rows go through qmh (quant_matmul gives the same bits as asking for it), and
    a row's bits do not depend on the other rows within a class of row counts (2-16, and 17-32 with the
    pieces of longer x), across classes within a rounding."""
    same, few, other = (17, 23, 25, 32, 33), 16, (2, 8)
    n, k = 5120, 17408
    weight, dense = _gpu_q6_k(n, k)
    x = torch.randn(40, k, device="cuda", dtype=torch.bfloat16)
    y = quant_matmul(x, weight)
    assert torch.equal(y, mma.matmul(x, weight.raw, QType.Q6_K, n, k, kernel="qmh"))
    _check_close(y, x.float() @ dense.T)
    for m in same:
        assert torch.equal(quant_matmul(x[:m], weight), y[:m]), m
    fewer = quant_matmul(x[:few], weight)
    _check_close(fewer, x[:few].float() @ dense.T)
    for m in other:
        assert torch.equal(quant_matmul(x[:m], weight), fewer[:m]), m


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, classes", [(10240, ((17, 23, 24, 25), (2, 9))), (16480, ((9, 16, 17, 23, 25), (2, 8)))])
def test_q4_k_float16_kernel_gives_a_row_the_same_bits_within_a_class_of_row_counts(n, classes):
    """Q4_K's qmh sums a row in one order per class of row counts (the CTAs per SM and the weight ring change the
    registers, not the order): on a 10240-row matrix 2-16 and 17-32 (there the CTA's warps own a tile each and sum
    all of K), on a wide one (two tiles a warp from 9 rows) 2-8 and 9-32. A verify of 32 rows and one of any
    count of its class give a shared row the same bits; the other class is within a rounding."""
    k = 5120
    weight = random_quant_weight(QType.Q4_K, n, k, "cuda")
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    assert mma.kernel_for(QType.Q4_K, mma.token_groups(32), n, k) == "qmh"
    y = quant_matmul(x, weight)
    _check_close(y, quant_matmul_reference(x.float(), weight))
    same, other = classes
    for m in same:
        assert torch.equal(quant_matmul(x[:m], weight), y[:m]), m
    few = quant_matmul(x[:other[-1]], weight)
    _check_close(few, quant_matmul_reference(x[:other[-1]].float(), weight))
    for m in other:
        assert torch.equal(quant_matmul(x[:m], weight), few[:m]), m


@pytest.mark.gpu
@pytest.mark.slow  # a 1 GB head and its 5 GB float32 reference
@gpu
def test_q6_k_lm_head_shape_matches_the_float32_reference():
    """The 27B's 248320x5120 Q6_K LM head at 16 and 23 rows (2 warps per CTA): about 1 GB of weights, 5 GB of
    float32 reference."""
    n, k = 248320, 5120
    weight = random_quant_weight(QType.Q6_K, n, k, "cuda")
    assert mma.kernel_for(QType.Q6_K, mma.token_groups(23), n, k) == "qmh"
    for m in (16, 23):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        _check_close(quant_matmul(x, weight), quant_matmul_reference(x.float(), weight))
    torch.cuda.empty_cache()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(64, 512), (17408, 5120), (5120, 17408)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_row_count_matches_the_float32_reference(qtype, shape):
    weight = QuantWeight.from_gguf_bytes(_random_rows(qtype, *shape).cuda().reshape(-1), qtype, shape)
    assert weight.mma_layout
    dense = quants.dequantize(weight.gguf_bytes(), qtype, shape, torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 2, 7, 8, 9, 16, 23, 32, 33, 100):
        x = torch.randn(m, shape[1], generator=gen, device="cuda", dtype=torch.bfloat16)
        _check_close(quant_matmul(x, weight), x.float() @ dense.T)
    # a prefill chunk: the weight dequantized to bf16 (rounded: not the float32 reference's), in row blocks past
    # DENSE_BLOCK_BYTES, each block's product written in place: the whole weight's product in float32 but for
    # cuBLAS's summation (its bf16 split-K reductions at K = 17408 differed from the float32 product by up to 0.005
    # of the largest value, H200 2026-12-05); a block in the wrong columns is off by the values themselves
    x = torch.randn(600, shape[1], generator=gen, device="cuda", dtype=torch.bfloat16)
    y, ref = quant_matmul(x, weight).float(), x.float() @ weight.dequantize(torch.bfloat16).float().T
    assert bool(((y - ref).abs() <= ref.abs() * 2.0**-8 + 2.0**-6 * ref.abs().max()).all()), \
        ((y - ref).abs() / ref.abs().max()).max().item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(64, 512), (17408, 5120), (5120, 17408)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_float32_rows_in_and_out(qtype, shape):
    """A bf16 model's float32 activations (docs/FIDELITY.md, design D): the kernels read float32 x and write
    float32. Given bf16-exact x they compute what the bf16 kernels compute, bit for bit before the output's
    rounding; on any float32 x they are within the rounding of x to bf16 (one row, small matrices) or to float16
    (qmh; prefill's dense float16 weight), whose bound is that rounding times |x| |W|."""
    weight = QuantWeight.from_gguf_bytes(_random_rows(qtype, *shape).cuda().reshape(-1), qtype, shape)
    n, k = shape
    dense = quants.dequantize(weight.gguf_bytes(), qtype, shape, torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 2, 9, 23, 32, 33, 600):
        x = torch.randn(m, k, generator=gen, device="cuda") * torch.logspace(-3, 3, m, device="cuda")[:, None]
        y = quant_matmul_rounded(x, weight)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        bf16_x = m == 1 or mma.kernel_for(qtype, mma.token_groups(min(m, mma.MAX_M)), n, k) == "qmm"
        rounding = 2.0**-8 if bf16_x else 2.0**-9 if m >= DENSE_MIN_M else 2.0**-10  # dense: weights in float16 too
        magnitude = x.abs() @ dense.abs().T
        bound = rounding * magnitude + 1e-6 * magnitude.max(-1, keepdim=True).values
        assert bool(((y - x @ dense.T).abs() <= bound).all()), (m, ((y - x @ dense.T).abs() / bound).max().item())
        if m <= mma.MAX_M:
            exact = x.bfloat16()
            assert torch.equal(mma.matmul(exact.float(), weight.raw, qtype, n, k, out_dtype=torch.float32).bfloat16(),
                               mma.matmul(exact, weight.raw, qtype, n, k)), m


@pytest.mark.gpu
@pytest.mark.slow  # 24 configurations x 3 kernels: the full GPU suite; the default ones are in the fast subset
@gpu
# one test per kernel (24 NVRTC compiles each), so that the GPU suite's workers share them
@pytest.mark.parametrize("rows, kernel", [(1, "qmv"), (23, "qmm"), (23, "qmh")])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_launch_configuration_is_right(qtype, rows, kernel):
    n, k = 1024, 4096
    weight = random_quant_weight(qtype, n, k, "cuda")
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    ref = quant_matmul_reference(x.float(), weight)
    for rt, warps, splits in itertools.product((1, 2), (1, 2, 4, 8), (1, 2, 4)):
        config = mma.MMAConfig(rt, warps, splits, 2 if kernel == "qmh" and rt == 1 else 1)
        y = mma.matmul(x, weight.raw, qtype, n, k, config, kernel)
        _check_close(y, ref)
        assert torch.equal(y, mma.matmul(x, weight.raw, qtype, n, k, config, kernel)), (rows, kernel, config)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_graph_replay_and_gguf_bytes_on_the_gpu(qtype):
    rows = _random_rows(qtype, 256, 1024).cuda()
    weight = QuantWeight.from_gguf_bytes(rows.reshape(-1), qtype, (256, 1024))
    assert torch.equal(weight.gguf_bytes(), rows)
    assert torch.equal(weight.to("cpu").gguf_bytes(), rows.cpu())
    dense = quants.dequantize(rows.reshape(-1), qtype, (256, 1024), torch.float32)
    assert torch.allclose(weight.dequantize(torch.float32), dense, rtol=0, atol=1e-6 * dense.abs().max().item())
    x = torch.randn(5, 1024, dtype=torch.bfloat16, device="cuda")
    eager = quant_matmul(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = quant_matmul(x, weight)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_float16_kernel_replays_in_a_graph(qtype):
    """qmh with its x conversion inside a captured CUDA graph (the verify step's), on new x each replay."""
    n, k = 256, 1024
    weight = QuantWeight.from_gguf_bytes(_random_rows(qtype, n, k).cuda().reshape(-1), qtype, (n, k))
    x = torch.randn(23, k, dtype=torch.bfloat16, device="cuda")
    mma.matmul(x, weight.raw, qtype, n, k, kernel="qmh")  # compiled and loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mma.matmul(x, weight.raw, qtype, n, k, kernel="qmh")
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, mma.matmul(x, weight.raw, qtype, n, k, kernel="qmh"))


def test_prepare_x_takes_the_float16_x_a_kernel_wrote_while_x_is_unchanged():
    """`remember_x_f16`: the conversion another launch wrote (a norm's) serves `prepare_x` for that x and type, its
    views of the same shape included, until x changes or dies; no other x or type takes it (on the CPU, where a
    conversion of its own could not launch: what comes back can only be the written one)."""
    x = torch.randn(3, 256)
    written = mma.x_f16_buffers(3, 256, QType.Q4_K, x.device)
    assert [t.shape for t in written] == [(3, 256), (3, 1, 16), (3,)]
    mma.remember_x_f16(x, QType.Q4_K, written)
    assert mma.prepare_x(x.reshape(-1, 256), QType.Q4_K) is written
    assert mma._written_x_f16(x, QType.Q6_K) is None
    assert mma._written_x_f16(x.clone(), QType.Q4_K) is None
    assert mma._written_x_f16(x[:2], QType.Q4_K) is None
    x.add_(1)
    assert mma._written_x_f16(x, QType.Q4_K) is None
    view = x.view(3, 256)
    mma.remember_x_f16(view, QType.Q4_K, written)
    mma.remember_x_f16(x, QType.Q4_K, written)  # the same key: x's entry replaces the view's
    del view
    assert mma._written_x_f16(x, QType.Q4_K) is written  # the view's death does not take x's entry
    key = mma._x_key(x, QType.Q4_K)
    del x
    assert key not in mma._written_x


def test_the_float16_x_type_is_qmhs():
    """`x_f16_type`: the weight's type where M rows take qmh (the norm before it may write that x), else None."""
    def weight(qtype, n, k, mma_layout=True):
        return QuantWeight(torch.empty(0, dtype=torch.uint8), qtype, (n, k), mma_layout=mma_layout)

    assert x_f16_type(weight(QType.Q4_K, 17408, 5120), 23) == QType.Q4_K
    assert x_f16_type(weight(QType.Q6_K, 5120, 17408), 2) == QType.Q6_K
    assert x_f16_type(weight(QType.Q4_K, 17408, 5120), 1) is None  # qmv reads x as it is
    assert x_f16_type(weight(QType.Q4_K, 1024, 5120), 23) is None  # qmm (below QMH_MIN_WEIGHTS)
    assert x_f16_type(weight(QType.Q4_K, 17408, 5120), DENSE_MIN_M) is None  # a dense prefill chunk
    assert x_f16_type(weight(QType.Q4_K, 17408, 5120, mma_layout=False), 23) is None


def test_an_inference_tensors_float16_x_holds_while_it_lives():
    """Inference tensors (the engine's forward) keep no version: the entry holds for as long as x lives."""
    with torch.inference_mode():
        x = torch.randn(2, 256)
        written = mma.x_f16_buffers(2, 256, QType.Q6_K, x.device)
        mma.remember_x_f16(x, QType.Q6_K, written)
        assert len(written) == 2 and mma.prepare_x(x, QType.Q6_K) is written
        key = mma._x_key(x, QType.Q6_K)
        del x
        assert key not in mma._written_x
