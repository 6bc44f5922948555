"""Issue #19 experiment: bf16 rounding sites emulated in the float32 CPU model, one variant per line.
usage: python sites.py MODEL.gguf VARIANT... ; VARIANT = name:site=dtype,site=dtype  (dtype bf16|fp16)
       special 'real-bf16' = the unmodified bf16 model."""
import sys, torch
from flashtree import _sites
from flashtree.bench.fidelity import teacher_forced, compare, _combine
from flashtree.engine.loader import load_engine, load_target
from flashtree.engine.config import EngineArgs
from flashtree.bench.datasets import load_prompt_set
from flashtree.bench.cli import thinking_kwargs

ALL = "embed resid in_proj in_res in_head out_proj out_res out_head weights silu conv qk kv attn_p attn_out gate".split()
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": "tf32"}

def parse(spec):
    name, _, body = spec.partition(":")
    sites = {}
    for item in filter(None, body.split(",")):
        key, _, dt = item.partition("=")
        dt = DT[dt or "bf16"]
        if key == "all":
            sites.update({s: dt for s in ALL})
        elif key.startswith("-"):
            sites.pop(key[1:], None)
        else:
            sites[key] = dt
    return name, sites

import os
DECODE = os.environ.get("DECODE") == "1"
from flashtree.bench.fidelity import Run


def decode_forced(target, ids):
    """The same sequence one token per forward (the decode path: conv state, recurrent step)."""
    model = target.model
    cache = model.new_cache(len(ids))
    layers = list(range(model.config.num_layers))
    logits, feats = [], []
    for t in ids:
        out = model.forward(torch.tensor([t]), cache, capture=layers)
        logits.append(out.logits.float()); feats.append(out.features.float())
    hidden = torch.cat(feats).reshape(len(ids), len(layers), -1).transpose(0, 1)
    return Run(torch.cat(logits), hidden)


model = sys.argv[1]
ref_engine = load_engine(EngineArgs(model=model, device="cpu", spec="ar"))
seqs = [ref_engine.encode_messages(c, **thinking_kwargs(None)) for c in load_prompt_set("builtin", 4).conversations]
ref = ref_engine.target
attention = set(ref.config.attention_layers)
refs = [teacher_forced(ref, ids) for ids in seqs]
for spec in sys.argv[2:]:
    name, sites = parse(spec)
    _sites.SITES.clear()
    if name == "real-bf16":
        target = load_target(ref.path, device="cpu", dtype=torch.bfloat16)
    else:
        _sites.SITES.update(sites)
        target = load_target(ref.path, device="cpu", dtype=torch.float32)
    runs = [(decode_forced if DECODE else teacher_forced)(target, ids) for ids in seqs]
    rows = [compare(run, rr) for run, rr in zip(runs, refs)]
    rms = max(((run.logits - rr.logits).norm() / rr.logits.norm()).item() for run, rr in zip(runs, refs))
    c = _combine(rows, attention)
    _sites.SITES.clear()
    print(f"{name:28s} {100*c['max_rel_logit_error']:7.3f}%  {c['argmax_agree_decided']:>3}/{c['decided_positions']:<3} rms {100*rms:5.2f}% "
          f"all {c['argmax_agree_all']:>3}/{c['positions']:<3} L3 {c['layer_rel_error'][-1]:.2e}"
          f"  | {','.join(f'{k}' + ('' if v == torch.bfloat16 else '=' + str(v).replace('torch.float16', 'fp16')) for k, v in sites.items()) if name!='real-bf16' else ''}", flush=True)
