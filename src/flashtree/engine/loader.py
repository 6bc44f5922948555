"""From a GGUF path to a ready target: validated config, tokenizer, chat template, weights on a device."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed
from tqdm import tqdm

from flashtree.dist.placement import default_dtype, place_layers, resolve_device, resolve_placement
from flashtree.dist.tp import init_from_env, load_tp_model, serve_ranks
from flashtree.engine.generate import Engine, GenerationConfig
from flashtree.engine.memory_check import check_memory, check_rank_memory
from flashtree.errors import FlashtreeError
from flashtree.formats.chat_template import ChatTemplate
from flashtree.formats.gguf_file import GGUFFile
from flashtree.formats.tokenizer import Tokenizer, TokenizerSpec
from flashtree.models.dflash import DFlashDraft
from flashtree.models.gguf_config import check_tensor_types, read_config
from flashtree.models.qwen35 import Qwen35Model
from flashtree.models.qwen35_config import Qwen35Config


@dataclass
class Target:
    path: Path
    gguf: GGUFFile
    config: Qwen35Config
    model: Qwen35Model
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None


def load_target(path: str | Path, device: str | None = None, dtype: torch.dtype | None = None,
                progress: bool = False) -> Target:
    gguf, config, spec = _open_checked(path)
    tokenizer, template = tokenizer_and_template(spec)
    dev = resolve_device(device)
    model = Qwen35Model.load(gguf, config, dev, dtype or default_dtype(dev), progress=_progress_bar(config) if progress else None)
    return Target(Path(path), gguf, config, model, tokenizer, template)


def load_tp_target(path: str | Path, world: int, device: str | None = None, progress: bool = False) -> Target:
    """`load_target` for one rank of a tensor-parallel group of `world` processes: the rank's shard."""
    dev = init_from_env(device)
    if torch.distributed.get_world_size() != world:
        raise FlashtreeError(f"--tensor-parallel {world} but the process group has "
                             f"{torch.distributed.get_world_size()} ranks")
    gguf, config, spec = _open_checked(path)
    show = progress and torch.distributed.get_rank() == 0
    # on a GPU each layer is loaded there, still quantized, and sharded block-wise (host copies would be dense)
    model = load_tp_model(gguf, config, dev, default_dtype(dev), progress=_progress_bar(config) if show else None,
                          host=dev if dev.type == "cuda" else None)
    tokenizer, template = tokenizer_and_template(spec)
    return Target(Path(path), gguf, config, model, tokenizer, template)


def load_placed_target(path, device=None, progress: bool = False, gpus: int | None = None,
                       layer_split: str | Sequence[float] | None = None, tensor_parallel: int = 1, devices=None):
    """`load_target` plus the placement options of `load_engine`."""
    if tensor_parallel and tensor_parallel > 1:
        if gpus not in (None, 1) or layer_split is not None:
            raise FlashtreeError("--tensor-parallel does not combine with --gpus / --layer-split yet")
        return load_tp_target(path, tensor_parallel, device, progress=progress)
    devs, split = resolve_placement(device, gpus, layer_split, devices)
    if devs is None:
        return load_target(path, device, progress=progress)
    # load on the host, then move each layer to its device: no device ever holds more than its share
    target = load_target(path, "cpu", dtype=default_dtype(devs[0]), progress=progress)
    place_layers(target.model, devs, split)
    return target


def _open_checked(path: str | Path) -> tuple[GGUFFile, Qwen35Config, TokenizerSpec]:
    """The file, its config and its tokenizer spec, refused before any weight is read when a tensor type is
    unsupported or the tokenizer is missing."""
    gguf = GGUFFile(path)
    config, spec = read_config(gguf)
    check_tensor_types(gguf, config)
    if spec is None:
        raise FlashtreeError(f"{gguf.path}: no tokenizer in the file (tokenizer.ggml.tokens missing)")
    return gguf, config, spec


