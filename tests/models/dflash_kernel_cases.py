"""The draft's block pass with its attention in `tree_attention`'s launch (`BlockRows`), against the SDPA
pass on the same weights and context, under the Triton interpreter in one process (TRITON_INTERPRET=1 must
be set before triton is imported, so test_dflash.py launches this file as a subprocess). Prints one JSON
object: case id -> max |kernel pass - SDPA pass| / max |SDPA pass|."""

import json
import os
import sys

import torch

from flashtree.models.dflash import DFlashDraft, DraftConfig
from tests.models import peaked_weights

CONTEXT, CHUNKS = 40, (17, 1, 22)


def draft(causal: bool) -> DFlashDraft:
    config = DraftConfig.from_json({
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "block_size": 8,
        "vocab_size": 32, "num_target_layers": 4, "is_causal": causal,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 3]}})
    return peaked_weights(lambda: DFlashDraft(config))


def block_pass(model: DFlashDraft, ring: int, graph_ready: bool, in_kernel: bool) -> torch.Tensor:
    """A filled ring (wrapped when ring < CONTEXT), then one block pass: eager, or graph-ready (device
    start and length, 8 more rows read than the valid ones where the ring has them)."""
    g = torch.Generator().manual_seed(1)
    features = torch.randn(CONTEXT, model.config.feature_size, generator=g)
    block = torch.randn(model.config.block_size, model.config.hidden_size, generator=g)
    cache, start = model.new_cache(ring), 0
    for n in CHUNKS:
        model.append_context(cache, features[start : start + n], torch.arange(start, start + n))
        start += n
    model._reads_rows_in_kernel = lambda device: in_kernel
    if not graph_ready:
        return model.forward_block(cache, block, CONTEXT)
    rows = min(cache.length + 8, cache.max_context)
    return model.forward_block(cache, block, torch.tensor([CONTEXT]), rows, torch.tensor([cache.length]))


def case_ids() -> list[str]:
    return [f"{'causal' if causal else 'full'}-ring{ring}-{'graph' if graph else 'eager'}"
            for causal in (False, True) for ring in (64, 24) for graph in (False, True)]


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    for case in case_ids():
        rule, ring, form = case.split("-")
        model = draft(rule == "causal")
        want = block_pass(model, int(ring[4:]), form == "graph", in_kernel=False)
        got = block_pass(model, int(ring[4:]), form == "graph", in_kernel=True)
        results[case] = ((got - want).abs().max() / want.abs().max()).item()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
