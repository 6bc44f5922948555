"""`flashtree bench --peers`: reference implementations on the same prompts, in the same run.

- `hf-ar`: transformers' Qwen3.5 model holding the GGUF's dequantized weights, greedy `generate`
  (bf16 on CUDA, float32 on the CPU).
- `zlab-dflash`: the z-lab `dflash` package's own speculative loop (`dflash_generate`, chain
  verification of each 16-token block) with our draft's weights in its `DFlashDraftModel` and the
  same transformers target.

Rows report tok/s of the decode (prefill included, as these APIs do not separate it; prompts are
short), the acceptance length where it is defined, and how many outputs equal flashtree's AR tokens.
Note: the reference loop rolls the target's cache back by cropping it, which does not restore the
Gated DeltaNet state of a hybrid target, so its output can drift from greedy decoding.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from flashtree.bench.steps import clock
from flashtree.models.random_weights import RandomWeights
from flashtree.train.convert import hf_model_from_gguf
PEERS = ("hf-ar", "zlab-dflash")


def peer_rows(engine, dataset: str, prompts: list[list[int]], max_tokens: int, ar_tokens: list[list[int]],
              ar_speed: float) -> list[dict]:
    target = _hf_target(engine)
    rows = [_hf_ar_row(target, dataset, prompts, max_tokens, ar_tokens)]
    if engine.draft is not None and hasattr(engine.draft, "forward_block"):
        rows.append(_zlab_row(target, _zlab_draft(engine.draft, target), dataset, prompts, max_tokens, ar_tokens))
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / ar_speed, 3) if ar_speed else 0.0
    return rows


def _hf_target(engine):
    """transformers' model with the target's weights; an in-memory synthetic target is written to a
    temporary GGUF first (transformers reads files)."""
    device = engine.target.model.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = engine.target.path
    if isinstance(engine.target.gguf, RandomWeights):
        path = engine.target.gguf.write_gguf(Path(tempfile.mkdtemp()) / "synthetic.gguf", engine.target.tokenizer.spec)
    model, _ = hf_model_from_gguf(path)
    return model.to(device, dtype).eval()


def _zlab_draft(draft, target):
    from dflash.model import DFlashDraftModel  # optional, as transformers: the peers need the test extra
    from transformers import Qwen3Config

    model = DFlashDraftModel(Qwen3Config(**draft.config.to_json()))
    model.load_state_dict({k: v.detach() for k, v in draft.state_dict().items()})
    return model.to(target.device, target.dtype).eval()


def _hf_ar_row(target, dataset, prompts, max_tokens, ar_tokens) -> dict:
    outputs, seconds = [], 0.0
    for ids in prompts:
        inputs = torch.tensor([ids], device=target.device)
        start = clock(target.device)
        with torch.inference_mode():
            out = target.generate(inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                  attention_mask=torch.ones_like(inputs))
        seconds += clock(target.device) - start
        outputs.append(out[0, len(ids):].tolist())
    return _row(dataset, "hf-ar", outputs, seconds, None, ar_tokens)


def _zlab_row(target, draft, dataset, prompts, max_tokens, ar_tokens) -> dict:
    from dflash.model import dflash_generate  # optional: the test extra

    calls = [0]
    hook = target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    outputs, seconds, steps = [], 0.0, 0
    try:
        for ids in prompts:
            calls[0] = 0
            start = clock(target.device)
            out = dflash_generate(draft, target, torch.tensor([ids], device=target.device), max_tokens, None)
            seconds += clock(target.device) - start
            outputs.append(out[0, len(ids):].tolist())
            steps += calls[0] - 1  # every target call after the prefill verifies one block
    finally:
        hook.remove()
    return _row(dataset, "zlab-dflash", outputs, seconds, steps, ar_tokens)


def _row(dataset, mode, outputs, seconds, steps, ar_tokens) -> dict:
    tokens = sum(map(len, outputs))
    identical = [out == ref for out, ref in zip(outputs, ar_tokens)]
    return {"dataset": dataset, "mode": mode, "budget": 15 if mode == "zlab-dflash" else None,
            "prompts": len(outputs), "new_tokens": tokens, "steps": steps if steps is not None else tokens,
            "acceptance_length": round(tokens / steps, 3) if steps else 1.0,
            "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "ms_per_step": round(1000 * seconds / max(steps or tokens, 1), 3),
            "identical_to_ar": sum(identical), "identical_per_prompt": identical}
