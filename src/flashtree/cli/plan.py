"""`flashtree plan`: the device memory a configuration needs, line by line, from shapes alone.

    flashtree plan --model T.gguf [--draft DIR] --ctx 262144 --cache-type-k tq3_0 --cache-type-v tq3_0 \
        --budget 22 [--gpu-memory 24GiB]
    flashtree plan --synthetic qwen3.6-27b --ctx 262144 -ctk tq3_0 -ctv tq3_0 --gpu-memory 24GiB
    flashtree plan --synthetic qwen3.6-27b --ctx 65536 --layer-split 1,1 --draft-device cuda:1 --gpu-memory 16GiB

Refuses (exit 1, one line) a configuration that does not fit in --gpu-memory, or in the CUDA
device's memory when a device is present and no --gpu-memory is given. With `--layer-split` or
`--draft-device` the budget is shown per GPU (`engine.planner.per_device`) and each GPU must fit.

torch and the engine are imported inside the functions that run the command: `flashtree --help` builds
every subcommand's parser and must not wait for them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from flashtree.cli.args import add_draft_type_arg, add_memory_args, int_range, one_of
from flashtree.engine.config import DEFAULT_BUDGET, DEFAULT_DRAFT_WINDOW, DEFAULT_PREFILL_CHUNK, EngineArgs
from flashtree.engine.prefix_cache_flags import DEFAULT_DEVICE_BYTES, GIB
from flashtree.errors import FlashtreeError

if TYPE_CHECKING:  # the planner imports torch: `flashtree plan --help` stays instant without it
    from flashtree.engine.planner import PlanRequest


def synthetic_shapes() -> dict:
    from flashtree.engine.planner import SYNTHETIC  # deferred: the planner imports torch

    return SYNTHETIC


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="memory budget of a model + draft at a context size and KV cache types")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("-m", "--model",
                        help="target GGUF, or demo (only metadata and the tensor table are read)")
    source.add_argument("--synthetic", type=one_of(synthetic_shapes), metavar="NAME",
                        help="a known model shape instead of a file, e.g. qwen3.6-27b (includes its DFlash draft "
                        "unless --no-draft)")
    p.add_argument("--draft", help="DFlash draft directory (config.json is read)")
    p.add_argument("--no-draft", action="store_true", help="plan without a draft (autoregressive)")
    add_draft_type_arg(p)
    p.add_argument("-c", "--ctx", type=int_range(2), default=None, help="context size in tokens (default: the model's)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", metavar="TYPE",
                   help="K cache type: f16, bf16, f32, q8_0, q4_0, tq3_0 (default f16)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", metavar="TYPE", help="V cache type (default f16)")
    p.add_argument("--budget", type=int_range(1), default=DEFAULT_BUDGET,
                   help=f"DDTree node budget (default {DEFAULT_BUDGET})")
    p.add_argument("--draft-window", type=int_range(1), default=DEFAULT_DRAFT_WINDOW,
                   help=f"draft context positions (default {DEFAULT_DRAFT_WINDOW})")
    p.add_argument("--prefill-chunk", type=int_range(1), default=DEFAULT_PREFILL_CHUNK,
                   help=f"prefill chunk in tokens (default {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"), help="compute dtype (default bf16)")
    add_memory_args(p, "memory per GPU to fit in, the whole process counted, e.g. 24GiB or 24GB (default: the "
                       "CUDA device's, if any)")
    p.add_argument("--prefix-cache-device-gib", type=float, default=0.0, metavar="GIB",
                   help="count a prefix cache's device budget (serve and chat keep "
                        f"{DEFAULT_DEVICE_BYTES / GIB:g} GiB of snapshots on the GPU by default; "
                        "default 0: not counted)")
    p.add_argument("--layer-split", default=None, metavar="A,B,...",
                   help="layers per GPU as proportions or counts (as `run --layer-split`): plan each GPU")
    p.add_argument("--draft-device", default=None, metavar="cuda:N",
                   help="the GPU the draft, its ring and the prefill capture go to (as `run --draft-device`)")
    # dest "ranks": a plan starts no processes (`main` spawns ranks for `tensor_parallel`)
    p.add_argument("-tp", "--tensor-parallel", dest="ranks", type=int_range(1), default=EngineArgs.tensor_parallel,
                   metavar="N", help="plan one rank of N-way tensor parallel (as `run -tp N`)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def build_request(args: argparse.Namespace) -> PlanRequest:
    from flashtree.engine.loader import model_path
    from flashtree.engine.planner import DraftShape, PlanRequest, target_from_gguf, target_from_preset

    if args.synthetic:
        config, weights, embed, dense, draft, layers = target_from_preset(args.synthetic)
        if args.draft:
            draft = DraftShape.from_dir(args.draft)
    else:
        config, weights, embed, dense, layers = target_from_gguf(model_path(args.model))
        draft = DraftShape.from_dir(args.draft) if args.draft else None
    if args.no_draft:
        draft = None
    return PlanRequest(config, weights, embed, draft, args.ctx or config.context_length, args.cache_type_k,
                       args.cache_type_v, args.budget, args.draft_window, args.prefill_chunk, args.dtype, dense,
                       layers, args.cuda_overhead, int(args.prefix_cache_device_gib * GIB), args.draft_type)


def available_memory(text: str | None) -> tuple[int | None, str]:
    from flashtree.engine.planner import parse_size

    if text is not None:
        return parse_size(text), "--gpu-memory"
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            return props.total_memory, props.name
    except Exception:  # no usable CUDA: nothing to check against
        pass
    return None, "none given"


def placement(args: argparse.Namespace, num_layers: int) -> tuple[list[int], int] | None:
    """(layers per GPU, the draft's GPU index) when a placement flag is given, else None."""
    from flashtree.parallel.placement import layer_counts, parse_split

    if args.layer_split is None and args.draft_device is None:
        return None
    counts = layer_counts(num_layers, parse_split(args.layer_split)) if args.layer_split else [num_layers]
    draft_gpu = 0
    if args.draft_device is not None:
        name, _, index = args.draft_device.partition(":")
        if name != "cuda" or not index.isdigit():
            raise FlashtreeError(f"--draft-device {args.draft_device!r}: plan a GPU as cuda:N (e.g. cuda:1)")
        draft_gpu = int(index)
    return counts, draft_gpu


def warn_past_trained_context(ctx: int, trained: int) -> None:
    if ctx > trained:
        print(f"warning: --ctx {ctx} is past the model's trained context ({trained} tokens); "
              "quality past it is not what the model was trained for", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from flashtree.engine.planner import fmt_bytes, max_ctx, per_device, per_rank, plan
    from flashtree.parallel.tp import check_placement

    check_placement(args.ranks, layer_split=args.layer_split, draft_device=args.draft_device)
    req = build_request(args)
    warn_past_trained_context(req.ctx, req.config.context_length)
    result = plan(req)
    if args.ranks > 1:
        return show_devices(args, result, [per_rank(result, args.ranks)] * args.ranks,
                            f"tensor parallel {args.ranks} (one rank per GPU)")
    placed = placement(args, req.config.num_layers)
    if placed is not None:
        counts, draft_gpu = placed
        return show_devices(args, result, per_device(result, counts, draft_gpu),
                            f"layers per GPU {counts}, draft on cuda:{draft_gpu if req.draft else '-'}")
    available, source = available_memory(args.gpu_memory)
    fits_to = max_ctx(req, available) if available is not None else None
    c = req.config
    if args.json:
        print(json.dumps({
            "model": c.name, "ctx": req.ctx, "cache_type_k": req.cache_type_k, "cache_type_v": req.cache_type_v,
            "budget": req.budget, "draft": req.draft is not None, "draft_type": req.draft_type,
            "lines": {n: b for n, b, _ in result.lines},
            "cuda_overhead": req.cuda_overhead,
            "total": result.total, "available": available, "fits": available is None or result.total <= available,
            "max_ctx": fits_to, "target_weights_dequantized": result.dequantized_weights()}, indent=2))
    else:
        print(f"{c.name}: ctx {req.ctx}, K {req.cache_type_k} / V {req.cache_type_v}, budget {req.budget}, "
              f"{f'DFlash draft ({req.draft_type})' if req.draft else 'no draft'}, compute {req.dtype}")
        print(result.table(available))
        print(f"note: on CUDA the weights stay quantized (the stored size above); the CPU path and types without a "
              f"GPU kernel dequantize at load ({fmt_bytes(result.dequantized_weights())} in {req.dtype} for all of them)")
        if available is not None:
            print(f"{'largest ctx that fits':<26} {fits_to:>10}  (multiple of 256, memory from {source})")
    if available is not None and result.total > available:
        raise FlashtreeError(
            f"does not fit: ctx {req.ctx} with K {req.cache_type_k} / V {req.cache_type_v} needs {fmt_bytes(result.total)} "
            f"(weights {fmt_bytes(result.bytes_of('target weights'))}, KV {fmt_bytes(result.bytes_of('KV cache'))}, "
            f"CUDA context + libraries {fmt_bytes(req.cuda_overhead)}) "
            f"but {fmt_bytes(available)} is available; largest ctx that fits: {fits_to}")
    return 0


def show_devices(args: argparse.Namespace, result, devices: list[dict], placement_text: str) -> int:
    """The plan as one column per GPU; refuses (naming them) the GPUs that do not fit."""
    from flashtree.engine.planner import fmt_bytes

    req, c = result.request, result.request.config
    totals = [sum(d.values()) for d in devices]
    available, source = available_memory(args.gpu_memory)
    if args.json:
        print(json.dumps({"model": c.name, "ctx": req.ctx, "placement": placement_text,
                          "devices": [{"lines": d, "total": t} for d, t in zip(devices, totals)],
                          "available_per_gpu": available}, indent=2))
    else:
        print(f"{c.name}: ctx {req.ctx}, K {req.cache_type_k} / V {req.cache_type_v}, budget {req.budget}, "
              f"{placement_text}, compute {req.dtype}")
        print(f"{'':<26}" + "".join(f"{f'cuda:{i}':>12}" for i in range(len(devices))))
        for name in devices[0]:
            print(f"{name:<26}" + "".join(f"{fmt_bytes(d[name]):>12}" for d in devices))
        print(f"{'total':<26}" + "".join(f"{fmt_bytes(t):>12}" for t in totals))
        if available is not None:
            print(f"{'available per GPU':<26}{fmt_bytes(available):>12}  (from {source})")
    over = [f"cuda:{i} needs {fmt_bytes(t)}" for i, t in enumerate(totals) if available is not None and t > available]
    if over:
        raise FlashtreeError(f"does not fit: {', '.join(over)} but each GPU has {fmt_bytes(available)}")
    return 0
