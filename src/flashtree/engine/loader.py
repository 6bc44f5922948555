"""From a GGUF path to a ready target: validated config, tokenizer, chat template, weights on a device."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from flashtree.parallel.placement import (default_dtype, draft_dtype, place_layers, resolve_device,
                                         resolve_placement)
from flashtree.parallel.tp import RankShard, check_placement, join_group, rank_device, serve_ranks
from flashtree.engine.config import DEFAULT_DRAFT_TYPE, DENSE_DRAFT, EngineArgs, GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.memory_check import check_memory, check_rank_memory
from flashtree.engine.prefix_cache import PrefixCache
from flashtree.engine.process_memory import cap_process_memory
from flashtree.engine.runner import Target
from flashtree.errors import FlashtreeError
from flashtree.formats.chat_template import ChatTemplate
from flashtree.formats.gguf_file import GGUFFile
from flashtree.formats.tokenizer import Tokenizer, TokenizerSpec
from flashtree.kernels import (attention_decode, attention_verify, cuda_functions, gated_delta_cuda, rms_norm,
                               triton_ahead)
from flashtree.kernels.quant_matmul import block32_mma, mma
from flashtree.models.attention import GatedAttention
from flashtree.models.deltanet import GatedDeltaNet
from flashtree.models.dflash import DFlashDraft
from flashtree.models.gguf_config import check_tensor_types, read_config
from flashtree.models.layers import GluLinear, quant_weights, reachable
from flashtree.models.qwen35 import Qwen35Model
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.random_weights import RandomWeights, random_source


def load_target(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                progress: bool = False, shard: RankShard | None = None) -> Target:
    """The target of a GGUF file on `device` (auto: the first GPU, else the CPU), in `dtype` (default: bf16
    on a GPU, float32 on the CPU); with `shard`, one tensor-parallel rank's share of it (`load_tp_target`)."""
    gguf, config, spec = _open_checked(path)
    return _build_target(Path(path), gguf, config, spec, device, dtype, progress, shard)


def random_target(shape: str | Qwen35Config, scheme: str = "q4_k_m", device: str | torch.device | None = "cpu",
                  dtype: torch.dtype | None = None, seed: int = 0, tokenizer: TokenizerSpec | None = None,
                  progress: bool = False, shard: RankShard | None = None, **weight_options) -> Target:
    """`load_target` for random weights built in memory on `device` (no file): the model of a named shape
    (`models.random_weights.SHAPES`) or config, and the synthetic tokenizer padded to its vocabulary (as
    `write_synthetic_gguf` does). `weight_options` go to `RandomWeights` (tied, logit_scale, qtypes,
    pool_blocks, echo). With `shard` every rank builds the same weights and keeps its share."""
    dev = resolve_device(device)
    config, weights, spec = random_source(shape, scheme, dev, seed, tokenizer, **weight_options)
    return _build_target(Path(weights.path), weights, config, spec, dev, dtype, progress, shard)


def _build_target(path: Path, source: GGUFFile | RandomWeights, config: Qwen35Config, spec: TokenizerSpec,
                  device: str | torch.device | None, dtype: torch.dtype | None, progress: bool,
                  shard: RankShard | None) -> Target:
    dev = resolve_device(device)
    model = Qwen35Model.load(source, config, dev, dtype or default_dtype(dev),
                             progress=layer_progress_bar(config) if progress else None, shard=shard)
    tokenizer, template = tokenizer_and_template(spec)
    return Target(path, source, config, model, tokenizer, template)


def load_tp_target(path: str | Path, world: int, device: str | None = None, progress: bool = False) -> Target:
    """`load_target` for one rank of a tensor-parallel group of `world` processes (joined here): the rank's
    share on its device (`parallel.tp.join_group`), with a progress bar on rank 0 only."""
    shard = join_group(world, device)
    return load_target(path, shard.device, progress=progress and shard.rank == 0, shard=shard)


