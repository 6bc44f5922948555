"""The engine's GPU code path, end to end, in Triton's CPU interpreter: the same tokens and (nearly) the same
logits as the torch path, so the kernels are wired in right before any GPU time is spent."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.models.synthetic import tiny_config
from tests.engine.triton_path_cases import N_NEW, PROMPT

pytestmark = pytest.mark.slow  # the whole engine in Triton's interpreter: about two minutes


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_gpu_code_path_in_the_interpreter_matches_the_torch_path(make_gguf, dtype, tol):
    pytest.importorskip("triton")
    path = make_gguf("triton-path", config=tiny_config(num_layers=4, gdn_v_heads=4), scheme="q8_0")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    done = subprocess.run([sys.executable, "-m", "tests.engine.triton_path_cases", str(path), dtype], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    triton = json.loads(done.stdout)
    assert triton["quantized"]  # the weights really went through quant_matmul

    target = load_target(path, device="cpu")  # the float32 torch path is the reference for both
    reference = target.model.forward(torch.tensor(PROMPT), target.model.new_cache(64)).logits
    logits = torch.tensor(triton["logits"])
    assert (logits - reference).abs().max() < tol * reference.abs().max()
    if dtype == "float32":
        expected = Engine(target).generate(PROMPT, GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True)).token_ids
        q8 = GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True, cache_type_k="q8_0", cache_type_v="q8_0")
        expected_q8 = Engine(target).generate(PROMPT, q8).token_ids
        assert triton["tokens"] == {"ar": expected, "ddtree": expected, "ddtree-q8_0": expected_q8}
    else:  # bf16 rounds differently on the two paths: the run completes and speculative equals its own AR
        assert len(triton["tokens"]["ar"]) == N_NEW and triton["tokens"]["ddtree"] == triton["tokens"]["ar"]
