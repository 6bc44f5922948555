import numpy as np
import pytest
import torch

from flashtree.engine.loader import load_target
from flashtree.formats.gguf_file import GGUFFile
from flashtree.formats.tokenizer import UNUSED
from flashtree.models.layers import load_weight
from flashtree.train.convert import gguf_tensors_from_hf, grouped_to_tiled, hf_model_from_gguf
from flashtree.train.target import export_gguf


def _prompt_ids(target):
    return target.tokenizer.encode("<|im_start|>user\ndef loads(s):<|im_end|>\n<|im_start|>assistant\nreturn s")


def test_grouped_to_tiled_is_the_inverse_of_the_converter_order():
    hk, hv = 2, 6
    order = grouped_to_tiled(hk, hv)
    # tiled slot t holds a value head of key head t % hk
    assert [g // (hv // hk) for g in order] == [t % hk for t in range(hv)]
    assert sorted(order) == list(range(hv))


def test_f32_export_matches_the_trained_hf_model(tiny_target):
    r = tiny_target
    assert r["config"].gdn_qk_heads != r["config"].gdn_v_heads  # the value-head reorder is exercised
    assert len(r["losses"]) == 4 and all(np.isfinite(r["losses"]))
    target = load_target(r["path"], "cpu", dtype=torch.float32)
    assert target.config.recurrent_layers == r["config"].recurrent_layers
    assert target.config.gdn_v_heads == r["config"].gdn_v_heads
    assert any(t == UNUSED for t in target.tokenizer.spec.token_types)  # padding ids (the draft's mask token)
    ids = _prompt_ids(target)
    ours = target.model.forward(torch.tensor(ids), target.model.new_cache(len(ids) + 1)).logits
    with torch.no_grad():
        ref = r["model"](input_ids=torch.tensor([ids])).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_q4_k_m_export_loads_and_round_trips_through_hf(tiny_target, tmp_path):
    r = tiny_target
    path = export_gguf(r["model"], r["config"], r["tokenizer"], tmp_path / "q.gguf", scheme="q4_k_m")
    target = load_target(path, "cpu", dtype=torch.float32)
    ids = _prompt_ids(target)
    ours = target.model.forward(torch.tensor(ids), target.model.new_cache(len(ids) + 1)).logits
    with torch.no_grad():
        ref = r["model"](input_ids=torch.tensor([ids])).logits[0].float()
    assert torch.isfinite(ours).all()
    assert (ours - ref).abs().max() < 0.5 * ref.abs().max() + 0.05  # quantization error only
    # GGUF -> HF (dequantized weights) computes what flashtree computes, and maps back to the same tensors.
    hf, config = hf_model_from_gguf(path)
    with torch.no_grad():
        back = hf(input_ids=torch.tensor([ids])).logits[0].float()
    assert torch.allclose(ours, back, atol=1e-4, rtol=1e-4)
    gguf = GGUFFile(path)
    again = gguf_tensors_from_hf(hf, config)
    for name, array in again.items():
        stored = load_weight(gguf, name, array.shape, torch.float32, "cpu").numpy()
        np.testing.assert_allclose(array, stored, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("scheme", ["q4_k_m"])
def test_demo_shape_uses_k_quants(scheme):
    from flashtree.formats.quant_mix import quant_types
    from flashtree.models.synthetic import tensor_shapes
    from flashtree.train.target import TargetShape

    shape = TargetShape()
    types = quant_types(tensor_shapes(shape.config(), tied=shape.tied), scheme)
    names = {t.name for n, t in types.items() if n.endswith(".weight") and "norm" not in n and "conv" not in n}
    assert names <= {"Q4_K", "Q6_K"}, names
