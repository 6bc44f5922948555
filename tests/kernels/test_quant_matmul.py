"""Quantized matmul: layout round trip, errors, torch paths in-process; Triton kernels through the
interpreter in a subprocess (TRITON_INTERPRET must be set before triton is imported); real sizes on GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.formats import quants
from flashtree.kernels.quant_matmul import (KERNELS, PLAIN_TYPES, QuantWeight, quant_matmul,
                                            quant_matmul_reference, random_quant_weight)

from tests.kernels import quant_matmul_cases as cases

TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-3}  # of max |reference|; bf16: one output rounding


@pytest.fixture(scope="module")
def interpreter_errors():
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.quant_matmul_cases"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernel_matches_reference(interpreter_errors, case):
    dtype = "bfloat16" if "bfloat16" in case else "float32"
    assert interpreter_errors[case] <= TOLERANCE[dtype]


@pytest.mark.parametrize("qtype", list(KERNELS), ids=lambda t: t.name)
def test_relayout_round_trip_is_bit_exact(qtype):
    w = cases.weight(qtype)
    raw = torch.from_numpy(quants.quantize(np.random.default_rng(1).standard_normal(w.shape).astype(np.float32),
                                           qtype))
    packed = QuantWeight.from_gguf_bytes(raw, qtype, w.shape)
    assert packed.nbytes == raw.numel() and not torch.equal(packed.raw, raw.reshape(-1))
    assert torch.equal(packed.gguf_bytes(), raw)
    assert torch.equal(packed.dequantize(), quants.dequantize(raw, qtype, w.shape))


def test_torch_fallback_without_triton_matches_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = cases.weight(QType.Q4_K)
    x = torch.randn(3, w.shape[1])
    assert torch.allclose(quant_matmul(x, w), quant_matmul_reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", list(PLAIN_TYPES), ids=lambda t: t.name)
def test_plain_types_pass_through_to_torch(qtype):
    values = torch.randn(6, 64).to(PLAIN_TYPES[qtype])
    w = QuantWeight.from_gguf_bytes(values.view(torch.uint8).reshape(-1), qtype, (6, 64))
    x = torch.randn(2, 64)
    assert w.nbytes == values.numel() * values.element_size()
    assert torch.allclose(quant_matmul(x, w), x @ values.float().T, rtol=1e-5, atol=1e-5)
    assert torch.equal(w.dequantize(), values.float())


def test_errors_name_the_problem():
    raw = torch.zeros(2 * 144, dtype=torch.uint8)
    with pytest.raises(FlashtreeError, match="needs 288 bytes, got 287"):
        QuantWeight.from_gguf_bytes(raw[:-1], QType.Q4_K, (2, 256))
    with pytest.raises(FlashtreeError, match="multiple of 256"):
        QuantWeight.from_gguf_bytes(raw, QType.Q4_K, (2, 200))
    with pytest.raises(FlashtreeError, match=r"Q4_0 \(supported: Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS, F32, F16, BF16\)"):
        QuantWeight.from_gguf_bytes(raw, QType.Q4_0, (2, 256))
    with pytest.raises(FlashtreeError, match="uint8"):
        QuantWeight.from_gguf_bytes(raw.float(), QType.Q4_K, (2, 256))
    w = QuantWeight.from_gguf_bytes(raw, QType.Q4_K, (2, 256))
    with pytest.raises(FlashtreeError, match=r"x of shape \[M, 256\]"):
        quant_matmul(torch.zeros(1, 128), w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(5120, 5120), (17408, 5120)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", list(KERNELS), ids=lambda t: t.name)
def test_real_sizes_on_gpu(qtype, shape):
    w = random_quant_weight(qtype, *shape, device="cuda")
    dense = w.dequantize()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 8, 23, 64, 512):
        x = torch.randn(m, shape[1], generator=gen, device="cuda")
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            xd = x.to(dtype)
            ref = xd.float() @ dense.T
            err = ((quant_matmul(xd, w).float() - ref).abs().max() / ref.abs().max()).item()
            # large-M bf16 multiplies bf16-rounded weights on tensor cores
            bound = 1e-4 if dtype == torch.float32 else (2e-2 if m > 64 else 1e-2)
            assert err <= bound, (m, name, err)