def _placed_target(args: EngineArgs) -> Target:
    """The target on the placement of `args`: one device, a layer split or a tensor-parallel rank's share."""
    if args.tensor_parallel > 1:
        return load_tp_target(args.model, args.tensor_parallel, args.device, progress=args.progress)
    devs, split = resolve_placement(args.device, args.gpus, args.layer_split, args.devices)
    if devs is None:
        return load_target(args.model, args.device, progress=args.progress)
    # load on the host, then move each layer to its device: no device ever holds more than its share
    target = load_target(args.model, "cpu", dtype=default_dtype(devs[0]), progress=args.progress)
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


def layer_progress_bar(config: Qwen35Config):
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


def load_engine(args: EngineArgs = EngineArgs()):
    """Target (+ draft) ready to generate. No model means the embedded demo pair. The default request
    (GenerationConfig) is checked before any weight is loaded, and on CUDA so is the memory plan (`ctx`
    tokens, each GPU's free memory or the `gpu_memory` cap) of the placement (flashtree.parallel,
    docs/MULTI_GPU.md); with `gpu_memory` the process is then held to it on those GPUs."""
    if is_demo(args.model):
        if not DEMO_TARGET.is_file():
            raise FlashtreeError("no --model given and the embedded demo model is not installed; pass --model PATH.gguf")
        use_draft = args.draft is None and DEMO_DRAFT.is_dir() and args.spec != "ar"
        args = replace(args, model=DEMO_TARGET, draft=DEMO_DRAFT if use_draft else args.draft)
    _check_spec_has_draft(args)
    _default_config(args, "ar")  # a bad KV type, window or request default fails here, before loading
    check_placement(args.tensor_parallel, args.gpus, args.layer_split, args.draft_device)
    if args.tensor_parallel > 1:
        _check_rank_memory(args)
    else:
        _check_memory(args)
    target = _placed_target(args)
    engine = engine_from_target(target, args)
    if args.tensor_parallel > 1:  # rank 0 gets the engine back; the other ranks follow it and exit
        return serve_ranks(engine)
    return engine


def _check_rank_memory(args: EngineArgs) -> None:
    """This rank's share of tensor parallel, checked on the GPU the rank will use (LOCAL_RANK, as
    `parallel.tp.join_group` picks it) before any weight is read, and held to `--gpu-memory` there."""
    device = rank_device(args.device)
    if device.type != "cuda":
        return
    check_rank_memory(args.model, args.draft, device, args.tensor_parallel, args.ctx, args.gpu_memory, args.budget,
                      args.cache_type_k, args.cache_type_v, args.cuda_overhead, _prefix_cache_device_bytes(args),
                      draft_type=args.draft_type)
    cap_process_memory([device], args.gpu_memory, args.cuda_overhead)


def _check_memory(args: EngineArgs) -> None:
    """The placement `_placed_target` will make, planned and checked against the GPUs' memory, and
    held to `--gpu-memory` on them."""
    stages, split = resolve_placement(args.device, args.gpus, args.layer_split, args.devices)
    if stages is None:
        stages = [resolve_device(args.device)]
    elif split is None:
        split = [1.0] * len(stages)
    draft_device = resolve_device(args.draft_device) if args.draft_device else None
    check_memory(args.model, args.draft, stages, split, draft_device, args.ctx, args.gpu_memory, args.budget,
                 args.cache_type_k, args.cache_type_v, args.cuda_overhead, _prefix_cache_device_bytes(args),
                 draft_type=args.draft_type)
    cap_process_memory([*stages, *([draft_device] if draft_device is not None else [])], args.gpu_memory,
                       args.cuda_overhead)


def _prefix_cache_device_bytes(args: EngineArgs) -> int:
    """The GPU memory a prefix cache may fill with snapshots (none without the cache)."""
    return args.prefix_cache_device_bytes if args.prefix_cache else 0


