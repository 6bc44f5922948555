"""Run under TRITON_INTERPRET=1 (tests/engine/test_triton_path.py): the whole engine on the GPU code path --
quantized weights through quant_matmul, graph-ready static steps through tree_attention, the fused
gated-delta kernels -- on the CPU, printing tokens and logits for the parent test to compare with the
torch path."""

import json
import sys

import torch

from flashtree.engine.config import GenerationConfig
from flashtree.engine.cuda_graphs import GraphedForward
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target
from flashtree.models.layers import QuantLinear
from tests.drafting.test_lossless import random_draft

PROMPT = [3, 17, 99, 250, 8, 41, 7]
N_NEW = 12


def run(path: str, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    target = load_target(path, device="cpu", dtype=dtype)
    quantized = isinstance(target.model.layers[0].mlp.inputs.groups[0][0], QuantLinear)
    logits = target.model.forward(torch.tensor(PROMPT), target.model.new_cache(64)).logits.float()
    tokens = {}
    runs = [("ar", None), ("ddtree", None)]
    if dtype == torch.float32:  # a quantized cache, whose prefill also reads the cache in place
        runs.append(("ddtree", "q8_0"))
    for mode, cache_type in runs:
        engine = Engine(target, random_draft(target))
        engine.runner._graphs = GraphedForward(target.model, capture_graphs=False)
        config = GenerationConfig(max_new_tokens=N_NEW, mode=mode, budget=6, ignore_eos=True,
                                  cache_type_k=cache_type, cache_type_v=cache_type)
        tokens[mode if cache_type is None else f"{mode}-{cache_type}"] = engine.generate(PROMPT, config).token_ids
    return {"quantized": quantized, "logits": logits.tolist(), "tokens": tokens}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], getattr(torch, sys.argv[2]))))
