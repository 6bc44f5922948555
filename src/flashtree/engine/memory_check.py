"""The memory planner's check at load time: before any weight is read, a configuration whose plan does not
fit the GPUs it would use (their free memory, or a `--gpu-memory` cap per GPU) is refused with the numbers.
The plan counts the whole process: its tensors and, per GPU, the CUDA context and library workspaces held
outside PyTorch's allocator (`cuda_overhead`, engine/process_memory.py).

Only CUDA devices are checked (the CPU path dequantizes at load and has no fixed device memory); a
tensor-parallel rank checks its own share on its own GPU (`check_rank_memory`). Without
`--ctx` the check assumes DEFAULT_CTX tokens of context (a request sizes its own cache later), so it
catches what cannot work at all, not what a long request would need.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashtree.engine.config import DEFAULT_CUDA_OVERHEAD, DEFAULT_DRAFT_TYPE
from flashtree.kernels import indexed
from flashtree.kernels.host_rows import gpu_reads_host
from flashtree.parallel.placement import layer_counts
from flashtree.engine.planner import (DraftShape, PlanRequest, fmt_bytes, parse_size, per_rank, plan, refusal,
                                     target_from_gguf)
from flashtree.errors import FlashtreeError

DEFAULT_CTX = 4096


def check_rank_memory(model: str | Path, draft: str | Path | None, device: torch.device, world: int,
                      ctx: int | None, gpu_memory: str | None, budget: int, cache_type_k: str | None,
                      cache_type_v: str | None, cuda_overhead: int = DEFAULT_CUDA_OVERHEAD,
                      prefix_cache_device_bytes: int = 0, draft_type: str = DEFAULT_DRAFT_TYPE) -> None:
    """Raise FlashtreeError when one rank's share of `world`-way tensor parallel does not fit `device`."""
    if device.type != "cuda":
        return
    req = _request(model, draft, ctx, budget, cache_type_k, cache_type_v, cuda_overhead, prefix_cache_device_bytes,
                   draft_type, device)
    need = sum(per_rank(plan(req), world).values())
    (free,), source = _available([device], gpu_memory)
    if need > free:
        raise FlashtreeError(f"does not fit: one rank of tensor parallel {world} needs {fmt_bytes(need)} on {device} "
                             f"but {fmt_bytes(free)} is available ({source}, ctx {req.ctx}); try more ranks, a "
                             f"smaller --ctx or -ctk/-ctv q8_0, q4_0 or tq3_0 (`flashtree plan ... -tp {world}`)")


def _request(model, draft, ctx, budget, cache_type_k, cache_type_v, cuda_overhead,
             prefix_cache_device_bytes: int, draft_type: str, embed_device: torch.device) -> PlanRequest:
    """The plan request of this load; the embedding counted where `QuantizedEmbedding.load` will put it (pinned host
    memory where `embed_device`, a GPU, reads it in place)."""
    config, weights, embed, dense, layers = target_from_gguf(model)
    shape = DraftShape.from_dir(draft) if draft is not None else None
    return PlanRequest(config, weights, embed, shape, ctx or min(DEFAULT_CTX, config.context_length),
                       cache_type_k or "bf16", cache_type_v or "bf16", budget, dense_params=dense, layer_bytes=layers,
                       cuda_overhead=cuda_overhead, prefix_cache_device_bytes=prefix_cache_device_bytes,
                       draft_type=draft_type, embed_on_host=embed_device.type == "cuda"
                       and gpu_reads_host(indexed(embed_device)))


def check_memory(model: str | Path, draft: str | Path | None, target_devices: list[torch.device],
                 split: list[float] | None, draft_device: torch.device | None, ctx: int | None,
                 gpu_memory: str | None, budget: int, cache_type_k: str | None, cache_type_v: str | None,
                 cuda_overhead: int = DEFAULT_CUDA_OVERHEAD, prefix_cache_device_bytes: int = 0,
                 draft_type: str = DEFAULT_DRAFT_TYPE) -> None:
    """Raise FlashtreeError when the plan of `model` (+ `draft`, its layers held as `draft_type`) over
    `target_devices` (its layers split by `split`, counts or proportions as `--layer-split` takes them, or all
    on the one device) with the draft on `draft_device` (and a prefix cache's device budget, if it is on)
    does not fit."""
    devices = list(target_devices)
    draft_dev = draft_device if draft_device is not None else devices[0]
    if draft is not None and draft_dev not in devices:
        devices.append(draft_dev)
    if not any(d.type == "cuda" for d in devices):
        return
    req = _request(model, draft, ctx, budget, cache_type_k, cache_type_v, cuda_overhead, prefix_cache_device_bytes,
                   draft_type, devices[0])
    config, context = req.config, req.ctx
    available, source = _available(devices, gpu_memory)
    counts = layer_counts(config.num_layers, split) if split is not None else [config.num_layers]
    problem = refusal(plan(req), counts, devices.index(draft_dev), available, [str(d) for d in devices])
    if problem is not None:
        raise FlashtreeError(f"{problem}; memory from {source}" + ("" if ctx else f", at ctx {context} (no --ctx given)"))


def _available(devices: list[torch.device], gpu_memory: str | None) -> tuple[list[int], str]:
    """Bytes each device may use (the --gpu-memory cap, or its free memory; the CPU is not budgeted) and
    where that figure comes from."""
    if gpu_memory is not None:
        return [parse_size(gpu_memory)] * len(devices), "--gpu-memory"
    return [torch.cuda.mem_get_info(d)[0] if d.type == "cuda" else 1 << 62 for d in devices], "free GPU memory"