def engine_from_target(target: Target, args: EngineArgs = EngineArgs()):
    """An Engine over a loaded target (a file's or `random_target`'s), with the draft at `args.draft` if
    given; the mode defaults to ddtree with a draft, else ar. `args.enforce_eager` turns CUDA graphs off."""
    _check_spec_has_draft(args)
    ar_defaults = _default_config(args, "ar")
    compile_cuda_kernels(target.model, target.model.act_dtype, args.progress, (args.cache_type_k, args.cache_type_v))
    if args.tensor_parallel == 1:  # under tensor parallel a dry chunk would run the ranks' collectives too
        compile_triton_kernels(target.model, ar_defaults, args.progress)
    draft_model = (load_draft(args.draft, target, args.draft_device, args.draft_type) if args.draft is not None
                   else None)
    mode = args.spec or ("ddtree" if draft_model is not None else "ar")
    prefix_cache = PrefixCache(max_entries=args.prefix_cache_entries, max_bytes=args.prefix_cache_bytes,
                               device_bytes=args.prefix_cache_device_bytes,
                               interval=args.prefix_cache_interval) if args.prefix_cache else None
    return Engine(target, draft_model, _default_config(args, mode),
                  draft_path=Path(args.draft) if draft_model is not None else None,
                  use_cuda_graphs=not args.enforce_eager, prefill_progress=args.prefill_progress,
                  parse_special=args.parse_special, prefix_cache=prefix_cache)


def compile_cuda_kernels(model, activations: torch.dtype, progress: bool = False,
                         cache_types: tuple[str, str] = ("f16", "f16")) -> None:
    """Compile, at load and in parallel processes, every CUDA C kernel the model can launch on its `activations` (the
    dtype of x and out) into the on-disk cache: each tensor-core instance its fragment-ordered weights can take
    (decode, verify, prefill; a fused gate + up weight's with their GLU epilogue) and, with FLASHTREE_BLOCK32=1, the
    32-value block types' (`block32_mma`: Q8_0, Q5_K, IQ4_XS), the cluster add + RMSNorm (kernels/add_rms_norm.cu)
    of float32 activations on Hopper, alone and writing the float16 x of those weights' types, the DeltaNet tree
    verify's node tiles (kernels/deltanet_tree.cu), with TQ3_0 or Q8_0 K and V (`cache_types`) the decode and the
    tree verify over them (kernels/attention_decode.cu, attention_verify.cu).
    Otherwise NVRTC compiles them one by one, a second each, inside the first requests. A cached kernel costs nothing,
    so a second start compiles none. Says what it compiled (a bar with `progress`)."""
    weights = [w for w in quant_weights(model) if w.mma_layout]
    block_weights = [w for w in quant_weights(model) if block32_mma.takes(w.qtype, w.shape, w.device)]
    device = next((w.device for w in weights + block_weights), getattr(model, "device", torch.device("cpu")))
    shapes = {(w.qtype, *w.shape) for w in weights}
    glu_shapes = {(glu.quant.qtype, *glu.quant.shape) for glu in reachable(model, GluLinear)}
    instances = mma.instances_for(shapes, mma.sm_count(device), activations, glu_shapes) if weights else []
    block_shapes = sorted({(w.qtype, *w.shape) for w in block_weights})
    block_jobs = block32_mma.cuda_jobs(block_shapes, mma.sm_count(device), activations) if block_shapes else []
    tree_dims = {layer.config.gdn_head_dim for layer in reachable(model, GatedDeltaNet)}
    head_dims = sorted({layer.config.head_dim for layer in reachable(model, GatedAttention)})
    kind = cache_types[0] if cache_types[0] == cache_types[1] else None
    # the attention kernels' query: TQ3_0's normed and rotated in the activations' dtype, Q8_0's in the model's
    # (models/attention.py)
    query = activations if kind == "tq3_0" else getattr(model, "dtype", None) or activations
    jobs = (mma.with_source(instances) + block_jobs
            + rms_norm.cuda_jobs(device, activations, {w.qtype for w in weights})
            + [job for dk in sorted(tree_dims) for job in gated_delta_cuda.cuda_jobs(device, dk)]
            + [job for d in head_dims if kind in attention_decode.KINDS
               for job in attention_decode.cuda_jobs(device, d, query, kind)]
            + [job for d in head_dims if kind in attention_verify.KINDS
               for job in attention_verify.cuda_jobs(device, d, query, kind)])
    if not jobs:
        return
    arch = mma.arch_of(device)
    jobs = cuda_functions.uncompiled(jobs, arch)
    if not jobs:
        return
    bar = tqdm(total=len(jobs), desc="compiling CUDA kernels (NVRTC)", unit="kernel", disable=not progress)
    started = time.perf_counter()
    cuda_functions.precompile(jobs, arch, progress=lambda name: bar.update())
    bar.close()
    print(f"compiled {len(jobs)} CUDA kernels for {arch} in {time.perf_counter() - started:.1f} s "
          f"(cached in {cuda_functions.cache_dir()})", file=sys.stderr)


