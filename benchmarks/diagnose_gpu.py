#!/usr/bin/env python3
"""GPU diagnosis in one device call: which fused path disagrees with the torch reference, and where
the time of a 27B-shaped step goes.

    python3 benchmarks/diagnose_gpu.py --out $OUT/diagnose.json [--parts fla,agree,profile]

fla: fla-core's chunked gated delta rule against the torch reference at the 27B head sizes, by decay.
agree: a 4-layer model of the 27B widths (3 Gated DeltaNet + 1 attention), random Q4_K_M weights on the
  GPU. The reference is the torch path (dense weights, torch attention and DeltaNet, no fla); each
  variant turns on one fused piece (quantized Triton matmuls, fla prefill, Triton DeltaNet, the graphed
  static steps with Triton attention) or all. For each: prefill logits, 4 AR decode steps, and a chain
  verify of the same 4 tokens through Engine.step_forward; max |diff| / max |ref| and argmax agreement.
profile: the full 27B shape; torch.profiler kernel totals of one eager AR step, one eager budget-22
  verify and one 512-token prefill chunk (top kernels by GPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from flashtree.engine.generate import Engine  # noqa: E402
from flashtree.kernels import gated_delta_fla  # noqa: E402
from flashtree.models import deltanet  # noqa: E402
from flashtree.engine.loader import random_target  # noqa: E402
from flashtree.models.random_weights import shape_config  # noqa: E402
from flashtree.drafting.ddtree import DraftTree  # noqa: E402

DEVICE = os.environ.get("DIAG_DEVICE", "cuda")
SHAPE = os.environ.get("DIAG_SHAPE", "qwen3.6-27b")
VARIANTS = {  # name: (quantized matmuls, fla prefill, Triton DeltaNet, graphed steps + Triton attention)
    "reference": (False, False, False, False),
    "quant_matmul": (True, False, False, False),
    "fla_prefill": (False, True, False, False),
    "triton_deltanet": (False, False, True, False),
    "graphed_steps": (False, False, False, True),
    "all": (True, True, True, True),
}


@contextmanager
def variant(quant: bool, fla: bool, triton_deltanet: bool):
    saved = (os.environ.get("FLASHTREE_DENSE_WEIGHTS"), gated_delta_fla.available, deltanet.triton_runs_on)
    os.environ["FLASHTREE_DENSE_WEIGHTS"] = "0" if quant else "1"
    if not fla:
        gated_delta_fla.available = lambda: False
    if not triton_deltanet:
        deltanet.triton_runs_on = lambda device: False
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop("FLASHTREE_DENSE_WEIGHTS")
        else:
            os.environ["FLASHTREE_DENSE_WEIGHTS"] = saved[0]
        gated_delta_fla.available, deltanet.triton_runs_on = saved[1], saved[2]


def chain_tree(tokens: list[int]) -> DraftTree:
    return DraftTree(torch.tensor(tokens), torch.arange(-1, len(tokens) - 1), torch.arange(len(tokens)))


def run_variant(config, dtype, flags, prompt, steps=4) -> dict:
    quant, fla, fused_deltanet, graphed = flags
    with variant(quant, fla, fused_deltanet):
        target = random_target(config, "q4_k_m", DEVICE, dtype)
        engine = Engine(target)
        engine.runner.use_cuda_graphs = graphed
        model = target.model
        cache = model.new_cache(len(prompt) + 64)
        prefill = model.forward(torch.tensor(prompt), cache).logits[-1].float().cpu()
        decode, tokens = [], [int(prefill.argmax())]
        for _ in range(steps):
            logits = engine.runner.step_forward(torch.tensor(tokens[-1:]), cache).logits[-1].float().cpu()
            decode.append(logits)
            tokens.append(int(logits.argmax()))
        # the same tokens again as one chain verify from the prompt's end
        cache2 = model.new_cache(len(prompt) + 64)
        model.forward(torch.tensor(prompt), cache2)
        tree = chain_tree(tokens[:steps])
        verify = engine.runner.step_forward(tree.tokens, cache2, tree, (), pad_to=23).logits[:steps].float().cpu()
    del engine, target, model, cache, cache2
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"prefill": prefill, "decode": torch.stack(decode), "verify": verify, "tokens": tokens}


def compare(ref: dict, out: dict) -> dict:
    result = {}
    for key in ("prefill", "decode", "verify"):
        r, o = ref[key], out[key]
        result[key] = {"rel_err": round(float((o - r).abs().max() / r.abs().max()), 5),
                       "argmax_equal": bool(torch.equal(o.argmax(-1), r.argmax(-1)))}
    result["verify_vs_own_decode"] = round(float((out["verify"] - out["decode"]).abs().max()
                                                 / out["decode"].abs().max()), 5)
    result["tokens_equal"] = out["tokens"] == ref["tokens"]
    return result


def agree(report: dict) -> None:
    config = shape_config(SHAPE, num_layers=4)
    prompt = torch.randint(0, config.vocab_size - 1, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    report["agree"] = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = run_variant(config, dtype, VARIANTS["reference"], prompt)
        for name, flags in VARIANTS.items():
            try:
                cmp = compare(ref, ref if name == "reference" else run_variant(config, dtype, flags, prompt))
            except Exception:  # noqa: BLE001 - a diagnosis reports every failure and goes on
                import traceback
                cmp = {"error": traceback.format_exc()[-1500:]}
            report["agree"][f"{str(dtype)[6:]} {name}"] = cmp
            print(f"{str(dtype)[6:]:9} {name:16} {json.dumps(cmp)}", flush=True)


def fla(report: dict) -> None:
    """fla-core's chunked prefill against the torch reference, by decay strength (synthetic models decay
    up to ~5 per token; fla's chunk kernels factor exp(cumsum g) and use TF32 dots on float32 inputs)."""
    from flashtree.kernels import gated_delta

    report["fla"] = {}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for t in (100, 1000):
        for decay in (0.1, 1.0, 5.0, 20.0):
            h, d = 48, 128
            q = torch.nn.functional.normalize(torch.randn(t, h, d, generator=gen, device=DEVICE), dim=-1) * d**-0.5
            k = torch.nn.functional.normalize(torch.randn(t, h, d, generator=gen, device=DEVICE), dim=-1)
            v = torch.randn(t, h, d, generator=gen, device=DEVICE)
            g = -torch.rand(t, h, generator=gen, device=DEVICE) * decay
            beta = torch.rand(t, h, generator=gen, device=DEVICE)
            state = torch.randn(h, d, d, generator=gen, device=DEVICE) * 0.1
            o_ref, s_ref = gated_delta.chunked(q, k, v, g, beta, state)
            o, s = gated_delta_fla.chunked(q, k, v, g, beta, state)
            row = {"o_rel_err": float((o - o_ref).abs().max() / o_ref.abs().max()),
                   "state_rel_err": float((s - s_ref).abs().max() / s_ref.abs().max()),
                   "finite": bool(torch.isfinite(o).all() and torch.isfinite(s).all())}
            report["fla"][f"T{t} decay{decay}"] = row
            print(f"fla T={t:5} decay {decay:5}: {json.dumps(row)}", flush=True)


