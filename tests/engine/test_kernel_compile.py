"""Load-time compilation of the tensor-core kernels: the weights it finds in a model and what it compiles."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QType

from flashtree.engine import loader
from flashtree.kernels.quant_matmul import QuantWeight
from flashtree.models.layers import Projections, QuantLinear, quant_weights


def _weight(n: int, k: int, mma_layout: bool = True) -> QuantWeight:
    return QuantWeight(torch.zeros(1, dtype=torch.uint8), QType.Q4_K, (n, k), mma_layout)


def test_every_weight_of_a_model_is_found_once():
    shared = _weight(32, 256)
    layer = Projections.separate([QuantLinear(shared), QuantLinear(_weight(64, 256))])
    found = quant_weights({"layers": [layer, layer], "head": QuantLinear(shared), "norm": torch.ones(4)})
    assert sorted(w.shape for w in found) == [(32, 256), (64, 256)]


def test_load_compiles_only_the_missing_fragment_ordered_shapes(monkeypatch):
    model = [QuantLinear(_weight(32, 256)), QuantLinear(_weight(64, 512)), QuantLinear(_weight(16, 256, False))]
    asked = {}
    monkeypatch.setattr(loader.mma, "arch_of", lambda device: "sm_90")
    monkeypatch.setattr(loader.mma, "sm_count", lambda device: 132)
    monkeypatch.setattr(loader.mma, "instances_for", lambda shapes, sms, dtype: asked.setdefault("shapes", shapes) and
                        [("a", "x"), ("b", "y")])
    monkeypatch.setattr(loader.mma, "uncompiled", lambda jobs, arch: jobs[1:])
    monkeypatch.setattr(loader.mma, "precompile", lambda jobs, arch, progress: asked.setdefault("jobs", jobs))
    loader.compile_tensor_core_kernels(model, torch.float32)
    assert asked == {"shapes": {(QType.Q4_K, 32, 256), (QType.Q4_K, 64, 512)}, "jobs": [("b", "y")]}


def test_the_walk_ends_on_a_whole_model():
    target = loader.random_target("tiny", scheme="q4_k_m", device="cpu")
    assert quant_weights(target.model) == []  # the CPU keeps dequantized Linear weights: nothing to compile
