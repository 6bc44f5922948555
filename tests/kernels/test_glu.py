"""The MLP's gate and up projections as one weight whose matmul is SiLU(gate) * up (`quant_matmul.glu_weight`,
`quant_matmul_glu`, `layers.GluLinear`): the interleaved rows and their round trip, the torch path against the
separate matmuls and `silu_mul` on the CPU, which launches take the tensor-core epilogue, and the CUDA kernels
against the unfused path on the GPU."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.kernels.activations import interleaved_silu_mul, silu_mul
from flashtree.kernels.quant_matmul import (QuantWeight, glu_parts, glu_weight, mma, quant_matmul, quant_matmul_glu,
                                            quant_matmul_rounded)
from flashtree.models.layers import GluLinear, QuantLinear
from flashtree.models.qwen35 import MLP

from tests.kernels.test_mma import _random_rows

TYPES = [QType.Q4_K, QType.Q6_K]


def _pair(qtype: QType, f: int, k: int, device="cpu") -> tuple[QuantWeight, QuantWeight]:
    return tuple(QuantWeight.from_gguf_bytes(_random_rows(qtype, f, k, seed=seed).to(device).reshape(-1), qtype, (f, k))
                 for seed in (1, 2))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_rows_interleave_8_by_8_and_come_back_as_loaded(qtype):
    gate, up = _pair(qtype, 48, 512)
    fused = glu_weight(gate, up)
    assert fused.shape == (96, 512) and fused.qtype == qtype
    rows = fused.gguf_bytes()
    assert torch.equal(rows[16:24], gate.gguf_bytes()[8:16]) and torch.equal(rows[24:32], up.gguf_bytes()[8:16])
    assert all(torch.equal(a.gguf_bytes(), b.gguf_bytes()) for a, b in zip(glu_parts(fused), (gate, up)))


def test_parts_that_do_not_interleave_are_refused():
    gate, up = _pair(QType.Q4_K, 48, 512)
    other = QuantWeight.from_gguf_bytes(_random_rows(QType.Q6_K, 48, 512).reshape(-1), QType.Q6_K, (48, 512))
    for a, b in ((gate, other), (gate, _pair(QType.Q4_K, 32, 512)[0]), *(2 * [_pair(QType.Q4_K, 12, 256)])):
        with pytest.raises(FlashtreeError, match="do not interleave"):
            glu_weight(a, b)


@pytest.mark.parametrize("rounded", [False, True])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_glu_matmul_is_silu_of_the_gate_times_the_up_projection(qtype, rounded):
    """On the CPU (the torch path every device falls back to): the interleaved product then `interleaved_silu_mul`,
    against the two projections' own matmuls and `silu_mul`; for a bf16 model's float32 activations (`rounded`) as
    `quant_matmul_rounded` rounds them."""
    gate, up = _pair(qtype, 48, 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)) * 3
    matmul = quant_matmul_rounded if rounded else quant_matmul
    want = silu_mul(matmul(x, gate), matmul(x, up))
    torch.testing.assert_close(quant_matmul_glu(x, glu_weight(gate, up), rounded), want, rtol=1e-5, atol=1e-6)
    linear = GluLinear(glu_weight(gate, up), rounded_input=rounded)
    torch.testing.assert_close(linear(x[None]), want[None], rtol=1e-5, atol=1e-6)
    assert [p.quant.gguf_bytes().shape for p in linear.parts()] == [gate.gguf_bytes().shape] * 2


def test_only_tensor_core_weights_of_one_type_take_the_glu_form():
    """`GluLinear.of`: the two projections in one fragment-ordered matrix (the kernels with the epilogue); CPU
    weights, and a gate and an up of different types (a mixed quantization), keep the separate matmul and
    `silu_mul` (`MLP.fuse`)."""
    gate, up = _pair(QType.Q4_K, 48, 512)
    assert GluLinear.of(QuantLinear(gate), QuantLinear(up)) is None  # not in the fragment layout here
    q6_k = QuantWeight.from_gguf_bytes(_random_rows(QType.Q6_K, 48, 512).reshape(-1), QType.Q6_K, (48, 512))
    assert GluLinear.of(_fragment_ordered(gate), _fragment_ordered(q6_k)) is None
    assert GluLinear.of(_fragment_ordered(gate), _fragment_ordered(up)) is not None


def test_the_epilogue_runs_in_qmv_and_qmh_with_one_split():
    """qmv (one row) and qmh (2-32 rows of a big matrix) take it; qmm (small matrices) and split K do not, so the
    small matrices' rows go through the torch path."""
    assert mma.glu_takes(QType.Q4_K, 1, 64, 512) and not mma.glu_takes(QType.Q4_K, 23, 64, 512)
    assert mma.glu_takes(QType.Q4_K, 23, 34816, 5120) and mma.glu_takes(QType.Q4_K, 100, 34816, 5120)
    for config, kernel in ((mma.MMAConfig(1, 4, 1), "qmm"), (mma.MMAConfig(1, 4, 2), "qmh")):
        with pytest.raises(FlashtreeError, match="GLU epilogue"):
            mma._wrapper("x", QType.Q4_K, config, 3, kernel, glu=True)
    assert mma.glu_config(mma.MMAConfig(1, 4, 4, 2)) == mma.MMAConfig(1, 4, 1, 2)


