"""The flags that several `flashtree` commands share (model loading, sampling, thinking, control tokens), the
argparse types they use, and the load and sampling options read back from parsed flags.

torch and the engine are imported inside the functions that need them: `flashtree --help` builds
every subcommand's parser and must not wait for them."""

from __future__ import annotations

import argparse
from typing import Callable, Iterable

from flashtree.engine.config import (DEFAULT_BUDGET, DEFAULT_CUDA_OVERHEAD, DEFAULT_DRAFT_TYPE, DEFAULT_TOPK,
                                     DRAFT_TYPES, MODES, EngineArgs, GenerationConfig, StepCost)
from flashtree.errors import FlashtreeError


def int_range(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (no upper bound when `high` is None), so a bad count
    is refused by name before any weight loads."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


def one_of(names: Callable[[], Iterable[str]]):
    """An argparse type: one of `names()`. A function, so that a table kept beside torch code is imported
    only when its flag is given, not to build the parser."""

    def parse(text: str) -> str:
        known = sorted(names())
        if text not in known:
            raise argparse.ArgumentTypeError(f"unknown {text!r}; choose from {', '.join(known)}")
        return text

    return parse


def memory_size(text: str) -> str:
    """An argparse type: a memory size such as 24GiB, checked while parsing (kept as text)."""
    from flashtree.engine.planner import parse_size

    try:
        parse_size(text)
    except FlashtreeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def memory_bytes(text: str) -> int:
    """An argparse type: a memory size such as 0.5GiB, in bytes."""
    from flashtree.engine.planner import parse_size

    return parse_size(memory_size(text))


def add_memory_args(parser: argparse.ArgumentParser, gpu_memory_help: str) -> None:
    """`--gpu-memory` and `--cuda-overhead`: what each GPU has, and what the process holds there outside
    PyTorch's allocator (shared by the commands that load a model and by `flashtree plan`)."""
    parser.add_argument("--gpu-memory", type=memory_size, default=None, metavar="SIZE", help=gpu_memory_help)
    parser.add_argument("--cuda-overhead", type=memory_bytes, default=DEFAULT_CUDA_OVERHEAD, metavar="SIZE",
                        help="memory per GPU outside PyTorch's allocator: CUDA context, cuBLAS workspaces, Triton and "
                             f"NVRTC modules (default {DEFAULT_CUDA_OVERHEAD / 2**30:g}GiB, as measured for the 27B shape "
                             "on an H200; `bench --steps` measures it as outside_allocator)")


def add_draft_type_arg(parser: argparse.ArgumentParser) -> None:
    """`--draft-type`: how the draft's layer matrices are held (shared by the commands that load a model and by
    `flashtree plan`)."""
    parser.add_argument("--draft-type", choices=DRAFT_TYPES, default=DEFAULT_DRAFT_TYPE,
                        help="the draft's layer matrices: dense (bf16 on a GPU and on a CPU with bf16 instructions, "
                             "else float32) or q8_0 (half the "
                             "bytes: 1.83 GiB instead of 3.22 for the 27B draft; output is the target's either way) "
                             f"(default {DEFAULT_DRAFT_TYPE})")


def step_cost(text: str) -> StepCost:
    """An argparse type: FIXED,PER_NODE, a speculative step's cost in AR steps (engine/config.py `StepCost`)."""
    try:
        fixed, per_node = (float(part) for part in text.split(","))
        return StepCost(fixed, per_node)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers FIXED,PER_NODE such as 1.4,0.06, got {text!r}") from None
    except FlashtreeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model (names follow llama.cpp / vLLM)."""
    parser.add_argument("-m", "--model", help="target GGUF, or demo: the embedded demo pair (the default)")
    parser.add_argument("--draft", help="DFlash draft directory (config.json + model.safetensors)")
    add_draft_type_arg(parser)
    parser.add_argument("--spec", choices=MODES, default=None,
                        help="decoding mode (default: ddtree when a draft is given, else ar)")
    parser.add_argument("--budget", type=int_range(1), default=DEFAULT_BUDGET,
                        help=f"DDTree node budget (default {DEFAULT_BUDGET})")
    parser.add_argument("--topk", type=int_range(1), default=DEFAULT_TOPK,
                        help=f"DDTree candidates per depth (default {DEFAULT_TOPK})")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                        help="speculative modes: a smaller tree, or AR steps, while the acceptance measured on the "
                             f"request does not pay for the steps (default: {'on' if GenerationConfig.adaptive else 'off'})")
    default_cost = StepCost()
    parser.add_argument("--step-cost", type=step_cost, default=None, metavar="FIXED,PER_NODE",
                        help="--adaptive: a speculative step costs 1 + FIXED + PER_NODE x budget AR steps "
                             f"(default {default_cost.fixed},{default_cost.per_node}; bench's ms/step ratio measures it)")
    parser.add_argument("--device", default=EngineArgs.device, help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("-c", "--ctx", type=int_range(2), default=None, help="context size in tokens (default: fit the request)")
    parser.add_argument("-ctk", "--cache-type-k", default=None, metavar="TYPE",
                        help="K cache type: f16, bf16, f32, q8_0, q4_0, tq3_0 (default: the model dtype)")
    parser.add_argument("-ctv", "--cache-type-v", default=None, metavar="TYPE",
                        help="V cache type: f16, bf16, f32, q8_0, q4_0, tq3_0 (default: the model dtype)")
    parser.add_argument("--attn-window", type=int_range(0), default=EngineArgs.attn_window, metavar="N",
                        help="sliding-window attention over the last N positions; changes output (default 0 = full)")
    # placement over several devices (flashtree.parallel, docs/MULTI_GPU.md)
    parser.add_argument("--gpus", type=int_range(1), default=None, metavar="N",
                        help="split the target's layers evenly over N GPUs (cuda:0..N-1)")
    parser.add_argument("--layer-split", default=None, metavar="A,B,...",
                        help="layers per GPU as proportions or counts, e.g. 1,1 or 20,44 (llama.cpp -ts style)")
    parser.add_argument("--draft-device", default=None, metavar="DEV",
                        help="device of the draft and its context cache, e.g. cuda:1 (default: the target's)")
    parser.add_argument("-tp", "--tensor-parallel", "--tensor-parallel-size", dest="tensor_parallel", type=int_range(1),
                        default=EngineArgs.tensor_parallel, metavar="N", help="shard the target over N GPUs, one process each (default 1)")
    add_memory_args(parser, "memory per GPU, e.g. 24GiB: the load-time check plans for it and the process is held "
                            "to it (PyTorch's allocator capped at it less --cuda-overhead), so a 24 GiB card can be "
                            "played on a larger one (default: each GPU's free memory, no cap)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: launch every kernel of a step from Python (vLLM's flag; for debugging)")
    parser.add_argument("-t", "--threads", type=int_range(1), default=None, metavar="N",
                        help="CPU threads for torch (default: $OMP_NUM_THREADS, else the physical cores less one)")
    parser.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="gpu_layers", type=int, default=None,
                        metavar="N", help="accepted for llama.cpp habits and ignored: every layer goes on --device")


def add_thinking_arg(parser: argparse.ArgumentParser) -> None:
    """`--think` / `--no-think`; neither leaves the choice to the model's chat template (its default)."""
    parser.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                        help="let the model think first, or not (default: what the model's chat template does)")


