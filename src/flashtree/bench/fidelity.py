"""`flashtree bench --fidelity`: how far a device's logits are from the CPU float32 run, and where the error
comes from.

The same token sequences (the prompt set's prompts, teacher-forced: no sampling, so both runs see the
same inputs) go through the CPU float32 model (the reference) and through the device model in each
dtype asked for. Per dtype it reports:
- the max relative logit error: max |logit - reference| over all positions / the largest |reference logit|;
- argmax agreement at the positions whose reference margin (top-1 minus top-2 logit) is above 0.1;
- the same once more with the tokens fed one a forward (the decode path: one-row kernels);
- per layer, the relative error of the hidden state (||h - h_ref|| / ||h_ref||, over all positions) and
  the layer that adds the most to it (the largest step from one layer's error to the next).
With `peers`, transformers' Qwen3.5 holding the same dequantized weights runs the same sequences in each
dtype on the same device, against the same reference: how far a plain implementation in that dtype lands
(a random-weight model amplifies bf16 rounding far more than a trained one).
The reference must fit on the CPU in float32 (tests and small models; a 27B target does not).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashtree.engine.loader import Target, load_target
from flashtree.train.convert import hf_model_from_gguf

MARGIN = 0.1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Run:
    logits: torch.Tensor  # [T, vocab] float32, on the CPU
    hidden: torch.Tensor  # [layers, T, hidden] float32, on the CPU


def teacher_forced(target: Target, ids: list[int]) -> Run:
    model = target.model
    layers = list(range(model.config.num_layers))
    out = model.forward(torch.tensor(ids), model.new_cache(len(ids)), capture=layers)
    hidden = out.features.float().cpu().reshape(len(ids), len(layers), -1).transpose(0, 1)
    return Run(out.logits.float().cpu(), hidden)


def decoded(target: Target, ids: list[int]) -> Run:
    """The same figures with one token a forward, as decoding runs them (the one-row matmul kernels)."""
    model = target.model
    layers = list(range(model.config.num_layers))
    cache = model.new_cache(len(ids))
    outs = [model.forward(torch.tensor([token]), cache, capture=layers) for token in ids]
    logits = torch.cat([out.logits.float().cpu().reshape(1, -1) for out in outs])
    hidden = torch.cat([out.features.float().cpu().reshape(1, len(layers), -1) for out in outs]).transpose(0, 1)
    return Run(logits, hidden)


def compare(run: Run, ref: Run) -> dict:
    """One sequence's figures against its reference run."""
    return {**compare_logits(run.logits, ref),
            "layer_rel_error": [((h - r).norm() / r.norm().clamp_min(1e-30)).item()
                                for h, r in zip(run.hidden, ref.hidden)]}


def compare_logits(logits: torch.Tensor, ref: Run) -> dict:
    """The logit figures of one sequence (a peer has no hidden states to compare)."""
    scale = ref.logits.abs().max().clamp_min(1e-30)
    top2 = ref.logits.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > MARGIN
    agree = logits.argmax(-1) == ref.logits.argmax(-1)
    return {"max_rel_logit_error": ((logits - ref.logits).abs().max() / scale).item(),
            "decided_positions": int(decided.sum()), "argmax_agree_decided": int((agree & decided).sum()),
            "argmax_agree_all": int(agree.sum()), "positions": len(agree)}


def peer_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' teacher-forced logits of one sequence, float32 on the CPU."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float().cpu()


def run_fidelity(reference: Target, device: str, dtypes: list[str], sequences: list[list[int]],
                 out: str | None, peers: bool = False) -> dict:
    """`reference`: the model loaded on the CPU in float32. Returns (and prints, and writes to `out` when
    given) the fidelity report; with `peers`, transformers' rows beside ours."""
    model_path = reference.path
    attention = set(reference.config.attention_layers)
    refs = [teacher_forced(reference, ids) for ids in sequences]
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": str(reference.path), "device": device,
              "tokens": sum(map(len, sequences)), "dtypes": {}}
    for name in dtypes:
        target = load_target(model_path, device=device, dtype=DTYPES[name])
        rows = [compare(teacher_forced(target, ids), ref) for ids, ref in zip(sequences, refs)]
        report["dtypes"][name] = _combine(rows, attention)
        rows = [compare(decoded(target, ids), ref) for ids, ref in zip(sequences, refs)]
        report["dtypes"][name]["decode"] = _combine(rows, attention)
        del target
    if peers:
        report["transformers"] = _peer_rows(model_path, device, dtypes, sequences, refs)
    _print(report)
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
    return report


def _peer_rows(model_path, device: str, dtypes: list[str], sequences: list[list[int]], refs: list[Run]) -> dict:
    hf, _ = hf_model_from_gguf(model_path)
    report = {}
    for name in dtypes:
        model = hf.to(device, DTYPES[name]).eval()
        rows = [compare_logits(peer_logits(model, ids), ref) for ids, ref in zip(sequences, refs)]
        report[name] = {"max_rel_logit_error": max(r["max_rel_logit_error"] for r in rows),
                        **{key: sum(r[key] for r in rows) for key in
                           ("decided_positions", "argmax_agree_decided", "positions", "argmax_agree_all")}}
    return report


def _combine(rows: list[dict], attention: set[int]) -> dict:
    """All sequences together; the largest contributor is the layer whose own step adds the most to the
    (worst sequence's) hidden-state error."""
    layers = len(rows[0]["layer_rel_error"])
    layer_error = [max(r["layer_rel_error"][i] for r in rows) for i in range(layers)]
    steps = [layer_error[0]] + [b - a for a, b in zip(layer_error, layer_error[1:])]
    worst = max(range(layers), key=steps.__getitem__)
    return {"max_rel_logit_error": max(r["max_rel_logit_error"] for r in rows),
            "decided_positions": sum(r["decided_positions"] for r in rows),
            "argmax_agree_decided": sum(r["argmax_agree_decided"] for r in rows),
            "positions": sum(r["positions"] for r in rows),
            "argmax_agree_all": sum(r["argmax_agree_all"] for r in rows),
            "layer_rel_error": layer_error, "largest_contributor": worst,
            "largest_contributor_kind": "attention" if worst in attention else "deltanet"}


def _print(report: dict) -> None:
    print(f"fidelity against the CPU float32 run: {report['model']} on {report['device']}, "
          f"{report['tokens']} teacher-forced tokens")
    print(f"{'dtype':9} {'max rel logit err':>17} {'argmax (margin > 0.1)':>22} {'argmax (all)':>13} "
          f"{'last layer err':>14}  largest contributor")
    for name, r in report["dtypes"].items():
        for label, row in ((name, r), ("  decode", r["decode"])):
            print(f"{label:9} {100 * row['max_rel_logit_error']:16.3f}% "
                  f"{row['argmax_agree_decided']:>10}/{row['decided_positions']:<11} "
                  f"{row['argmax_agree_all']:>6}/{row['positions']:<6} {row['layer_rel_error'][-1]:14.2e}  "
                  f"layer {row['largest_contributor']} ({row['largest_contributor_kind']})")
    for name, r in report.get("transformers", {}).items():
        print(f"{'hf ' + name:9} {100 * r['max_rel_logit_error']:16.3f}% "
              f"{r['argmax_agree_decided']:>10}/{r['decided_positions']:<11} "
              f"{r['argmax_agree_all']:>6}/{r['positions']:<6}  (transformers, same weights and dtype)")