def compile_triton_kernels(model, config: GenerationConfig, progress: bool = False) -> None:
    """Compile, at load and in parallel threads, the Triton kernels a full prefill chunk of `config`'s length
    and cache types launches (kernels/triton_ahead.py): their shapes come from one dry chunk over a scratch
    cache, whose garbage is thrown away with it. Other shapes (decode, verify, short chunks) compile at their
    first launch as before; a kernel already compiled in this process is not recorded, and one in Triton's
    disk cache loads from there. Says what it compiled (a bar with `progress`)."""
    if model.device.type != "cuda" or model.boundaries or not triton_ahead.supported():
        return
    chunk = config.prefill_chunk
    with torch.inference_mode(), triton_ahead.recorded_launches() as launches:
        scratch = model.new_cache(chunk, config.cache_type_k, config.cache_type_v, config.attn_window)
        model.forward(torch.zeros(chunk, dtype=torch.long), scratch, last_only=True)  # as `ModelRunner.prefill`
        del scratch
    if not launches:
        return
    bar = tqdm(total=len(launches), desc="compiling Triton kernels", unit="kernel", disable=not progress)
    started = time.perf_counter()
    failed = triton_ahead.compile_launches(launches, progress=lambda name: bar.update())
    bar.close()
    names = sorted({launch.name for launch in launches})
    print(f"compiled {len(launches) - len(failed)} Triton kernel specializations for {chunk}-token prefill chunks "
          f"in {time.perf_counter() - started:.1f} s ({', '.join(names)})"
          + (f"; left to their first launch: {', '.join(failed)}" if failed else ""), file=sys.stderr)


def _check_spec_has_draft(args: EngineArgs) -> None:
    if args.spec in ("chain", "ddtree") and args.draft is None:
        raise FlashtreeError(f"--spec {args.spec} needs a draft model: pass --draft DIR or use --spec ar")


def _default_config(args: EngineArgs, mode: str) -> GenerationConfig:
    """The request the engine answers when a request leaves a setting out."""
    request = {"max_new_tokens": args.max_new_tokens, "prefill_chunk": args.prefill_chunk, "adaptive": args.adaptive,
               "step_cost": args.step_cost}
    return GenerationConfig(mode=mode, budget=args.budget, topk=args.topk, ctx=args.ctx,
                            skip_special_tokens=args.skip_special_tokens, **args.cache_options,
                            **{key: value for key, value in request.items() if value is not None})


def load_draft(path: str | Path, target: Target, device: str | None = None, draft_type: str = DEFAULT_DRAFT_TYPE):
    """The DFlash draft at `path` on `device` (--draft-device) or the target's, its layer matrices held as
    `draft_type` says (engine/config.py DRAFT_TYPES): dense in `draft_dtype` (the target's dtype, or bf16 on a CPU
    that multiplies it in hardware), Q8_0 blocks quantized from the target's dtype."""
    device = resolve_device(device) if device is not None else target.model.device  # --draft-device
    layer_type = None if draft_type == DENSE_DRAFT else draft_type
    dtype = draft_dtype(target.model.dtype, device) if layer_type is None else target.model.dtype
    draft = DFlashDraft.load(path, device=device, dtype=dtype, layer_type=layer_type)
    c = target.config
    draft.check_target(c.hidden_size, c.vocab_size, c.num_layers)
    return draft