def profile(report: dict) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from flashtree.bench.steps import random_draft
    from flashtree.drafting.proposer import DFlashProposer
    from flashtree.engine.decode import make_tree

    target = random_target(SHAPE, "q4_k_m", DEVICE, torch.bfloat16)
    engine = Engine(target)
    engine.runner.use_cuda_graphs = False
    model = target.model
    prompt = torch.randint(0, model.config.vocab_size - 1, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    draft = random_draft(model.config, model.device, model.dtype)
    config = engine.config_for(mode="ddtree", max_new_tokens=64, ignore_eos=True)
    proposer = DFlashProposer(model, draft, config.draft_window)
    cache = engine.runner.new_cache(len(prompt), config)
    engine.runner.prefill_prompt(cache, prompt, config, proposer)
    draft_logits = proposer.propose(prompt[-1], cache.length)
    tree = make_tree("ddtree", prompt[-1], draft_logits, 22, config.topk)
    chunk = torch.tensor(prompt[:512])
    fresh = model.new_cache(1024)
    work = {
        "ar step": lambda: engine.runner.step_forward(torch.tensor(prompt[-1:]), cache),
        "verify 22": lambda: engine.runner.step_forward(tree.tokens, cache, tree, proposer.capture_layers, pad_to=23),
        "prefill 512": lambda: (fresh.reset(), model.forward(chunk, fresh, last_only=True)),
        "draft step": lambda: proposer.propose(prompt[-1], cache.length),
    }
    report["profile"] = {}
    for name, fn in work.items():
        fn()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events)
        rows = [{"kernel": e.key[:90], "us": round(e.device_time_total, 1), "calls": e.count} for e in events[:18]]
        report["profile"][name] = {"gpu_us_total": round(total, 1), "kernels": len(events), "top": rows}
        print(f"\n== {name}: {total / 1e3:.2f} ms of kernels")
        for r in rows:
            print(f"  {r['us']:>9.1f} us {r['calls']:>5}  {r['kernel']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="fla,agree,profile")
    args = parser.parse_args()
    report: dict = {}
    for part in args.parts.split(","):
        try:
            {"fla": fla, "agree": agree, "profile": profile}[part](report)
        except Exception:  # noqa: BLE001 - keep what the other part finds
            import traceback
            traceback.print_exc()
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
