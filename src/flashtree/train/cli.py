"""`flashtree train target|draft`: train the small demo target (GGUF) and a DFlash draft for a target.

torch and the engine are imported inside the functions that run the command: `flashtree --help` builds
every subcommand's parser and must not wait for them."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields, replace
from pathlib import Path

from flashtree.cli.args import given, int_range
from flashtree.errors import FlashtreeError


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a small qwen35 target or a DFlash draft (see docs/TRAINING.md)")
    tsub = p.add_subparsers(dest="train_command", required=True)

    t = tsub.add_parser("target", help="train a small qwen35 model from scratch on Python source; write target.gguf")
    t.add_argument("--out", required=True, help="output directory (target.gguf, target-train.json)")
    t.add_argument("--steps", type=int_range(1), default=None)
    t.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    t.add_argument("--batch-size", type=int_range(1), default=None)
    t.add_argument("--seq-len", type=int_range(2), default=None)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    t.add_argument("--source", action="append", default=None,
                   help="folder of .py files to train on (repeatable; default: stdlib + site-packages)")
    t.add_argument("--max-chars", type=int_range(1), default=None, help="corpus size cap in characters")
    t.add_argument("--scheme", default=None, help="GGUF quant mix: q4_k_m (default), q8_0, f16, f32")
    t.add_argument("--shape", default=None,
                   help='JSON overrides of the model shape, e.g. \'{"hidden_size": 512, "num_layers": 12}\'')
    t.add_argument("--seed", type=int, default=None)
    t.set_defaults(handler=run_target)

    d = tsub.add_parser("draft", help="train a DFlash draft for a qwen35 GGUF target (z-lab format output)")
    d.add_argument("--target", required=True, help="target GGUF")
    d.add_argument("--out", required=True, help="output directory (config.json, model.safetensors)")
    d.add_argument("--steps", type=int_range(1), default=None)
    d.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    d.add_argument("--prompts", type=int_range(1), default=None, help="number of prompts whose responses the target writes")
    d.add_argument("--max-new-tokens", type=int_range(1), default=None)
    d.add_argument("--max-chars", type=int_range(1), default=None,
                   help="characters of Python source read for prompts (about 600 instruction pairs per 1M)")
    d.add_argument("--temperature", type=float, default=None, help="0 = greedy responses (default)")
    d.add_argument("--generator", choices=("hf", "engine"), default=None,
                   help="batched transformers model with the GGUF's weights (hf, the default) or flashtree's engine")
    d.add_argument("--features", choices=("engine", "hf"), default=None,
                   help="target features from flashtree's forward (engine, the default) or batched through transformers (hf)")
    d.add_argument("--layers", type=int_range(1), default=None, help="draft decoder layers")
    d.add_argument("--feature-layers", type=int_range(1), default=None, help="target layers whose outputs condition the draft")
    d.add_argument("--block-size", type=int_range(2), default=None)
    d.add_argument("--batch-size", type=int_range(1), default=None)
    d.add_argument("--gen-batch-size", type=int_range(1), default=None, help="prompts per batch when the target writes responses")
    d.add_argument("--anchors", type=int_range(1), default=None, help="blocks per sequence per step")
    d.add_argument("--lr", type=float, default=None)
    d.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    d.add_argument("--seed", type=int, default=None)
    d.add_argument("--init", default=None, help="continue training this z-lab draft directory (its shape is kept)")
    d.set_defaults(handler=run_draft)


def _device(name: str) -> str:
    from flashtree.parallel.placement import resolve_device

    return str(resolve_device(name))


def _writable_dir(path: str) -> str:
    """`--out`, created and checked before any training, so a long run never fails at its save."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FlashtreeError(f"--out {path}: cannot create it ({exc.strerror})") from None
    if not os.access(path, os.W_OK):
        raise FlashtreeError(f"--out {path}: not writable")
    return path


def run_target(args: argparse.Namespace) -> int:
    from flashtree.train.target import TargetShape, TrainConfig, train_target

    shape = TargetShape()
    if args.shape:
        try:
            overrides = json.loads(args.shape)
            shape = replace(shape, **overrides)
        except (json.JSONDecodeError, TypeError) as e:
            known = ", ".join(f.name for f in fields(TargetShape))
            raise FlashtreeError(f"--shape: {e} (keys: {known})") from e
    train = TrainConfig(**given(steps=args.steps, time_budget_s=args.time_budget, batch_size=args.batch_size,
                                seq_len=args.seq_len, lr=args.lr, seed=args.seed))
    result = train_target(_writable_dir(args.out), shape, train, _device(args.device), roots=args.source, log=_log,
                          **given(max_chars=args.max_chars, scheme=args.scheme))
    print(json.dumps(result["summary"]["target"]))
    return 0


def run_draft(args: argparse.Namespace) -> int:
    from flashtree.train.draft import DraftTrainConfig, train_draft

    cfg = DraftTrainConfig(**given(
        num_layers=args.layers, num_feature_layers=args.feature_layers, block_size=args.block_size,
        num_prompts=args.prompts, corpus_chars=args.max_chars, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, init_from=args.init, gen_batch_size=args.gen_batch_size, generator=args.generator,
        feature_source=args.features, steps=args.steps, time_budget_s=args.time_budget, batch_size=args.batch_size,
        anchors=args.anchors, lr=args.lr, seed=args.seed))
    result = train_draft(args.target, _writable_dir(args.out), cfg, _device(args.device), log=_log)
    print(json.dumps(result["summary"]["draft"]))
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m flashtree.train.cli target|draft ...` (the same commands without the main CLI)."""
    parser = argparse.ArgumentParser(prog="flashtree")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.handler(args) or 0
    except FlashtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
