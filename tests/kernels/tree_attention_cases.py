"""Inputs for the tree attention tests, and every Triton interpreter case run in one process
(TRITON_INTERPRET=1 must be set before triton is imported, so test_tree_attention.py launches this file as
a subprocess). `python -m tests.kernels.tree_attention_cases` prints one JSON object: case id ->
max |kernel - expected| / max |expected|, expected = tree_attention_reference, or for the "model-" cases
GatedAttention._attend with the mask of Step._graphed_mask (the model's current path)."""

import json
import os
import sys
from types import SimpleNamespace

import torch

from flashtree.kernels.kv_quant import kv_type
from flashtree.kernels.tree_attention import tree_attention, tree_attention_reference

KV_HEADS, HEAD_DIM, KV_END, CAPACITY = 2, 64, 96, 100
STARTS = {1: 50, 5: 44, 23: 37}  # new rows start..start+T-1 in the middle, garbage rows after them
WINDOW = 9
CACHES = ("f32", "bf16", "q8_0", "q4_0")
T_VALUES = (1, 5, 23)
GROUPS = (1, 4)
SPLIT, BLOCK_ROWS = 3, 16  # several splits of several chunks: the combine and the chunk loop both run


def tree(n: int, seed: int = 0):
    """(parents, depths, visible = ancestor-or-self) of a draft tree; -1 = attached to the committed prefix.
    T=5 is a fixed branching tree, larger T a random one (deep enough for the window to cut into it)."""
    if n == 5:
        parents = [-1, 0, 0, 1, 2]
    else:
        g = torch.Generator().manual_seed(seed)
        parents = [-1] + [int(torch.randint(max(-1, i - 3), i, (1,), generator=g)) for i in range(1, n)]
    depths, visible = [], torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        depths.append(0 if p < 0 else depths[p] + 1)
        visible[i, i] = True
        if p >= 0:
            visible[i] |= visible[p]
    return torch.tensor(parents), torch.tensor(depths), visible


def inputs(cache: str, n: int, group: int, q_dtype=torch.float32, start=None, garbage: str = "nan", seed: int = 0,
           cache_v: str | None = None, kv_end: int = KV_END):
    """Keyword arguments of tree_attention: random q and caches, rows >= start + n filled with garbage
    ("nan": NaN floats / 0xFF bytes, which decode to a NaN fp16 scale; "finite": large finite values)."""
    g = torch.Generator().manual_seed(seed * 1000 + n * 10 + group)
    start = STARTS[n] if start is None else start
    heads = KV_HEADS * group
    q = torch.randn(heads, n, HEAD_DIM, generator=g).to(q_dtype)
    caches = []
    for name in (cache, cache_v or cache):
        t = kv_type(name)
        c = t.quantize(torch.randn(KV_HEADS, CAPACITY, HEAD_DIM, generator=g))
        if garbage == "nan":
            c[:, start + n:] = 255 if c.dtype == torch.uint8 else float("nan")
        else:
            c[:, start + n:] = t.quantize(50 * torch.randn(KV_HEADS, CAPACITY - start - n, HEAD_DIM, generator=g))
        caches.append(c)
    _, depths, visible = tree(n, seed)
    return dict(q=q, k_cache=caches[0], v_cache=caches[1], kv_type_k=cache, kv_type_v=cache_v or cache,
                start_t=torch.tensor([start]), visible=visible, positions=start + depths, kv_end=kv_end,
                scale=HEAD_DIM ** -0.5)


def model_path(args: dict, window: int) -> torch.Tensor:
    """GatedAttention._attend on the dequantized rows [0, kv_end) with Step._graphed_mask (float32)."""
    from flashtree.models.attention import GatedAttention
    from flashtree.models.step import Step

    q = args["q"]
    heads, n, _ = q.shape
    attn = GatedAttention.__new__(GatedAttention)
    attn.config = SimpleNamespace(num_heads=heads, num_kv_heads=args["k_cache"].shape[0],
                                  attention_scale=args["scale"])
    start = int(args["start_t"][0])
    step = Step(args["positions"], start, args["visible"], None, torch.arange(start, start + n), args["kv_end"],
                args["start_t"])
    keys = kv_type(args["kv_type_k"]).dequantize(args["k_cache"][:, :args["kv_end"]], q.dtype)
    values = kv_type(args["kv_type_v"]).dequantize(args["v_cache"][:, :args["kv_end"]], q.dtype)
    return attn._attend(q, keys, values, step.attention_mask(0, window))


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _cases():
    """case id -> (inputs kwargs, window, launch overrides, expected: "reference" or "model")."""
    forced = dict(split=SPLIT, block_rows=BLOCK_ROWS)
    cases = {}
    for cache in CACHES:
        for n in T_VALUES:
            for group in GROUPS:
                for window in (0, WINDOW):
                    cases[f"{cache}-t{n}-g{group}-w{window}-float32"] = (dict(cache=cache, n=n, group=group), window,
                                                                         forced, "reference")
    for n in T_VALUES:
        for group in GROUPS:
            cases[f"bf16-t{n}-g{group}-w{WINDOW}-bfloat16"] = (dict(cache="bf16", n=n, group=group,
                                                                    q_dtype=torch.bfloat16), WINDOW, forced,
                                                               "reference")
            for window in (0, WINDOW):
                cases[f"model-t{n}-g{group}-w{window}"] = (dict(cache="f32", n=n, group=group, garbage="finite"),
                                                           window, forced, "model")
    cases["q8_0-t5-g4-w0-float32-onesplit"] = (dict(cache="q8_0", n=5, group=4), 0, {}, "reference")
    cases["k_q8_0-v_q4_0-t23-g4-w9-float32"] = (dict(cache="q8_0", cache_v="q4_0", n=23, group=4), WINDOW, forced,
                                                "reference")
    cases["f32-t5-g4-start0-float32"] = (dict(cache="f32", n=5, group=4, start=0), 0, forced, "reference")
    cases["f32-t23-g1-noGarbage-float32"] = (dict(cache="f32", n=23, group=1, start=KV_END - 23), WINDOW,
                                             dict(split=5, block_rows=32), "reference")
    return cases


def case_ids() -> list[str]:
    return list(_cases())


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    errors = {}
    for case, (spec, window, launch, expected) in _cases().items():
        args = inputs(**spec)
        out = tree_attention(**args, window=window, **launch)
        assert out.shape == args["q"].shape and out.dtype == args["q"].dtype, case
        want = model_path(args, window) if expected == "model" else tree_attention_reference(**args, window=window)
        errors[case] = relative_error(out, want)
    json.dump(errors, sys.stdout)


if __name__ == "__main__":
    main()
