"""Layer (pipeline) split of the target over several devices in one process, llama.cpp `-sm layer` style.

Each DecoderLayer (its weights and its cache state) lives on one device; the embedding sits on the first
device (which is also where tokens go in and logits and features come out), the output norm and LM head on
the last. The hidden state hops between devices at the boundaries (`Qwen35Model.boundaries`). For one
sequence this adds memory capacity, not speed: the stages run one after another.
"""

from __future__ import annotations

from typing import Sequence

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import cpu_has_bf16_dot, indexed
from flashtree.models.layers import MATMUL_TYPES


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`auto` (or None): the first GPU if there is one, else the CPU; otherwise cpu, cuda or cuda:N, checked
    against the GPUs this torch sees. A GPU comes back indexed (`kernels.indexed`): with an unindexed one,
    the draft's "same device as the target?" check failed and its passes ran eagerly."""
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise FlashtreeError(f"unknown device {str(device)!r}; use cpu, cuda, cuda:N or auto")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise FlashtreeError(f"device {str(device)!r} requested but this torch has no CUDA device; use --device cpu")
        if dev.index is not None and dev.index >= count:
            raise FlashtreeError(f"device {str(device)!r} requested but this machine has {count} CUDA device(s): "
                                 f"cuda:0 to cuda:{count - 1}")
    return indexed(dev)


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def draft_dtype(target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dense draft's dtype on `device`: the target's, but bf16 beside a float32 target on a CPU that multiplies
    bf16 in hardware (`cpu_has_bf16_dot`). The draft only proposes, so the output stays the float32 target's; on
    the demo pair the draft step takes 4.1-4.3 ms instead of 7.8 and the speculative step 5 % less, at the same
    acceptance (2 threads, 2026-12-06, docs/PERFORMANCE.md)."""
    if target_dtype == torch.float32 and device.type == "cpu" and cpu_has_bf16_dot():
        return torch.bfloat16
    return target_dtype


def parse_split(text: str) -> list[float]:
    """'3,1' or '0.75,0.25' or '20,44' -> the numbers (proportions or layer counts per device)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FlashtreeError(f"--layer-split {text!r}: give comma-separated numbers, e.g. 1,1 or 20,44") from None
    if len(values) < 1 or any(v < 0 for v in values) or sum(values) <= 0:
        raise FlashtreeError(f"--layer-split {text!r}: give one non-negative number per device, not all zero")
    return values


def layer_counts(num_layers: int, split: Sequence[float]) -> list[int]:
    """Layers per device. Whole numbers summing to `num_layers` are taken as counts; anything else as
    proportions (llama.cpp --tensor-split), rounded on the cumulative sum so the counts add up."""
    if all(float(v).is_integer() for v in split) and sum(split) == num_layers:
        return [int(v) for v in split]
    total = float(sum(split))
    edges, acc = [0], 0.0
    for v in split:
        acc += v
        edges.append(round(num_layers * acc / total))
    edges[-1] = num_layers
    return [b - a for a, b in zip(edges, edges[1:])]


def parse_devices(spec: str | Sequence[str] | None, n: int) -> list[torch.device]:
    """Devices for a split: an explicit list (tests pass ["cpu", "cpu"]), or cuda:0..n-1."""
    if spec is None:
        if not torch.cuda.is_available() or torch.cuda.device_count() < n:
            raise FlashtreeError(f"a split over {n} devices needs {n} CUDA devices; "
                                 f"this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        return [torch.device("cuda", i) for i in range(n)]
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    return [resolve_device(x.strip() if isinstance(x, str) else x) for x in names]


def place_layers(model, devices: Sequence[str | torch.device], split: Sequence[float] | None = None):
    """Move `model`'s layers onto `devices` (in place; returns the model). `split`: layers per device as
    counts or proportions (default: even). Layers own their weights, so placing is moving them."""
    devices = [torch.device(d) for d in devices]
    split = list(split) if split is not None else [1.0] * len(devices)
    if len(split) != len(devices):
        raise FlashtreeError(f"--layer-split has {len(split)} entries for {len(devices)} devices")
    counts = layer_counts(len(model.layers), split)
    if any(c == 0 for c in counts):
        raise FlashtreeError(f"layer split {counts} leaves a device without layers; use fewer devices")
    stage_of = [s for s, c in enumerate(counts) for _ in range(c)]
    if not model.embed.on_host:  # a pinned host table serves the first stage where it is
        model.embed.raw_rows = model.embed.raw_rows.to(devices[0])
    model.device = devices[0]
    model.boundaries = {}
    for layer, stage in zip(model.layers, stage_of):
        move_layer(layer, devices[stage])
        if layer.index == 0 or stage != stage_of[layer.index - 1]:
            model.boundaries[layer.index] = devices[stage]
    model.output_norm = model.output_norm.to(devices[-1])
    model.lm_head = model.lm_head.to(devices[-1])
    model.layer_counts = counts
    return model


def move_layer(layer, device: torch.device) -> None:
    """Move every tensor a DecoderLayer owns (mixer, MLP, norms) to `device`."""
    layer.attn_norm, layer.post_norm = layer.attn_norm.to(device), layer.post_norm.to(device)
    for module in (layer.mixer, layer.mlp):
        _move_attributes(module, device)


def _move_attributes(obj, device: torch.device) -> None:
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(device))
        elif isinstance(value, MATMUL_TYPES):
            setattr(obj, name, value.to(device))


def describe(model) -> str:
    """'layers 0-15 on cuda:0, 16-31 on cuda:1' for logs."""
    parts, first = [], sorted(model.boundaries)
    for start, end in zip(first, first[1:] + [len(model.layers)]):
        parts.append(f"layers {start}-{end - 1} on {model.boundaries[start]}")
    return ", ".join(parts) if parts else f"all layers on {model.device}"


def resolve_placement(device=None, gpus: int | None = None, layer_split: str | Sequence[float] | None = None,
                      devices=None) -> tuple[list[torch.device] | None, list[float] | None]:
    """(the split's stage devices, its layer proportions or counts) for the placement options of
    `load_engine`, or (None, None) for a single device."""
    split = parse_split(layer_split) if isinstance(layer_split, str) else layer_split
    n = len(split) if split is not None else (gpus or 1)
    if gpus is not None and split is not None and gpus != len(split):
        raise FlashtreeError(f"--gpus {gpus} but --layer-split has {len(split)} entries")
    if n <= 1 and devices is None:
        return None, None
    if devices is None and device not in (None, "auto") and resolve_device(device).type == "cpu":
        devices = ["cpu"] * n  # a split over "cpu" stages: placement and boundaries without GPUs
    devs = parse_devices(devices, n)
    if devices is not None and split is None:
        n = len(devs)
    if len(devs) != n:
        raise FlashtreeError(f"{len(devs)} devices given for a split over {n}")
    return devs, split
