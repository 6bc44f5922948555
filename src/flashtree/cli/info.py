"""`flashtree info PATH.gguf`: what a model file holds and what it needs, without loading weights.

torch and the engine are imported inside the functions that run the command: `flashtree --help` builds
every subcommand's parser and must not wait for them."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from flashtree.cli.args import int_range
from flashtree.errors import FlashtreeError

GIB = 1024**3


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="describe a GGUF model: architecture, sizes, quant types, memory")
    p.add_argument("path", help="model GGUF, or demo: the embedded demo target")
    p.add_argument("--tensors", action="store_true", help="list every tensor with its type and shape")
    p.add_argument("--ctx", type=int_range(1), default=4096, help="context size for the KV memory estimate (default 4096)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check-weights", action="store_true",
                   help="also decode every weight and fail if any is not finite (NaN/inf scales of a corrupt file)")
    p.set_defaults(handler=run)


def describe(path: str, ctx: int) -> dict:
    # deferred: these import torch, which `flashtree info --help` must not wait for
    from flashtree.engine.loader import model_path
    from flashtree.formats.gguf_file import GGUFFile
    from flashtree.formats.quants import type_name
    from flashtree.models.gguf_config import check_tensor_types, read_config

    gguf = GGUFFile(model_path(path))
    config, tokenizer = read_config(gguf)
    check_tensor_types(gguf, config)
    c = config
    types = Counter(type_name(t.qtype) for t in gguf.tensors.values())
    weight_bytes = sum(t.nbytes for t in gguf.tensors.values())
    kv_per_token = len(c.attention_layers) * 2 * c.num_kv_heads * c.head_dim * 2  # bf16 K and V
    state = len(c.deltanet_layers) * (c.gdn_v_heads * c.gdn_head_dim**2 * 4 + (c.conv_kernel - 1) * c.conv_dim * 2)
    return {
        "path": str(gguf.path), "architecture": gguf.get("general.architecture"), "name": c.name,
        "layers": c.num_layers, "attention_layers": len(c.attention_layers), "deltanet_layers": len(c.deltanet_layers),
        "mtp_layers": c.num_mtp_layers, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "heads": f"{c.num_heads} q / {c.num_kv_heads} kv x {c.head_dim}",
        "deltanet_heads": f"{c.gdn_qk_heads} qk / {c.gdn_v_heads} v x {c.gdn_head_dim}",
        "vocab_size": c.vocab_size, "context_length": c.context_length, "rope_theta": c.rope_theta,
        "tokenizer": f"{tokenizer.model}/{tokenizer.pre}, {len(tokenizer.tokens)} tokens" if tokenizer else None,
        "chat_template": bool(tokenizer and tokenizer.chat_template),
        "tensor_types": dict(sorted(types.items())), "weights_gib": round(weight_bytes / GIB, 3),
        "kv_cache_gib_at_ctx": round(kv_per_token * ctx / GIB, 3), "deltanet_state_mib": round(state / 2**20, 2),
        "ctx_for_estimate": ctx,
        "tensors": [{"name": t.name, "type": type_name(t.qtype), "shape": list(t.shape)} for t in gguf.tensors.values()],
    }


def check_weights(path: str) -> None:
    from flashtree.engine.loader import model_path  # deferred: imports torch
    from flashtree.formats.gguf_file import GGUFFile

    bad = GGUFFile(model_path(path)).non_finite_tensors()
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise FlashtreeError(f"{path}: non-finite values (NaN or inf) in {len(bad)} tensors: {shown}; the file is corrupt")


def run(args: argparse.Namespace) -> int:
    info = describe(args.path, args.ctx)
    if args.check_weights:
        check_weights(args.path)
        info["weights"] = "all finite"
    if not args.tensors:
        info.pop("tensors")
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if key != "tensors":
            print(f"{key:>22}: {value}")
    for t in info.get("tensors", []):
        print(f"  {t['name']:<40} {t['type']:<7} {t['shape']}")
    return 0
