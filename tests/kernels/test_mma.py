"""The fragment-ordered Q4_K/Q6_K layout and its CUDA kernels (kernels/quant_matmul/mma.py, mma.cu).

On the CPU: the layout round-trips the GGUF bytes exactly, the kernels' decoding (emulated bit for bit
in torch) gives the float32 dequantization, and NVRTC compiles the CUDA source for sm_90 (where
cuda-python and NVRTC are installed). On a GPU: every row count and launch configuration against the
float32 reference, bit-identical rows whatever M, CUDA-graph capture, the dense dequantization.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.formats import quants
from flashtree.kernels.quant_matmul import QuantWeight, mma, quant_matmul, quant_matmul_reference, random_quant_weight

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


def test_shapes_without_a_layout_are_refused():
    assert not mma.supports(QType.Q4_K, (24, 256)) and not mma.supports(QType.Q8_0, (32, 256))
    with pytest.raises(FlashtreeError, match="N % 16"):
        mma.to_mma_layout(torch.zeros(24 * 144, dtype=torch.uint8), QType.Q4_K, 24, 256)


def test_cpu_weights_keep_the_gguf_field_layout():
    w = QuantWeight.from_gguf_bytes(_random_rows(QType.Q4_K, 32, 256).reshape(-1), QType.Q4_K, (32, 256))
    assert not w.mma_layout and "qs" in w.fields()


def test_warps_and_splits_do_not_depend_on_the_row_count():
    """They fix a row's summation order: decode and verify rows must round the same."""
    for qtype in TYPES:
        for n, k in [(17408, 5120), (5120, 17408), (1024, 5120), (248320, 5120)]:
            configs = {m: mma.choose_config(qtype, m, n, k) for m in range(1, 33)}
            assert len({(c.warps, c.splits) for c in configs.values()}) == 1, (qtype, n, k)


def test_configurations_follow_the_sweep():
    """The H200 sweeps' choices (docs/PERFORMANCE.md): the LM head on 2 warps, small matrices split K,
    Q6_K and Q4_K's float16 kernel pair row tiles from 17 rows (qmh on one tile: two accumulator chains),
    Q4_K's bf16 kernel at 9-16 and 25-32."""
    assert mma.choose_config(QType.Q6_K, 1, 248320, 5120) == mma.MMAConfig(1, 2, 1)
    assert mma.choose_config(QType.Q6_K, 23, 248320, 5120) == mma.MMAConfig(2, 2, 1)
    assert mma.choose_config(QType.Q4_K, 1, 5120, 17408) == mma.MMAConfig(1, 4, 1)
    assert mma.choose_config(QType.Q4_K, 1, 1024, 5120) == mma.MMAConfig(1, 4, 4)
    assert mma.choose_config(QType.Q4_K, 32, 1024, 5120).rt == 1  # too few tiles to pair
    assert [mma.choose_config(QType.Q4_K, m, 17408, 5120) for m in (8, 16, 23, 32)] == [
        mma.MMAConfig(1, 4, 1, 2), mma.MMAConfig(1, 4, 1, 2), mma.MMAConfig(2, 4, 1, 1), mma.MMAConfig(2, 4, 1, 1)]
    assert [mma.kernel_for(QType.Q4_K, 3, n, k) for n, k in ((17408, 5120), (1024, 5120))] == ["qmh", "qmm"]
    # the bf16 kernel's own choice on the same matrix (what the sweeps compare qmh with)
    assert [mma.choose_config(QType.Q4_K, m, 17408, 5120, kernel="qmm").rt for m in (8, 16, 23, 32)] == [1, 2, 1, 2]
    assert [mma.choose_config(QType.Q4_K, m, 4096, 1024).rt for m in (8, 16, 23, 32)] == [1, 2, 1, 2]
    assert [mma.choose_config(QType.Q6_K, m, 17408, 5120).rt for m in (8, 16, 23, 32)] == [1, 1, 2, 2]


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
                + mma._dequant_wrapper("c", QType.Q4_K, 0) + mma._dequant_wrapper("d", QType.Q6_K, 2)
                + dict(mma.instances_for({(QType.Q4_K, 17408, 5120)}, 132))["prep_x_f16"])
    cubin = mma.compile_cubin(mma._SOURCE.read_text() + wrappers, "sm_90")
    assert cubin[:4] == b"\x7fELF"


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
    xh, sums, scale = mma.prepare_x(x)
    assert torch.equal(xh.float() * scale[:, None], x.float())
    peak = (xh.float().abs().amax(dim=1))
    assert bool(((peak >= 256) & (peak < 512)).all()), peak
    expect = xh.double().reshape(4, k // 256, 8, 32).sum(-1)  # [row, super-block, sub-block]
    got = sums.double().reshape(4, k // 256, 4, 2, 2)  # [row, sb, t, hi/lo, pair]: sub-block 2t + pair
    got = (got[:, :, :, 0] + got[:, :, :, 1]).reshape(4, k // 256, 8)
    assert torch.allclose(got, expect, rtol=0, atol=2.0**-20 * 512 * 32)


@pytest.mark.gpu
@gpu
def test_q4_k_rows_of_any_magnitude_match_the_float32_reference():
    """The float16 kernel's per-row power-of-two scaling: tiny, ordinary and huge rows in one launch."""
    n, k = 256, 2048
    weight = QuantWeight.from_gguf_bytes(_random_rows(QType.Q4_K, n, k).cuda().reshape(-1), QType.Q4_K, (n, k))
    dense = quants.dequantize(weight.gguf_bytes(), QType.Q4_K, (n, k), torch.float32)
    x = torch.randn(6, k, device="cuda") * torch.tensor([[1e-8], [1e-3], [1.0], [7.0], [1e5], [1e20]], device="cuda")
    y = quant_matmul(x.to(torch.bfloat16), weight)
    ref = x.to(torch.bfloat16).float() @ dense.T
    for row in range(6):
        _check_close(y[row], ref[row])


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


@pytest.mark.gpu
@pytest.mark.slow  # 24 configurations x 2 kernels: the full GPU suite; the default ones are in the fast subset
@gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_launch_configuration_is_right(qtype):
    n, k = 1024, 4096
    weight = random_quant_weight(qtype, n, k, "cuda")
    for rows in (1, 23):  # the one-row kernel (qmv) and the token-group one (Q4_K: qmh, Q6_K: qmm)
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        ref = quant_matmul_reference(x.float(), weight)
        for config in itertools.starmap(mma.MMAConfig, itertools.product((1, 2), (1, 2, 4, 8), (1, 2, 4))):
            y = mma.matmul(x, weight.raw, qtype, n, k, config)
            _check_close(y, ref)
            assert torch.equal(y, mma.matmul(x, weight.raw, qtype, n, k, config)), (rows, config)


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