def tokenizer_and_template(spec: TokenizerSpec) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer and chat template (None if the spec has none) a target uses, from its spec."""
    template = ChatTemplate(spec.chat_template, eos_token=_token_text(spec, spec.eos_token_id)) if spec.chat_template else None
    return Tokenizer(spec), template


def _token_text(spec: TokenizerSpec, token_id: int | None) -> str:
    return spec.tokens[token_id] if token_id is not None and 0 <= token_id < len(spec.tokens) else ""


def _progress_bar(config: Qwen35Config):
    bar = tqdm(total=config.num_layers, desc="loading layers", unit="layer", leave=False)

    def update(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


DEMO_DIR = Path(__file__).resolve().parent.parent / "assets"
DEMO_TARGET = DEMO_DIR / "demo-target.gguf"
DEMO_DRAFT = DEMO_DIR / "demo-draft"
DEMO_NAME = "demo"  # what --model takes for the embedded pair (as ollama names its models)


def is_demo(model: str | Path | None) -> bool:
    """No model, or the name `demo`: the embedded demo pair."""
    return model is None or str(model) == DEMO_NAME


def model_path(model: str | Path | None) -> str | Path:
    """The GGUF a --model value names: the embedded demo target for `demo` (or none)."""
    return DEMO_TARGET if is_demo(model) else model


def load_engine(model: str | Path | None = None, draft: str | Path | None = None, device: str | None = None,
                spec: str | None = None, budget: int = 22, topk: int = 8, progress: bool = False,
                cache_type_k: str | None = None, cache_type_v: str | None = None, attn_window: int = 0,
                gpus: int | None = None, layer_split: str | None = None, draft_device: str | None = None,
                tensor_parallel: int = 1, devices=None, enforce_eager: bool = False, ctx: int | None = None,
                gpu_memory: str | None = None):
    """Target (+ draft) ready to generate. No model means the embedded demo pair. The KV cache options
    become the engine's default GenerationConfig (checked before any weight is loaded).
    Placement (flashtree.dist, docs/MULTI_GPU.md): `gpus` / `layer_split` split the target's layers over
    devices (`devices` overrides cuda:0..N-1), `draft_device` puts the draft on its own device, and
    `tensor_parallel` > 1 shards the target over the ranks of the initialized process group. On CUDA the
    memory plan (`ctx` tokens, each GPU's free memory or the `gpu_memory` cap) is checked before loading."""
    if is_demo(model):
        if not DEMO_TARGET.is_file():
            raise FlashtreeError("no --model given and the embedded demo model is not installed; pass --model PATH.gguf")
        model = DEMO_TARGET
        if draft is None and DEMO_DRAFT.is_dir() and spec != "ar":
            draft = DEMO_DRAFT
    if spec in ("chain", "ddtree") and draft is None:
        raise FlashtreeError(f"--spec {spec} needs a draft model: pass --draft DIR or use --spec ar")
    cache_options = {"cache_type_k": cache_type_k, "cache_type_v": cache_type_v, "attn_window": attn_window}
    GenerationConfig(**cache_options)  # a bad KV type or window fails here, before loading
    if tensor_parallel and tensor_parallel > 1:
        _check_rank_memory(model, draft, device, tensor_parallel, ctx, gpu_memory, budget, cache_options)
    else:
        _check_memory(model, draft, device, gpus, layer_split, devices, draft_device, ctx, gpu_memory, budget,
                      cache_options)
    target = load_placed_target(model, device, progress, gpus, layer_split, tensor_parallel, devices)
    engine = engine_from_target(target, draft, spec=spec, budget=budget, topk=topk, draft_device=draft_device,
                                enforce_eager=enforce_eager, **cache_options)
    if tensor_parallel and tensor_parallel > 1:  # rank 0 gets the engine back; the other ranks follow it and exit
        return serve_ranks(engine)
    return engine


def _check_rank_memory(model, draft, device, world, ctx, gpu_memory, budget, cache_options) -> None:
    """This rank's share of tensor parallel, checked on the GPU the rank will use (LOCAL_RANK, as
    `dist.tp.init_from_env` picks it) before any weight is read."""
    if not torch.cuda.is_available() or (device not in (None, "auto") and not str(device).startswith("cuda")):
        return
    check_rank_memory(model, draft, torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))), world, ctx,
                      gpu_memory, budget, cache_options["cache_type_k"], cache_options["cache_type_v"])


def _check_memory(model, draft, device, gpus, layer_split, devices, draft_device, ctx, gpu_memory, budget,
                  cache_options) -> None:
    """The placement `load_placed_target` will make, planned and checked against the GPUs' memory."""
    stages, split = resolve_placement(device, gpus, layer_split, devices)
    if stages is None:
        stages = [resolve_device(device)]
    elif split is None:
        split = [1.0] * len(stages)
    check_memory(model, draft, stages, split, resolve_device(draft_device) if draft_device else None, ctx, gpu_memory,
                 budget, cache_options["cache_type_k"], cache_options["cache_type_v"])


def engine_from_target(target: Target, draft: str | Path | None = None, spec: str | None = None, budget: int = 22,
                       topk: int = 8, draft_device: str | None = None, cache_type_k: str | None = None,
                       cache_type_v: str | None = None, attn_window: int = 0, enforce_eager: bool = False):
    """An Engine over a loaded target (a file's or `random_target`'s), with the draft at `draft` if given;
    the mode defaults to ddtree with a draft, else ar. `enforce_eager` turns CUDA graphs off."""
    if spec in ("chain", "ddtree") and draft is None:
        raise FlashtreeError(f"--spec {spec} needs a draft model: pass --draft DIR or use --spec ar")
    cache_options = {"cache_type_k": cache_type_k, "cache_type_v": cache_type_v, "attn_window": attn_window}
    GenerationConfig(**cache_options)
    draft_model = load_draft(draft, target, draft_device) if draft is not None else None
    mode = spec or ("ddtree" if draft_model is not None else "ar")
    engine = Engine(target, draft_model, GenerationConfig(mode=mode, budget=budget, topk=topk, **cache_options))
    engine.draft_path = Path(draft) if draft_model is not None else None
    engine.use_cuda_graphs = not enforce_eager
    return engine


def load_draft(path: str | Path, target: Target, device: str | None = None):
    device = resolve_device(device) if device is not None else target.model.device  # --draft-device
    draft = DFlashDraft.load(path, device=device, dtype=target.model.dtype)
    c = target.config
    draft.check_target(c.hidden_size, c.vocab_size, c.num_layers)
    return draft
