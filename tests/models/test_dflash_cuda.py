"""The DFlash draft on CUDA: its block pass, eager and captured as a CUDA graph, against the float32 CPU
pass on the same random weights, and a bound on the launches of a captured block pass (the pass was ~400
small kernels before it used the fused ones; the bound keeps that from creeping back)."""

import copy

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from flashtree.models.dflash import DFlashDraft, DraftConfig
from tests.models import peaked_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYER_TYPES = ("full_attention", "sliding_attention", "full_attention")  # sliding layers: causal, windowed
FULL_LAYERS = ("full_attention",) * 3
CONTEXT = 60  # committed positions, appended in the chunks below
CHUNKS = (23, 1, 36)
START = CONTEXT  # the block's first position


def random_draft(layer_types=LAYER_TYPES) -> DFlashDraft:
    """Float32 weights that bf16 holds exactly (so CPU and GPU differ only in activation rounding), scaled
    so that attention is peaked, with the 27B draft's heads of 128. Full-attention layers only: the block
    pass attends in `tree_attention` (`BlockRows`); with windowed layers, through SDPA."""
    config = DraftConfig.from_json({
        "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": len(layer_types),
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1e7, "block_size": 16, "vocab_size": 64, "num_target_layers": 8,
        "layer_types": list(layer_types), "sliding_window": 24, "use_sliding_window": True,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 3, 5]}})
    return peaked_weights(lambda: DFlashDraft(config)).bfloat16().float()


def inputs(config: DraftConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    features = torch.randn(CONTEXT, config.feature_size, generator=g)
    return features.bfloat16().float(), torch.randn(config.block_size, config.hidden_size, generator=g).bfloat16().float()


def filled_cache(draft: DFlashDraft, features: torch.Tensor, ring: int):
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    cache = draft.new_cache(ring)
    start = 0
    for n in CHUNKS:
        draft.append_context(cache, features[start : start + n].to(device, dtype), torch.arange(start, start + n))
        start += n
    return cache


def captured_block(draft: DFlashDraft, cache, embeddings: torch.Tensor, rows: int):
    """The graph-ready block pass (device start and length, `rows` context slots read) captured as a CUDA
    graph, and the buffer its replays write."""
    start = torch.tensor([START], device="cuda")
    length = torch.tensor([cache.length], device="cuda")
    draft.forward_block(cache, embeddings, start, rows, length)  # warm-up: Triton compiles, SDPA picks a kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = draft.forward_block(cache, embeddings, start, rows, length)
    return graph, out


@pytest.mark.parametrize("layer_types", [LAYER_TYPES, FULL_LAYERS])
@pytest.mark.parametrize("ring, rows", [(128, 64), (48, 48)])  # bucketed rows past the context; a wrapped ring
def test_cuda_block_pass_matches_the_float32_cpu_one(ring, rows, layer_types):
    cpu = random_draft(layer_types)
    gpu = copy.deepcopy(cpu).to("cuda", torch.bfloat16)
    features, embeddings = inputs(cpu.config)
    want = cpu.forward_block(filled_cache(cpu, features, ring), embeddings, START)
    cache = filled_cache(gpu, features, ring)
    block = embeddings.to("cuda", torch.bfloat16)
    eager = gpu.forward_block(cache, block, START)
    graph, captured = captured_block(gpu, cache, block, rows)
    graph.replay()
    for got in (eager, captured):
        assert got.dtype == torch.bfloat16
        cos = torch.nn.functional.cosine_similarity(got.float().cpu(), want, dim=-1)
        assert cos.min().item() > 0.999, cos
        assert (got.float().cpu() - want).abs().max().item() < 0.03 * want.abs().max().item()


# Launches of one block pass, by reading DFlashDraft.forward_block: per layer the norm (with the residual add
# from the second layer on), q/k/v projections, the K/V write (norm + RoPE), q's norm + RoPE, q folded by
# group, attention, its output unfolded, o_proj, the add + norm after attention, gate, up, SiLU * up, down.
LAUNCHES_PER_LAYER = 15
MATMULS_PER_LAYER = 7
# Once per pass: aranges of the positions, the block's rows and the slots (3), the positions' add, the RoPE
# table; the unfilled slots (1); for the position rules the query/key distance (repeat, cat, subtract: 3);
# per rule the mask's zeros and fills (full: 2; causal window: compare, compare, or, zeros, 2 fills: 6);
# the final add + norm.
LAUNCHES_PER_PASS = 3 + 1 + 1 + 1 + 3 + 2 + 6 + 1


@pytest.mark.parametrize("layer_types", [LAYER_TYPES, FULL_LAYERS])  # SDPA; tree_attention (fewer launches)
def test_a_captured_block_pass_launches_a_bounded_number_of_kernels(layer_types):
    draft = random_draft(layer_types).to("cuda", torch.bfloat16)
    features, embeddings = inputs(draft.config)
    cache = filled_cache(draft, features, 128)
    graph, _ = captured_block(draft, cache, embeddings.to("cuda", torch.bfloat16), 64)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    layers = draft.config.num_hidden_layers
    # cuBLAS may split a skinny matmul's K and reduce in a second kernel
    bound = layers * (LAUNCHES_PER_LAYER + MATMULS_PER_LAYER) + LAUNCHES_PER_PASS
    assert 0 < len(kernels) <= bound, (len(kernels), bound, kernels)
    # attention stays one fused kernel: no float32 score matmul or softmax of SDPA's math fallback
    assert not [name for name in kernels if "softmax" in name.lower() or "f32f32" in name], kernels
