"""kernels/cuda_functions: the NVRTC kernels' launches, programmatic dependent launch (PDL) included.

With PDL a kernel may start while the one before it on the stream finishes, and waits for it inside
(`griddepcontrol.wait`): a kernel that read its input before that wait would read the previous step's values. The
GPU test chains kernels that each read what the one before wrote, in a CUDA graph, and checks every link against the
same chain launched without PDL.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from flashtree.kernels import cuda_functions
from flashtree.kernels.quant_matmul import quant_matmul, random_quant_weight
from flashtree.kernels.rms_norm import add_rms_norm


def test_launch_configuration_asks_for_pdl_only_when_told():
    driver = pytest.importorskip("cuda.bindings.driver")
    plain = cuda_functions._config(driver, (4, 2), 128, 0, driver.CUstream(0), dependent=False)
    assert (plain.gridDimX, plain.gridDimY, plain.blockDimX, plain.numAttrs) == (4, 2, 128, 0)
    dependent = cuda_functions._config(driver, (4, 2), 128, 1024, driver.CUstream(0), dependent=True)
    assert dependent.numAttrs == 1 and dependent.sharedMemBytes == 1024
    attribute = dependent.attrs[0]
    assert attribute.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attribute.value.programmaticStreamSerializationAllowed == 1


def _chain(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, weights) -> list[torch.Tensor]:
    """A decode step's pattern: matmul (1 or 23 rows) -> residual add + norm -> matmul -> ..., each reading the last."""
    outputs = []
    for up, down in weights:
        delta = quant_matmul(quant_matmul(x, up)[:, : down.shape[1]].contiguous(), down)
        h, x = add_rms_norm(h, delta, w, 1e-6)
        outputs += [delta, h, x]
    return outputs


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="needs a Hopper GPU (programmatic dependent launch)")
@pytest.mark.parametrize("rows", [1, 23])
def test_dependent_launches_read_what_the_kernel_before_wrote(monkeypatch, rows):
    """The chain's graph replayed on one input, then on another: every intermediate then holds the first input's
    values until its kernel rewrites it, so a link that read before its predecessor finished would differ from the
    chain launched without PDL on the second input."""
    dev = torch.device("cuda")
    weights = [(random_quant_weight(QType.Q4_K, 2048, 1024, dev, seed=2 * i),
                random_quant_weight(QType.Q6_K, 1024, 2048, dev, seed=2 * i + 1)) for i in range(6)]
    w = 1 + 0.1 * torch.randn(1024, device=dev)
    first, second = ([torch.randn(rows, 1024, device=dev) for _ in range(2)] for _ in range(2))

    monkeypatch.setattr(cuda_functions, "dependent_launches", lambda device: False)
    want = _chain(*second, w, weights)
    monkeypatch.setattr(cuda_functions, "dependent_launches", lambda device: True)
    assert all(torch.equal(a, b) for a, b in zip(_chain(*second, w, weights), want))  # eager, with PDL
    x, h = (t.clone() for t in first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _chain(x, h, w, weights)
    graph.replay()
    x.copy_(second[0])
    h.copy_(second[1])
    graph.replay()
    torch.cuda.synchronize()
    assert len(outputs) == 18
    for i, (a, b) in enumerate(zip(outputs, want)):
        assert torch.equal(a, b), i
