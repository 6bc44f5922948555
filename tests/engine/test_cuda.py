"""The same code on a CUDA device: logits against the CPU float32 run, and greedy spec == AR."""

import pytest
import torch

from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.models.synthetic import tiny_config
from tests.drafting.test_lossless import OracleProposer, random_draft
from tests.models.test_qwen35 import VARIANTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIG = tiny_config(hidden_size=256, intermediate_size=512, head_dim=64, rope_dim=16, num_heads=4, num_kv_heads=1,
                     gdn_head_dim=32, gdn_qk_heads=2, gdn_v_heads=6, num_layers=8)


@pytest.fixture(scope="module")
def gguf_path(make_gguf):
    return make_gguf("cuda-q4km", config=CONFIG, scheme="q4_k_m")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
def test_cuda_logits_match_cpu(gguf_path, dtype, tol):
    ids = torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(0))
    cpu = load_target(gguf_path, device="cpu")
    gpu = load_target(gguf_path, device="cuda", dtype=dtype)
    ref = cpu.model.forward(ids, cpu.model.new_cache(128)).logits
    out = gpu.model.forward(ids, gpu.model.new_cache(128)).logits.cpu()
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() < tol * scale
    if dtype == torch.float32:
        assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant", ["q8_0", "q4_k_m", "mixed-types"])
def test_bf16_logits_stay_as_close_as_transformers_bf16(make_gguf, variant):
    """bf16 on the GPU against the CPU's float32 logits on the test models (every quant type among them):
    within 3 % of the largest logit (issue #19's bar) or, where bf16 itself cannot hold that on random
    weights, within 1.5x of transformers' bf16 error on the same weights; and the same argmax on 97 % of the
    positions whose float32 top two are more than 0.1 apart. Measured 2026-12-01 (q8_0, q4_k_m, mixed-types):
    ours on an H200 4.1 %, 12.8 %, 3.1 %; transformers' bf16 on the CPU 7.8 %, 10.9 %, 2.3 % (this form of
    the test, with the peer on the GPU, has not yet run on one)."""
    pytest.importorskip("transformers")  # the peer: the test extra
    from flashtree.bench.fidelity import peer_logits
    from flashtree.train.convert import hf_model_from_gguf

    path = make_gguf(variant, **VARIANTS[variant])
    ids = torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(1))
    cpu = load_target(path, device="cpu")
    gpu = load_target(path, device="cuda", dtype=torch.bfloat16)
    ref = cpu.model.forward(ids, cpu.model.new_cache(128)).logits
    out = gpu.model.forward(ids, gpu.model.new_cache(128)).logits.float().cpu()
    hf, _ = hf_model_from_gguf(path)
    # on the GPU too: where fla-core is installed, transformers' DeltaNet runs its Triton kernels, CUDA only
    peer = peer_logits(hf.to("cuda", torch.bfloat16).eval(), ids.tolist())
    scale = ref.abs().max().item()
    error, peer_error = (out - ref).abs().max().item() / scale, (peer - ref).abs().max().item() / scale
    assert error <= max(0.03, 1.5 * peer_error), f"bf16 error {error:.2%}, transformers' {peer_error:.2%}"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    agree = (out.argmax(-1)[clear] == ref.argmax(-1)[clear]).float().mean().item()
    assert agree >= 0.97, f"argmax agrees on {agree:.1%} of {int(clear.sum())} clear positions"


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_cuda_float32_speculative_equals_autoregressive(gguf_path, mode):
    target = load_target(gguf_path, device="cuda", dtype=torch.float32)
    prompt = list(range(3, 30))
    expected = Engine(target).generate(prompt, GenerationConfig(max_new_tokens=120, ignore_eos=True)).token_ids
    config = GenerationConfig(max_new_tokens=120, mode=mode, budget=22, ignore_eos=True)
    oracle = OracleProposer(prompt + expected, target.config.vocab_size, seed=0)
    assert Engine(target, oracle).generate(prompt, config).token_ids == expected
    assert Engine(target, random_draft(target).cuda()).generate(prompt, config).token_ids == expected
