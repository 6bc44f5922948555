"""A bf16 model's activations are float32 between kernels, its matmuls round x to float16, and only the KV
cache and attention stay bf16 (issue #19, docs/FIDELITY.md design D)."""

import pytest
import torch

from flashtree.bench.fidelity import compare, teacher_forced
from flashtree.engine.loader import load_target
from flashtree.kernels.quant_matmul import f16_rows, round_rows_f16
from flashtree.models.qwen35 import DecoderLayer
from flashtree.models.layers import Linear, QuantLinear, activation_dtype, quant_weights, reachable
from flashtree.models.synthetic import tiny_config, write_synthetic_gguf


def _linears(model):
    return reachable(model, (Linear, QuantLinear))


@pytest.fixture(scope="module", params=["q8_0", "q4_k_m"])
def tiny_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / f"tiny-{request.param}.gguf"
    write_synthetic_gguf(str(path), tiny_config(), scheme=request.param)
    return path


def test_activation_dtype():
    assert activation_dtype(torch.bfloat16) == activation_dtype(torch.float16) == torch.float32
    assert activation_dtype(torch.float32) == torch.float32


def test_f16_rows_rounds_as_float16_without_overflow():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [1e-3], [1e6]])
    # the last row overflows a plain float16, the second's smallest values are its subnormals
    scaled, unscale = f16_rows(x)
    assert scaled.dtype == torch.float16 and torch.isfinite(scaled).all()
    assert scaled.abs().amax(-1).min() >= 1 and scaled.abs().amax(-1).max() < 2
    normal = (x.abs() >= 2**-14) & (x.abs() < 2**15)
    assert torch.equal(round_rows_f16(x)[normal], x[normal].half().float())  # float16's own rounding in its range
    assert ((round_rows_f16(x) - x).abs() <= x.abs() * 2**-11).all()
    assert torch.equal(round_rows_f16(torch.zeros(1, 8)), torch.zeros(1, 8))


def test_float32_model_is_unchanged(tiny_gguf):
    model = load_target(tiny_gguf, device="cpu", dtype=torch.float32).model
    assert model.act_dtype == torch.float32
    assert not any(linear.rounded_input for linear in _linears(model))


def test_bf16_model_activations_are_float32(tiny_gguf, monkeypatch):
    model = load_target(tiny_gguf, device="cpu", dtype=torch.bfloat16).model
    assert model.dtype == torch.bfloat16 and model.act_dtype == torch.float32
    linears = _linears(model)
    assert linears and all(linear.rounded_input for linear in linears)
    # the CPU keeps every dense weight exact (never below float16)
    assert all(linear.weight.dtype == torch.float32 for linear in linears if type(linear) is Linear)
    assert not quant_weights(model)  # the CPU dequantizes at load

    seen = []
    original = DecoderLayer.__call__

    def recorded(self, h, delta, step, cache):
        seen.append(h.dtype)  # the residual stream coming in (the embedding rows for the first layer)
        h, delta = original(self, h, delta, step, cache)
        seen.append(delta.dtype)  # the MLP's output
        return h, delta

    monkeypatch.setattr(DecoderLayer, "__call__", recorded)
    cache = model.new_cache(16)
    out = model.forward(torch.arange(8), cache, capture=range(model.config.num_layers))
    assert seen == [torch.float32] * (2 * model.config.num_layers)
    assert out.features.dtype == torch.float32 and out.logits.dtype == torch.float32
    assert all(state.conv.dtype == torch.float32 for state in cache.deltanet.values())
    assert all(kv.k.dtype == kv.v.dtype == torch.bfloat16 for kv in cache.attention.values())


def test_bf16_fidelity_on_a_random_model(tiny_gguf):
    """Within the bar of 3 % of the largest logit, greedy agreeing where the reference decides (the design
    measured 0.28-0.45 % on these models; bf16 activations were 4.8-9.1 %)."""
    reference = load_target(tiny_gguf, device="cpu", dtype=torch.float32)
    target = load_target(tiny_gguf, device="cpu", dtype=torch.bfloat16)
    ids = torch.randint(0, reference.model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(0))
    row = compare(teacher_forced(target, ids.tolist()), teacher_forced(reference, ids.tolist()))
    assert row["max_rel_logit_error"] < 0.03
    assert row["argmax_agree_decided"] == row["decided_positions"]


def test_quant_matmul_rounded_on_the_cpu():
    """The torch path of a quantized weight: float16-rounded x times the exact weight, float32 out."""
    from gguf import GGMLQuantizationType as Q

    from flashtree.formats.quants import quantize
    from flashtree.kernels.quant_matmul import QuantWeight, quant_matmul_rounded

    w = torch.randn(16, 64)
    raw = torch.from_numpy(quantize(w.numpy(), Q.Q8_0)).reshape(-1)
    weight = QuantWeight.from_gguf_bytes(raw, Q.Q8_0, (16, 64))
    x = torch.randn(3, 64) * 300
    y = quant_matmul_rounded(x, weight)
    assert y.dtype == torch.float32
    assert torch.equal(y, round_rows_f16(x) @ weight.dequantize(torch.float32).T)


def test_long_prefill_chunks_keep_the_model_dtype(tiny_gguf):
    """Chunks of DENSE_MIN_M tokens and more run in bf16 activations (`Qwen35Model.forward_dtype`: their GEMMs
    are compute-bound and float32 activations cost the 27B prefill 30 %), and the forward after one continues
    in float32 on the state it left: within bf16's error of the float32 model."""
    from flashtree.kernels.quant_matmul import DENSE_MIN_M

    model = load_target(tiny_gguf, device="cpu", dtype=torch.bfloat16).model
    reference = load_target(tiny_gguf, device="cpu", dtype=torch.float32).model
    assert model.forward_dtype(DENSE_MIN_M) == torch.bfloat16 and model.forward_dtype(DENSE_MIN_M - 1) == torch.float32
    assert reference.forward_dtype(DENSE_MIN_M) == torch.float32
    ids = torch.randint(0, model.config.vocab_size, (DENSE_MIN_M + 8,), generator=torch.Generator().manual_seed(0))
    seen = []
    original = DecoderLayer.__call__

    def recorded(self, h, delta, step, cache):
        seen.append(h.dtype)
        return original(self, h, delta, step, cache)

    outs = []
    for m in (model, reference):
        cache = m.new_cache(len(ids))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DecoderLayer, "__call__", recorded)
            m.forward(ids[:DENSE_MIN_M], cache)
        outs.append(m.forward(ids[DENSE_MIN_M:], cache).logits)  # 8 tokens: float32 activations again
    assert seen[:model.config.num_layers] == [torch.bfloat16] * model.config.num_layers
    assert outs[0].dtype == torch.float32
    error = ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item()
    assert 0 < error < 0.1
