"""The shipped demo pair: lossless in every mode, and its draft runs in the z-lab reference too."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flashtree.engine.config import EngineArgs, GenerationConfig
from flashtree.engine.loader import DEMO_DRAFT, DEMO_TARGET, load_engine

pytestmark = pytest.mark.skipif(not DEMO_TARGET.is_file(), reason="demo pair not installed")


@pytest.fixture(scope="module")
def engine():
    return load_engine(EngineArgs(device="cpu"))


def test_demo_pair_is_lossless_and_accepts(engine):
    prompt = engine.encode_prompt("def fib(n):", enable_thinking=False)
    outputs = {}
    for mode in ("ar", "chain", "ddtree"):
        # trees every step (adaptive off): the acceptance measured is the draft's
        result = engine.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=48, ignore_eos=True, adaptive=False))
        outputs[mode] = result.token_ids
        if mode == "ddtree":
            assert result.stats.acceptance_length > 2.0  # the draft was trained for this target
    assert outputs["ar"] == outputs["chain"] == outputs["ddtree"]


def test_demo_draft_matches_the_zlab_reference(engine):
    dflash_model = pytest.importorskip("dflash.model")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

    config = json.loads((DEMO_DRAFT / "config.json").read_text())
    reference = dflash_model.DFlashDraftModel(Qwen3Config(**config)).float().eval()
    missing, unexpected = reference.load_state_dict(
        {k: v.float() for k, v in load_file(str(DEMO_DRAFT / "model.safetensors")).items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]

    target, draft = engine.target.model, engine.draft.float()
    prompt = torch.tensor(engine.encode_prompt("def is_prime(n):"))
    ids = draft.config.target_layer_ids
    features = target.forward(prompt, target.new_cache(len(prompt) + 1), capture=ids).features
    block = torch.full((draft.config.block_size,), draft.config.mask_token_id)
    block[0] = int(prompt[-1])
    embeddings = target.embed_tokens(block).float()
    start = len(prompt)

    cache = draft.new_cache(4096, torch.device("cpu"))
    draft.append_context(cache, features.float(), torch.arange(start))
    ours = draft.forward_block(cache, embeddings, start)
    with torch.no_grad():
        ref = reference(position_ids=torch.arange(0, start + len(block))[None], noise_embedding=embeddings[None],
                        target_hidden=features.float()[None], use_cache=False)[0]
    cos = torch.nn.functional.cosine_similarity(ours, ref.float(), dim=-1)
    assert cos.min().item() > 0.9999
    head = target.lm_head.weight.float()
    assert torch.equal((ours @ head.T).argmax(-1), (ref.float() @ head.T).argmax(-1))
