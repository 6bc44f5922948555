"""Load-time compilation of the CUDA kernels: the weights it finds in a model and what it compiles (the tensor-core
instances, the cluster add + RMSNorm)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from flashtree.engine import loader
from flashtree.kernels import cuda_functions, rms_norm
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
    monkeypatch.setattr(loader.mma, "instances_for",
                        lambda shapes, sms, dtype, glu: asked.setdefault("shapes", shapes)
                        and [("a", "x"), ("b", "y")])
    monkeypatch.setattr(loader.cuda_functions, "uncompiled", lambda jobs, arch: jobs[1:])
    monkeypatch.setattr(loader.cuda_functions, "precompile",
                        lambda jobs, arch, progress: asked.setdefault("jobs", [name for name, _ in jobs]))
    loader.compile_cuda_kernels(model, torch.float32)  # CPU weights: no cluster norm job
    assert asked == {"shapes": {(QType.Q4_K, 32, 256), (QType.Q4_K, 64, 512)}, "jobs": ["b"]}


def test_load_compiles_the_block_types_tensor_core_launches_of_each_shape(monkeypatch):
    blocks = [QuantWeight(torch.zeros(1, dtype=torch.uint8), qtype, shape)
              for qtype, shape in ((QType.Q8_0, (32, 256)), (QType.Q8_0, (64, 512)), (QType.IQ4_XS, (32, 256)))]
    model = [QuantLinear(w) for w in blocks + [blocks[0]]] + [QuantLinear(_weight(16, 256, False))]
    asked = {}
    monkeypatch.setattr(loader.mma, "arch_of", lambda device: "sm_90")
    monkeypatch.setattr(loader.mma, "sm_count", lambda device: 132)
    monkeypatch.setattr(loader.block32_mma, "takes", lambda qtype, shape, device: qtype != QType.Q4_K)
    monkeypatch.setattr(loader.block32_mma, "cuda_jobs",
                        lambda shapes, sms, dtype: asked.setdefault("shapes", shapes) and [("q8", "src")])
    monkeypatch.setattr(loader.cuda_functions, "uncompiled", lambda jobs, arch: jobs)
    monkeypatch.setattr(loader.cuda_functions, "precompile",
                        lambda jobs, arch, progress: asked.setdefault("jobs", [name for name, _ in jobs]))
    loader.compile_cuda_kernels(model, torch.bfloat16)
    assert asked == {"shapes": [(QType.Q8_0, 32, 256), (QType.Q8_0, 64, 512), (QType.IQ4_XS, 32, 256)], "jobs": ["q8"]}


def test_load_compiles_the_cluster_norm_where_the_model_launches_it(monkeypatch):
    """A model with no fragment-ordered weights still gets the cluster add + RMSNorm compiled at load when its
    float32 activations take it, and only then."""
    monkeypatch.setattr(rms_norm, "_clusters_available", lambda device: True)
    cuda = torch.device("cuda", 0)
    assert [name for name, _ in rms_norm.cuda_jobs(cuda, torch.float32)] == ["add_rms_norm_f32"]
    assert ([name for name, _ in rms_norm.cuda_jobs(cuda, torch.float32, {QType.Q6_K, QType.Q8_0})]
            == ["add_rms_norm_f32", "add_rms_norm_f32_q6_k"])
    assert rms_norm.cuda_jobs(cuda, torch.bfloat16) == [] and rms_norm.cuda_jobs("cpu", torch.float32) == []
    asked = {}
    monkeypatch.setattr(loader.mma, "arch_of", lambda device: "sm_90")
    monkeypatch.setattr(loader.cuda_functions, "precompile",
                        lambda jobs, arch, progress: asked.setdefault("jobs", [name for name, _ in jobs]))
    model = SimpleNamespace(device=cuda)
    monkeypatch.setattr(loader.cuda_functions, "uncompiled", lambda jobs, arch: jobs)
    loader.compile_cuda_kernels(model, torch.float32)
    assert asked == {"jobs": ["add_rms_norm_f32"]}


def test_the_cluster_norm_compiles_where_its_launch_looks_for_it(tmp_path, monkeypatch):
    """The load-time compile writes the cubin at the path `load_function` reads (NVRTC, no GPU needed)."""
    pytest.importorskip("cuda.bindings")
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(rms_norm, "_clusters_available", lambda device: True)
    jobs = rms_norm.cuda_jobs(torch.device("cuda", 0), torch.float32)
    assert cuda_functions.uncompiled(jobs, "sm_90") == jobs
    cuda_functions.precompile(jobs, "sm_90", workers=1)
    name, source = jobs[0]
    assert cuda_functions.cubin_path(name, rms_norm.cluster_source(), "sm_90").read_bytes()[:4] == b"\x7fELF"
    assert cuda_functions.uncompiled(jobs, "sm_90") == []


def test_the_walk_ends_on_a_whole_model():
    target = loader.random_target("tiny", scheme="q4_k_m", device="cpu")
    assert quant_weights(target.model) == []  # the CPU keeps dequantized Linear weights: nothing to compile
