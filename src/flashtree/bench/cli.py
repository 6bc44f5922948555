"""`flashtree bench`: decode speed and acceptance per mode on a prompt set; prints a table, writes JSON.

Reports tok/s, ms per target step and the bytes of weights a step reads divided by its time
(achieved GB/s), the number to hold against the device's measured bandwidth.

torch and the engine are imported inside the functions that run a benchmark: building the argument
parser must not load them (`flashtree --help` answers at once).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import replace

from tqdm import tqdm

from flashtree.bench.datasets import BUILTIN, load_prompt_set
from flashtree.bench.report import save_report
from flashtree.cli.args import (add_model_args, add_sampling_args, add_thinking_arg, engine_args, int_range, one_of,
                                sampling_from_args, thinking_kwargs)
from flashtree.engine.config import MODES, EngineArgs
from flashtree.engine.prefix_cache_flags import DEFAULT_DEVICE_BYTES, DEFAULT_INTERVAL, GIB
from flashtree.errors import FlashtreeError

# `--steps`' verify rows: the default budget between a small tree and the largest the seed runs; a verify takes
# budget + 1 rows, which the attention kernel takes up to 128 of (kernels/tree_attention.py MAX_TREE_QUERIES)
STEP_VERIFY_BUDGETS = (15, 22, 32, 64)
MAX_STEP_BUDGET = 127


def synthetic_shapes() -> dict:
    from flashtree.models.random_weights import SHAPES  # deferred: imports torch, which --help must not wait for

    return SHAPES


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark decoding modes (table; JSON with --out)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--synthetic", type=one_of(synthetic_shapes), metavar="NAME",
                   help="random-weight model of this shape (tiny, qwen3.5-0.8b, qwen3.6-27b, ...), built in memory, "
                        "instead of --model")
    p.add_argument("--scheme", default="q8_0", help="quant scheme of the synthetic model (default q8_0)")
    p.add_argument("--echo", action="store_true",
                   help="--synthetic: a decisive model (its greedy next token is its current token, by a wide "
                        "margin; same shapes, types and bytes read), so that replay acceptance and identity "
                        "checks do not hinge on rounding")
    p.add_argument("--modes", type=_modes, default=None,
                   help="comma-separated modes: ar, chain, ddtree (default: ar plus the spec modes a draft allows)")
    p.add_argument("--dataset", action="append", default=None,
                   help="builtin (default), humaneval, or a chat-message .jsonl file; repeatable")
    p.add_argument("--prompts", type=int_range(1), default=len(BUILTIN), help="prompts per dataset")
    add_thinking_arg(p)
    p.add_argument("-n", "--max-tokens", "--n-predict", type=int_range(1), default=128,
                   help="new tokens per prompt (default 128)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the report as JSON here (default: none)")
    p.add_argument("--multi-turn", action="store_true",
                   help="time to first token per turn of a chat with a long system prompt, prefix cache off vs on")
    p.add_argument("--turns", type=int_range(1), default=5, help="--multi-turn: chat turns (default 5)")
    p.add_argument("--sessions", type=int_range(1), default=5,
                   help="--multi-turn: chats per setting, alternating which goes first; each turn's median (default 5)")
    p.add_argument("--system-tokens", type=int_range(1), default=8192, help="--multi-turn: system prompt size (default 8192)")
    p.add_argument("--prefix-cache-interval", type=int_range(1), default=DEFAULT_INTERVAL,
                   help=f"--multi-turn: snapshot interval inside long prompts (default {DEFAULT_INTERVAL})")
    p.add_argument("--prefix-cache-device-gib", type=float, default=DEFAULT_DEVICE_BYTES / GIB,
                   help="--multi-turn: snapshots kept in device memory before the least recently used move to "
                        f"host RAM, in GiB (default {DEFAULT_DEVICE_BYTES / GIB:g})")
    p.add_argument("--peers", action="store_true",
                   help="add rows for transformers greedy generate and the z-lab dflash loop on the same prompts "
                        "(with --fidelity: transformers' logits in each dtype)")
    p.add_argument("--kernels", action="store_true",
                   help="time the quantized matmul kernels at the 27B shapes against their floor and bf16 cuBLAS (GPU)")
    p.add_argument("--fidelity", action="store_true",
                   help="the device's logits against the CPU float32 run on the prompt set, teacher-forced: max "
                        "relative error, argmax agreement, the layer adding the most error (bench/fidelity.py)")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="--fidelity: comma-separated device dtypes to compare (float32, bfloat16, float16)")
    p.add_argument("--steps", action="store_true",
                   help="per-step costs against measured floors, prefill, replay end to end (bench/steps.py)")
    p.add_argument("--profile", action="store_true",
                   help="--steps: the kernels of one AR step (eager, and its graph replay on CUDA), of a "
                        "speculative step's draft, verify and commit, and of a --prefill-chunk chunk on the context "
                        "(count and time per family, torch.profiler)")
    p.add_argument("--context", type=int, default=1024, help="--steps: committed tokens before the timed steps")
    p.add_argument("--repeat", type=int, default=20, help="--steps: timed repetitions per step (median)")
    p.add_argument("--replay-al", type=float, default=5.17,
                   help="--steps: acceptance length of the replay run (0: no replay run)")
    p.add_argument("--verify-budgets", type=_budgets, default=STEP_VERIFY_BUDGETS,
                   help="--steps: comma-separated tree budgets whose verify is timed, or none "
                        f"(default {','.join(map(str, STEP_VERIFY_BUDGETS))})")
    p.add_argument("--prefill-lengths", type=_lengths, default=(1024, 13000),
                   help="--steps: comma-separated prompt lengths whose prefill is timed, or none (default 1024,13000)")
    p.add_argument("--chunk-lengths", type=_lengths, default=(1, 8, 16, 23, 32, 51, 64),
                   help="--steps: comma-separated short prefill chunks (tokens) timed one by one on the context, "
                        "as a prefix-cache hit or a message runs them, or none (default 1,8,16,23,32,51,64)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill forward")
    p.add_argument("--memory-snapshot", metavar="FILE", default=None,
                   help="--steps on CUDA: keep the allocator's block stacks, print what is reserved, live and kept "
                        "free after each phase, and write the snapshot to FILE at the first out-of-memory or at the "
                        "end (python -m flashtree.bench.memory_snapshot FILE prints its tables)")
    p.set_defaults(handler=run)


def _memory_snapshots(args: argparse.Namespace, settings: EngineArgs):
    """`--memory-snapshot FILE`: the allocator's block stacks kept from before the model's load (its weights, the
    draft, the cache, the prefill and the steps), so that the snapshots name what holds the memory; None without it."""
    if not args.memory_snapshot:
        return None
    if not args.steps:
        raise FlashtreeError("--memory-snapshot records the --steps run: add --steps")
    from flashtree.bench.memory_snapshot import SnapshotRecorder  # imports torch: not for --help
    from flashtree.parallel.placement import resolve_device

    device = resolve_device(settings.device)
    if device.type != "cuda":
        raise FlashtreeError("--memory-snapshot reads CUDA's caching allocator: run it with --device cuda")
    recorder = SnapshotRecorder(args.memory_snapshot, device)
    recorder.start()
    return recorder


def _fidelity(args: argparse.Namespace) -> int:
    from flashtree.bench.fidelity import DTYPES, run_fidelity
    from flashtree.engine.loader import load_engine

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise FlashtreeError(f"--dtypes {args.dtypes!r}: choose from {', '.join(DTYPES)}")
    reference = load_engine(EngineArgs(model=args.model, device="cpu", spec="ar"))  # float32 on the CPU: the reference
    sets = [load_prompt_set(spec, args.prompts) for spec in (args.dataset or ["builtin"])]
    sequences = [reference.encode_messages(conv, **thinking_kwargs(args.think)) for s in sets for conv in s.conversations]
    run_fidelity(reference.target, args.device or "cuda", dtypes, sequences, args.out, peers=args.peers)
    return 0


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown) or repr(text)}; choose from {', '.join(MODES)}")
    return modes


def _counts(text: str, what: str, largest: int | None = None) -> tuple[int, ...]:
    """Comma-separated positive counts (at most `largest`), or "none" for no rows at all."""
    if text.strip().lower() == "none":
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1 or (largest is not None and max(values) > largest):
        bound = f" up to {largest}" if largest is not None else ""
        raise argparse.ArgumentTypeError(f"expected comma-separated positive {what}{bound}, or none; got {text!r}")
    return values


def _lengths(text: str) -> tuple[int, ...]:
    return _counts(text, "token counts")


def _budgets(text: str) -> tuple[int, ...]:
    return _counts(text, "tree budgets", MAX_STEP_BUDGET)


def run(args: argparse.Namespace) -> int:
    from flashtree.bench.steps import weight_bytes
    from flashtree.engine.loader import load_engine

    if args.kernels:
        from flashtree.bench.kernels import run_kernel_bench  # needs a GPU; loads no model

        run_kernel_bench(args.out)
        return 0
    if args.fidelity:
        return _fidelity(args)
    if args.synthetic and args.model:
        raise FlashtreeError(f"--synthetic {args.synthetic} builds its own model: drop --model, or drop --synthetic")
    # --ctx is also every request's context, e.g. a multi-turn session longer than the model's trained context
    settings = engine_args(args, prefill_chunk=args.prefill_chunk or None)
    snapshots = _memory_snapshots(args, settings)  # before the load: the weights' blocks get their stacks too
    if args.synthetic:
        engine = _synthetic_engine(args, settings)
        model = engine.target.path
    else:
        model = args.model or "embedded demo pair"
        engine = load_engine(settings)
    args.prefill_chunk = engine.default_config.prefill_chunk
    if args.steps:
        from flashtree.bench.steps import run_steps

        return run_steps(args, engine, _device_name(engine), snapshots)
    if args.multi_turn:
        from flashtree.bench.multi_turn import run_multi_turn

        return run_multi_turn(args, engine, str(model), _device_name(engine))
    modes = args.modes or ["ar"] + (["chain", "ddtree"] if engine.draft is not None else [])
    if engine.draft is None and set(modes) - {"ar"}:
        raise FlashtreeError(f"--modes {','.join(modes)} needs a draft model: pass --draft DIR or use --modes ar")
    modes = ["ar"] + [m for m in dict.fromkeys(modes) if m != "ar"]  # AR is every row's baseline

    sampling = sampling_from_args(args)
    base = engine.config_for(max_new_tokens=args.max_tokens, ignore_eos=True, sampling=sampling)
    sets = [load_prompt_set(spec, args.prompts) for spec in (args.dataset or ["builtin"])]
    encoded = {s.name: [engine.encode_messages(conv, **thinking_kwargs(args.think)) for conv in s.conversations]
               for s in sets}
    warmup_s = _warm_up(engine, next(iter(encoded.values()))[0], base, modes)
    rows = [row for name, prompts in encoded.items()
            for row in _bench_dataset(engine, name, prompts, base, modes, args.peers)]
    report = {"date": time.strftime("%Y-%m-%d"), "device": _device_name(engine), "model": str(engine.target.path),
              "draft": str(engine.draft_path) if engine.draft_path else None,
              "weights_bytes_per_step": weight_bytes(engine.target.model),
              "max_tokens": args.max_tokens, "prompts_per_dataset": args.prompts, "sampling": vars(sampling),
              "warmup_s": warmup_s, "rows": rows, "mean": _mean_rows(rows)}
    _print_table(report)
    save_report(report, args.out)
    return 0


def _warm_up(engine, prompt: list[int], base, modes: list[str]) -> dict[str, float]:
    """Each mode's `Engine.warm_up` over the first prompt, untimed: kernels compiled, CUDA graphs captured
    for the step shapes a request meets (a server's steady state); returns each mode's seconds, so the
    cost shows."""
    return {mode: round(engine.warm_up(prompt, replace(base, mode=mode)), 3) for mode in modes}


def _bench_dataset(engine, name: str, prompts: list[list[int]], base, modes: list[str], peers: bool) -> list[dict]:
    """One row per mode (and per peer); every row compares each prompt's tokens with our AR run's."""
    from flashtree.bench.divergence import divergences  # deferred: imports torch, which --help must not wait for

    runs = {mode: [_timed(engine, ids, replace(base, mode=mode))
                   for ids in tqdm(prompts, desc=f"{name} {mode}", unit="prompt", leave=False, file=sys.stderr)]
            for mode in modes}
    ar_tokens = [r.token_ids for r in runs["ar"]]
    rows = [_row(name, mode, base, results, ar_tokens,
                 divergences(engine, prompts, [r.token_ids for r in results], ar_tokens, base))
            for mode, results in runs.items()]
    ar_speed = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / ar_speed, 3) if ar_speed else 0.0
    if peers:
        from flashtree.bench.peers import peer_rows

        rows += peer_rows(engine, name, prompts, base.max_new_tokens, ar_tokens, ar_speed)
    return rows


def _timed(engine, ids, config):
    import torch

    result = engine.generate(ids, config)
    if engine.target.model.device.type == "cuda":
        torch.cuda.synchronize()
    return result


def _row(dataset: str, mode: str, base, results, ar_tokens, differences: list[dict]) -> dict:
    """`differences`: where the prompts whose tokens differ from AR's first differ (bench/divergence.py)."""
    tokens = sum(r.stats.new_tokens for r in results)
    steps = sum(r.stats.steps for r in results)
    committed = sum(k * v for r in results for k, v in r.stats.accepted.items())
    decode_s = sum(r.stats.decode_s for r in results)
    identical = [r.token_ids == ref for r, ref in zip(results, ar_tokens)]
    return {"dataset": dataset, "mode": mode, "budget": base.budget if mode != "ar" else None,
            "prompts": len(results), "new_tokens": tokens, "steps": steps,
            "acceptance_length": round(committed / steps, 3) if steps else 0.0,
            "tokens_per_s": round(tokens / decode_s, 2) if decode_s else 0.0,
            "ms_per_step": round(1000 * decode_s / max(steps, 1), 3),
            "identical_to_ar": sum(identical), "identical_per_prompt": identical, "divergences": differences,
            "ar_fallback_steps": sum(r.stats.ar_fallback_steps for r in results),
            "budget_switches_per_prompt": [r.stats.budget_switches for r in results]}


def _mean_rows(rows: list[dict]) -> list[dict]:
    means = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        group = [r for r in rows if r["mode"] == mode]
        means.append({"mode": mode, **{key: round(sum(r[key] for r in group) / len(group), 3)
                                       for key in ("acceptance_length", "tokens_per_s", "speedup")}})
    return means


def _print_table(report: dict) -> None:
    """The rows, then a note per prompt whose tokens differ from AR's (where, and the target's margin there)."""
    from flashtree.bench.divergence import describe  # deferred: imports torch, which --help must not wait for

    gbytes = report["weights_bytes_per_step"] / 1e9
    print(f"device: {report['device']}   model: {report['model']}   "
          f"{report['prompts_per_dataset']} prompts x {report['max_tokens']} tokens per dataset")
    print("warm-up (each mode over the first prompt, untimed): "
          + ", ".join(f"{mode} {s:.2f} s" for mode, s in report["warmup_s"].items()))
    print(f"{'dataset':<12}{'mode':<8}{'budget':>7}{'AL':>7}{'tok/s':>10}{'ms/step':>10}{'GB/s':>9}{'speedup':>9}"
          f"{'same as ar':>12}{'AR steps':>10}")
    for r in report["rows"]:
        gbs = gbytes / (r["ms_per_step"] / 1000) if r["ms_per_step"] else 0.0
        # steps the adaptive policy ran as AR (ours only: AR and the peers have none to report)
        fallback = r.get("ar_fallback_steps", "-") if r["mode"] != "ar" else "-"
        print(f"{r['dataset']:<12}{r['mode']:<8}{str(r['budget'] or '-'):>7}{r['acceptance_length']:>7.2f}"
              f"{r['tokens_per_s']:>10.1f}{r['ms_per_step']:>10.2f}{gbs:>9.1f}{r['speedup']:>8.2f}x"
              f"{r['identical_to_ar']:>7}/{r['prompts']}{fallback:>10}")
    if len({r["dataset"] for r in report["rows"]}) > 1:
        for m in report["mean"]:
            print(f"{'mean':<12}{m['mode']:<8}{'':>7}{m['acceptance_length']:>7.2f}{m['tokens_per_s']:>10.1f}"
                  f"{'':>19}{m['speedup']:>8.2f}x")
    for r in report["rows"]:
        for entry in r.get("divergences", []):  # peer rows report identity without positions
            print(describe(r["dataset"], r["mode"], entry))



def _device_name(engine) -> str:
    import torch

    dev = engine.target.model.device
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"


def _synthetic_engine(args, settings: EngineArgs):
    """The engine over a random-weight model of shape `args.synthetic`, built in device memory (no file), on
    the placement of `settings`. Under tensor parallel every rank builds the same weights and keeps its share
    (as a file is loaded), with a plain engine over it: the benchmark runs on every rank in lock step."""
    from flashtree.engine.loader import engine_from_target, random_target
    from flashtree.engine.process_memory import cap_process_memory
    from flashtree.models.random_weights import shape_config
    from flashtree.parallel.placement import place_layers, resolve_device, resolve_placement
    from flashtree.parallel.tp import check_placement, join_group

    overrides = {}
    if getattr(args, "multi_turn", False):  # room for the long system prompt and the turns
        overrides["context_length"] = max(synthetic_shapes()[args.synthetic].get("context_length", 4096),
                                          2 * args.system_tokens + 8192)
    config = shape_config(args.synthetic, **overrides)
    check_placement(settings.tensor_parallel, settings.gpus, settings.layer_split, settings.draft_device)
    if settings.tensor_parallel > 1:
        shard = join_group(settings.tensor_parallel, settings.device)
        cap_process_memory([shard.device], settings.gpu_memory, settings.cuda_overhead)
        print(f"building random {args.synthetic} ({args.scheme}), rank {shard.rank}'s shard on {shard.device} ...")
        # each layer is generated and cut on the rank's own device: the host path is minutes at 27B
        target = random_target(config, args.scheme, shard.device, shard=shard, echo=args.echo)
        return engine_from_target(target, settings)
    devices, split = resolve_placement(settings.device, settings.gpus, settings.layer_split)
    device = devices[0] if devices else resolve_device(settings.device)
    draft_device = [resolve_device(settings.draft_device)] if settings.draft_device else []
    cap_process_memory([*(devices or [device]), *draft_device], settings.gpu_memory, settings.cuda_overhead)
    print(f"building random {args.synthetic} ({args.scheme}) in memory on {device} ...")
    target = random_target(config, scheme=args.scheme, device=device, echo=args.echo)
    if devices:
        place_layers(target.model, devices, split)
    return engine_from_target(target, settings)