def thinking_kwargs(think: bool | None) -> dict:
    """Chat template arguments for a --think/--no-think choice: none when neither was given."""
    return {} if think is None else {"enable_thinking": think}


def engine_args(args: argparse.Namespace, **settings) -> EngineArgs:
    """The `EngineArgs` of the flags `add_model_args` added, with the command's own `settings` on top."""
    flags = {"model": args.model, "draft": args.draft, "draft_type": args.draft_type, "device": args.device,
             "spec": args.spec, "budget": args.budget, "topk": args.topk, "cache_type_k": args.cache_type_k,
             "cache_type_v": args.cache_type_v, "attn_window": args.attn_window, "gpus": args.gpus,
             "layer_split": args.layer_split, "draft_device": args.draft_device,
             "tensor_parallel": args.tensor_parallel, "enforce_eager": args.enforce_eager, "ctx": args.ctx,
             "gpu_memory": args.gpu_memory, "cuda_overhead": args.cuda_overhead, "adaptive": args.adaptive,
             "step_cost": args.step_cost}
    return EngineArgs(**{**flags, **settings})


def add_parse_special_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parse-special", action="store_true",
                        help="read control-token text (<|im_start|>, <|im_end|>, ...) in prompts, messages and tools "
                             "as control tokens, the old behaviour: lets that text open turns of its own (default: "
                             "plain text; only the chat template's markers are control tokens)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags (llama.cpp names); left out, each keeps `SamplingParams`' default: greedy decoding."""
    parser.add_argument("--temp", "--temperature", dest="temperature", type=float, default=None,
                        help="sampling temperature (default: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: off)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (default: off)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="drop tokens below min_p x the top probability (default: off)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (same seed, same text, same mode)")
    parser.add_argument("--repeat-penalty", type=float, default=None, help="repetition penalty (default: off)")
    parser.add_argument("--presence-penalty", type=float, default=None, help="(default: off)")
    parser.add_argument("--frequency-penalty", type=float, default=None, help="(default: off)")


def given(**values) -> dict:
    """The values of the flags given on the command line (not None): a flag left out keeps the default of the
    settings object its value goes to, so that default is written there only."""
    return {name: value for name, value in values.items() if value is not None}


def sampling_from_args(args: argparse.Namespace):
    from flashtree.engine.sampling import SamplingParams

    return SamplingParams(**given(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  min_p=args.min_p, seed=args.seed, repetition_penalty=args.repeat_penalty,
                                  presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty))