def test_load_time_compile_plans_the_glu_instances_of_a_fused_gate_and_up():
    shape = (QType.Q4_K, 34816, 5120)
    plain = dict(mma.instances_for({shape}, 132, torch.float32))
    glu = dict(mma.instances_for({shape}, 132, torch.float32, {shape}))
    kernels = sorted(name for name in glu if name.startswith(("qmv", "qmh")))
    assert kernels and all(name.endswith("_glu") and "_s1_" in name for name in kernels)
    assert sorted(name for name in plain if name.startswith(("qmv", "qmh"))) == [name[:-4] for name in kernels]
    # the template's GLU argument: qmv's last, qmh's before CLUSTER
    assert all((", 1, 0>(" if name.startswith("qmh") else ", 1>(") in glu[name] for name in kernels)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_glu_kernels_match_the_unfused_path_on_gpu(qtype):
    """The 27B MLP's shape (17408 x 5120 each): decode (qmv), verify rows (qmh, in its ring and its other forms),
    33 rows (two launches) and a prefill chunk (the dense path, then `interleaved_silu_mul`), bf16 and float32
    activations, against the same interleaved matmul followed by `interleaved_silu_mul`: the same sums (one split
    either way), so they differ only in SiLU's exp and division; and against the two separate projections."""
    f, k = 17408, 5120
    gate, up = _pair(qtype, f, k, "cuda")
    fused = glu_weight(gate, up)
    assert fused.mma_layout
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 2, 9, 23, 32, 33, 600):
        for rounded, dtype in ((False, torch.bfloat16), (True, torch.float32)):
            x = (torch.randn(m, k, generator=gen, device="cuda") * 2).to(dtype)
            matmul = quant_matmul_rounded if rounded else quant_matmul
            y = quant_matmul_glu(x, fused, rounded)
            assert y.shape == (m, f) and y.dtype == dtype
            unfused = interleaved_silu_mul(matmul(x, fused))
            ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
            scale = unfused.float().abs().max()
            assert ((y.float() - unfused.float()).abs() <= ulp * unfused.float().abs() + 1e-6 * scale).all(), (m, dtype)
            separate = silu_mul(matmul(x, gate), matmul(x, up))  # other launch configurations: other K orders
            assert ((y.float() - separate.float()).abs().max() / scale).item() < 2e-2, (m, dtype)


@pytest.mark.gpu
@gpu
def test_glu_linear_in_a_cuda_graph():
    """A decode step's GLU launch replays in a graph (the MLP of a captured step)."""
    gate, up = _pair(QType.Q4_K, 17408, 5120, "cuda")
    linear = GluLinear.of(QuantLinear(gate, True), QuantLinear(up, True))
    assert linear is not None
    x = torch.randn(1, 5120, device="cuda")
    want = linear(x).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x)
    x.mul_(-1.0)
    graph.replay()
    torch.testing.assert_close(out, linear(x), rtol=0, atol=0)  # the replay read the new x
    assert not torch.equal(out, want)


def _fragment_ordered(weight: QuantWeight) -> QuantLinear:
    """`weight` as a CUDA model holds it (fragment order), here on the CPU: what `GluLinear.of` looks for."""
    n, k = weight.shape
    return QuantLinear(QuantWeight(mma.to_mma_layout(weight.gguf_bytes(), weight.qtype, n, k), weight.qtype, (n, k),
                                   mma_layout=True))


def test_the_mlp_fuses_tensor_core_gate_and_up_into_one_glu_matmul(monkeypatch):
    """`MLP.fuse`: gate and up in the fragment layout become one `GluLinear` (no separate projections kept), and
    the MLP's output is the unfused MLP's; FLASHTREE_GLU=0 keeps them apart."""
    plain = _pair(QType.Q4_K, 256, 512)
    gate, up = (_fragment_ordered(w) for w in plain)
    down = QuantLinear(QuantWeight.from_gguf_bytes(_random_rows(QType.Q4_K, 512, 256, seed=3).reshape(-1),
                                                   QType.Q4_K, (512, 256)))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    fused = MLP(gate, up, down)
    fused.fuse()
    assert fused.glu is not None and fused.inputs is None
    want = down(silu_mul(*(QuantLinear(w)(x) for w in plain)))  # (fragment order multiplies on CUDA only)
    torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("FLASHTREE_GLU", "0")
    apart = MLP(gate, up, down)
    apart.fuse()
    assert apart.glu is None and apart.inputs is not None
