"""Inputs for the tree attention tests, and every Triton interpreter case run in one process
(TRITON_INTERPRET=1 must be set before triton is imported, so test_tree_attention.py launches this file as
a subprocess). `python -m tests.kernels.tree_attention_cases` prints one JSON object: case id ->
max |kernel - expected| / max |expected|, expected = tree_attention_reference, or for the "model-" cases
GatedAttention._attend with the mask of Step._graphed_mask (the model's current path). TQ3_0 cases use head_dim
128 (one 128-value group per row; one case 256) since TQ3_0 rows are whole groups; the "rotated-" cases
check the caller's convention (rotate q for TQ3_0 keys, unrotate the output for TQ3_0 values) against
attention on the un-rotated dequantized rows."""

import json
import os
import sys
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from flashtree.kernels.activations import gated_heads_reference
from flashtree.kernels.kv_quant import rotate, kv_type, unrotate
from flashtree.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference, rope_tables_reference
from flashtree.kernels.tree_attention import _byte_perm, tq3_pair_values, tree_attention, tree_attention_reference

KV_HEADS, HEAD_DIM, KV_END, CAPACITY = 2, 64, 96, 100
TQ3_HEAD_DIM = 128  # TQ3_0 rows are whole 128-value groups
STARTS = {1: 50, 5: 44, 23: 37}  # new rows start..start+T-1 in the middle, garbage rows after them
WINDOW = 9
CACHES = ("f32", "bf16", "q8_0", "q4_0", "tq3_0")
TQ3_MIXED = (("tq3_0", "f32"), ("f32", "tq3_0"))  # (K, V): TQ3_0 keys only / values only
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
           cache_v: str | None = None, kv_end: int = KV_END, head_dim: int | None = None, causal: bool = False):
    """Keyword arguments of tree_attention: random q and caches, rows >= start + n filled with garbage
    ("nan": NaN floats / 0xFF bytes, which decode to a NaN fp16 scale / norm; "finite": large finite values).
    head_dim defaults to HEAD_DIM, or TQ3_HEAD_DIM when either side is TQ3_0. `causal`: the new tokens are a
    run (a prefill chunk), not a tree."""
    g = torch.Generator().manual_seed(seed * 1000 + n * 10 + group)
    start = STARTS[n] if start is None else start
    if head_dim is None:
        head_dim = TQ3_HEAD_DIM if "tq3_0" in (cache, cache_v) else HEAD_DIM
    heads = KV_HEADS * group
    q = torch.randn(heads, n, head_dim, generator=g).to(q_dtype)
    caches = []
    for name in (cache, cache_v or cache):
        t = kv_type(name)
        c = t.quantize(torch.randn(KV_HEADS, CAPACITY, head_dim, generator=g))
        if garbage == "nan":
            c[:, start + n:] = 255 if c.dtype == torch.uint8 else float("nan")
        else:
            c[:, start + n:] = t.quantize(50 * torch.randn(KV_HEADS, CAPACITY - start - n, head_dim, generator=g))
        caches.append(c)
    if causal:
        depths, visible = torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
    else:
        _, depths, visible = tree(n, seed)
    return dict(q=q, k_cache=caches[0], v_cache=caches[1], kv_type_k=cache, kv_type_v=cache_v or cache,
                start_t=torch.tensor([start]), visible=visible, positions=start + depths, kv_end=kv_end,
                scale=head_dim ** -0.5)


def model_path(args: dict, window: int, unrotated: bool = False) -> torch.Tensor:
    """GatedAttention._attend on the dequantized rows [0, kv_end) with Step._graphed_mask (float32);
    `unrotated`: TQ3_0 rows are rotated back to the original domain first (`unrotate`)."""
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
    if unrotated:
        keys = unrotate(keys) if kv_type(args["kv_type_k"]).rotated else keys
        values = unrotate(values) if kv_type(args["kv_type_v"]).rotated else values
    return attn._attend(q, keys, values, step, 0, window)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _cases():
    """case id -> (inputs kwargs, window, launch overrides, expected: "reference", "model", "rotated",
    "unrotated", "gated", "normed" or "pairs")."""
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
    for cache, cache_v in TQ3_MIXED:
        for n in T_VALUES:
            for group in GROUPS:
                for window in (0, WINDOW):
                    cases[f"k_{cache}-v_{cache_v}-t{n}-g{group}-w{window}-float32"] = (
                        dict(cache=cache, cache_v=cache_v, n=n, group=group), window, forced, "reference")
    for n in (5, 23):
        cases[f"tq3_0-t{n}-g4-w{WINDOW}-bfloat16"] = (dict(cache="tq3_0", n=n, group=4, q_dtype=torch.bfloat16),
                                                       WINDOW, forced, "reference")
    for cache, cache_v in (("tq3_0", "tq3_0"),) + TQ3_MIXED:
        cases[f"rotated-k_{cache}-v_{cache_v}-t23-g4-w{WINDOW}"] = (
            dict(cache=cache, cache_v=cache_v, n=23, group=4, garbage="finite"), WINDOW, forced, "rotated")
    # TQ3_0 values rotated back by the kernel (`unrotate_values`), the gate after: in the combine (splits) and
    # in torch (one split); values of another type are not rotated
    for cache, cache_v, n, launch in (("tq3_0", "tq3_0", 23, forced), ("tq3_0", "tq3_0", 5, {"split": 1}),
                                      ("f32", "tq3_0", 1, forced), ("tq3_0", "f32", 5, forced)):
        cases[f"unrotated-k_{cache}-v_{cache_v}-t{n}-g4-w{WINDOW}-split{launch['split']}"] = (
            dict(cache=cache, cache_v=cache_v, n=n, group=4, garbage="finite"), WINDOW, launch, "unrotated")
    cases["unrotated-k_tq3_0-v_tq3_0-d256-t5-g4-w0-split2"] = (
        dict(cache="tq3_0", n=5, group=4, head_dim=256, garbage="finite"), 0, dict(split=2, block_rows=32),
        "unrotated")
    cases["k_tq3_0-v_q4_0-t5-g4-w0-float32-onesplit"] = (dict(cache="tq3_0", cache_v="q4_0", n=5, group=4), 0, {},
                                                         "reference")
    cases["tq3_0-d256-t5-g4-w0-float32"] = (dict(cache="tq3_0", n=5, group=4, head_dim=256), 0,
                                            dict(split=2, block_rows=32), "reference")
    cases["q8_0-t5-g4-w0-float32-onesplit"] = (dict(cache="q8_0", n=5, group=4), 0, {}, "reference")
    cases["k_q8_0-v_q4_0-t23-g4-w9-float32"] = (dict(cache="q8_0", cache_v="q4_0", n=23, group=4), WINDOW, forced,
                                                "reference")
    cases["f32-t5-g4-start0-float32"] = (dict(cache="f32", n=5, group=4, start=0), 0, forced, "reference")
    cases["f32-t23-g1-noGarbage-float32"] = (dict(cache="f32", n=23, group=1, start=KV_END - 23), WINDOW,
                                             dict(split=5, block_rows=32), "reference")
    for cache in ("q8_0", "tq3_0"):  # a short prefill chunk (a causal run, not a tree) over a quantized cache
        cases[f"{cache}-prefill-t40-g4-w0-float32"] = (dict(cache=cache, n=40, group=4, start=40, causal=True), 0,
                                                       forced, "reference")
    # the default split choice with short chunks (several splits of whole committed chunks, then the chunks
    # holding start), and start on a chunk boundary (the masked chunks begin exactly at the new rows)
    for n, window in ((23, 0), (23, WINDOW), (5, WINDOW)):
        cases[f"f16-t{n}-g4-w{window}-defaultsplits-float32"] = (dict(cache="f16", n=n, group=4), window,
                                                                 {"block_rows": 16}, "reference")
    cases["f32-t23-g4-w9-alignedstart-float32"] = (dict(cache="f32", n=23, group=4, start=48), WINDOW,
                                                   {"split": 2, "block_rows": 16}, "reference")
    cases["q8_0-t1-g4-w0-manysplits-float32"] = (dict(cache="q8_0", n=1, group=4), 0,
                                                 {"split": 6, "block_rows": 16}, "reference")
    for cache, n in (("q8_0", 23), ("tq3_0", 1), ("tq3_0", 5)):  # quantized rows at the launch defaults
        cases[f"{cache}-t{n}-g4-w{WINDOW}-defaults-float32"] = (dict(cache=cache, n=n, group=4), WINDOW, {},
                                                                "reference")
    cases["q4_0-prefill-t40-g4-w9-float32"] = (dict(cache="q4_0", n=40, group=4, start=40, causal=True), WINDOW,
                                               {}, "reference")
    # the output gate at the store: through the combine (splits) and straight from the row loop (one split)
    cases["gated-f32-t23-g4-w9-float32"] = (dict(cache="f32", n=23, group=4), WINDOW, forced, "gated")
    cases["gated-q8_0-t5-g4-w0-float32-onesplit"] = (dict(cache="q8_0", n=5, group=4), 0, {"split": 1}, "gated")
    cases["gated-bf16-t5-g4-w9-bfloat16"] = (dict(cache="bf16", n=5, group=4, q_dtype=torch.bfloat16), WINDOW, forced,
                                             "gated")
    # and the query's norm and RoPE at its load, from the raw projection rows
    cases["normed-gated-f32-t23-g4-w9-float32"] = (dict(cache="f32", n=23, group=4), WINDOW, forced, "normed")
    cases["normed-gated-f32-t5-g4-w0-onesplit-float32"] = (dict(cache="f32", n=5, group=4), 0, {"split": 1}, "normed")
    cases["normed-gated-bf16-t5-g4-w0-onesplit-bfloat16"] = (dict(cache="bf16", n=5, group=4, q_dtype=torch.bfloat16),
                                                             0, {"split": 1}, "normed")
    # a float32 query normed apart (`qk_norm_rope` into the bf16 operands, attention.py's verify) against the same
    # query normed at the kernel's load, a float32 output each: the interpreter multiplies the fused query in float32
    # (bf16 operands are the GPU's), so here they differ by the query's bf16 rounding (on the GPU:
    # test_a_query_normed_apart_gives_the_fused_output_on_gpu)
    cases["apart-gated-bf16-t23-g4-w9-bfloat16"] = (dict(cache="bf16", n=23, group=4), WINDOW, forced, "apart")
    cases["apart-gated-bf16-t5-g4-w0-onesplit-bfloat16"] = (dict(cache="bf16", n=5, group=4), 0, {"split": 1}, "apart")
    # TQ3_0 rows decoded as float16 pairs (the GPU's default; here with the byte permutes emulated), against the
    # reference over the values the pair decode gives (`tq3_pair_values`)
    pairs = dict(forced, tq3_pairs=True)
    for n in T_VALUES:
        for window in (0, WINDOW):
            cases[f"pairs-tq3_0-t{n}-g4-w{window}-float32"] = (dict(cache="tq3_0", n=n, group=4), window, pairs, "pairs")
    for cache, cache_v in TQ3_MIXED + (("tq3_0", "q8_0"), ("q4_0", "tq3_0")):
        cases[f"pairs-k_{cache}-v_{cache_v}-t23-g4-w{WINDOW}-float32"] = (
            dict(cache=cache, cache_v=cache_v, n=23, group=4), WINDOW, pairs, "pairs")
    cases["pairs-tq3_0-d256-t5-g4-w0-float32"] = (dict(cache="tq3_0", n=5, group=4, head_dim=256), 0,
                                                  dict(split=2, block_rows=32, tq3_pairs=True), "pairs")
    cases["pairs-tq3_0-t1-g4-w0-defaults-float32"] = (dict(cache="tq3_0", n=1, group=4), 0, {"tq3_pairs": True},
                                                      "pairs")
    cases["pairs-tq3_0-t5-g4-w9-fieldsatuse-float32"] = (dict(cache="tq3_0", n=5, group=4), WINDOW,
                                                         dict(pairs, fields_ahead=False), "pairs")
    cases["tq3_0-t5-g4-w9-fieldsatuse-float32"] = (dict(cache="tq3_0", n=5, group=4), WINDOW,
                                                   dict(forced, fields_ahead=False), "reference")
    cases["pairs-tq3_0-prefill-t40-g4-w0-float32"] = (dict(cache="tq3_0", n=40, group=4, start=40, causal=True), 0,
                                                      pairs, "pairs")
    # a decode with the MMAs' sides swapped (`swap`: K rows the M side, the query rows the 8-wide N side): every
    # quantized kind, the pair decode, a window, and a short tree of one head (its 5 rows fit the 8-row tile)
    swapped = dict(forced, swap=True, block_m=8)
    for cache in ("q8_0", "q4_0", "tq3_0"):
        cases[f"swap-{cache}-t1-g4-w{WINDOW}-float32"] = (dict(cache=cache, n=1, group=4), WINDOW, swapped,
                                                          "reference")
    cases["swap-pairs-tq3_0-t1-g4-w0-float32"] = (dict(cache="tq3_0", n=1, group=4), 0,
                                                  dict(swapped, tq3_pairs=True, fields_ahead=False), "pairs")
    cases["swap-f32-t5-g1-w9-float32"] = (dict(cache="f32", n=5, group=1), WINDOW, swapped, "reference")
    # two tokens' 12 rows on the swapped 16-row tile (a 2-token decode's TQ3_0 default, and a verify's tail)
    swapped16 = dict(forced, swap=True, block_m=16, num_warps=4, max_registers=128)
    cases["swap16-pairs-tq3_0-t3-g4-w0-float32"] = (dict(cache="tq3_0", n=3, group=4, start=60), 0,
                                                    dict(swapped16, tq3_pairs=True, fields_ahead=False), "pairs")
    cases["swap16-q8_0-t3-g4-w0-float32"] = (dict(cache="q8_0", n=3, group=4, start=60), 0, swapped16, "reference")
    # the rows past the last whole query tile in a launch of their own (`tail`): 92 rows in 16-row tiles, the last
    # 12 apart; their splits and the main launch's forced alike, or each its own (one of them a single split: the
    # TQ3_0 values then rotated back in torch, the gate after); a window; the gate through both combines
    tail = dict(tail=True, block_m=16, block_rows=BLOCK_ROWS)
    for cache, window in (("q8_0", WINDOW), ("tq3_0", 0), ("f16", WINDOW)):
        cases[f"tail-{cache}-t23-g4-w{window}-float32"] = (dict(cache=cache, n=23, group=4), window,
                                                           dict(tail, split=SPLIT), "reference")
    cases["tail-gated-q4_0-t23-g4-w9-float32"] = (dict(cache="q4_0", n=23, group=4), WINDOW, dict(tail, split=SPLIT),
                                                  "gated")
    cases["tail-unrotated-k_tq3_0-v_tq3_0-t23-g4-w9-split2"] = (
        dict(cache="tq3_0", n=23, group=4, garbage="finite"), WINDOW, dict(tail, split=2), "unrotated")
    cases["tail-unrotated-k_tq3_0-v_tq3_0-t23-g4-w0-ownsplits"] = (
        dict(cache="tq3_0", n=23, group=4, garbage="finite"), 0, dict(tail, block_rows=32), "unrotated")
    return cases


def pair_decoded(args: dict) -> dict:
    """`args` with each TQ3_0 cache replaced by the float32 values the kernel's pair decode gives."""
    out = dict(args)
    for side in ("k", "v"):
        if kv_type(args[f"kv_type_{side}"]).name == "tq3_0":
            out[f"{side}_cache"], out[f"kv_type_{side}"] = tq3_pair_values(args[f"{side}_cache"]), "f32"
    return out


@triton.jit
def _byte_perm_kernel(a_ptr, b_ptr, s_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _byte_perm(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(s_ptr + i)))


def byte_perm_mismatches(count: int = 4096) -> int:
    """Random (a, b, selector) through the kernels' `_byte_perm` (emulated under the interpreter) against PTX's
    documented prmt.b32: byte k of the result is byte (selector >> 4k) & 7 of the 64-bit b:a (upper selector
    bits ignored; the sign-replicating selector bit 8 is never set by the kernel, so it is kept clear here)."""
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randint(-2**31, 2**31, (count,), generator=g, dtype=torch.int64).int() for _ in range(2))
    selector = torch.randint(0, 2**31, (count,), generator=g, dtype=torch.int64).int() & 0x77777777
    out = torch.empty(count, dtype=torch.int32)
    _byte_perm_kernel[(1,)](a, b, selector, out, N=count)
    source = (b.long() & 0xFFFFFFFF) << 32 | (a.long() & 0xFFFFFFFF)
    want = sum((((source >> (8 * ((selector.long() >> (4 * k)) & 7))) & 0xFF) << (8 * k)) for k in range(4))
    return int(((out.long() & 0xFFFFFFFF) != want).sum())


def case_ids() -> list[str]:
    return list(_cases())


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    errors = {}
    for case, (spec, window, launch, expected) in _cases().items():
        args = inputs(**spec)
        if expected == "rotated":  # attention.py's convention around the kernel, vs the un-rotated rows
            rot_k, rot_v = kv_type(args["kv_type_k"]).rotated, kv_type(args["kv_type_v"]).rotated
            out = tree_attention(**{**args, "q": rotate(args["q"]) if rot_k else args["q"]}, window=window, **launch)
            out = unrotate(out) if rot_v else out
            want = model_path(args, window, unrotated=True)
        elif expected == "unrotated":  # the rotation back and the gate in the call, as attention.py asks
            heads, n, d = args["q"].shape
            gate = (torch.randn(n, heads, 2, d, generator=torch.Generator().manual_seed(n)) * 3)[:, :, 1]
            rot_k = kv_type(args["kv_type_k"]).rotated
            out = tree_attention(**{**args, "q": rotate(args["q"]) if rot_k else args["q"]}, window=window, gate=gate,
                                 unrotate_values=True, **launch)
            want = gated_heads_reference(model_path(args, window, unrotated=True), gate)
            errors[case] = relative_error(out, want)
            assert out.shape == (n, heads * d) and out.dtype == args["q"].dtype, case
            continue
        elif expected == "normed":  # raw q and the gate as attention.py passes them: [query ; gate] projection rows
            heads, n, d = args["q"].shape
            rows = (torch.randn(n, heads, 2, d, generator=torch.Generator().manual_seed(n)) * 3).to(args["q"].dtype)
            weight = 1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(d))
            cos, sin = rope_tables_reference(args["positions"], d // 2, 1e7)
            out = tree_attention(**{**args, "q": rows[:, :, 0].transpose(0, 1)}, window=window, gate=rows[:, :, 1],
                                 q_norm=(weight, 1e-6, cos, sin), **launch)
            normed = qk_norm_rope_reference(rows[:, :, 0], weight, 1e-6, cos, sin).transpose(0, 1)
            want = gated_heads_reference(tree_attention_reference(**{**args, "q": normed}, window=window), rows[:, :, 1])
            errors[case] = relative_error(out, want)
            assert out.shape == (n, heads * d) and out.dtype == args["q"].dtype, case
            continue
        elif expected == "apart":  # attention.py's float32 verify query: normed in the kernel, or apart into bf16
            heads, n, d = args["q"].shape
            rows = torch.randn(n, heads, 2, d, generator=torch.Generator().manual_seed(n)) * 3
            weight = 1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(d))
            cos, sin = rope_tables_reference(args["positions"], d // 2, 1e7)
            common = dict(args, window=window, gate=rows[:, :, 1], operands=torch.bfloat16, **launch)
            fused = tree_attention(**{**common, "q": rows[:, :, 0].transpose(0, 1)}, q_norm=(weight, 1e-6, cos, sin))
            q = qk_norm_rope(rows[:, :, 0], weight, 1e-6, cos, sin, out_dtype=torch.bfloat16).transpose(0, 1)
            out = tree_attention(**{**common, "q": q}, out_dtype=torch.float32)
            errors[case] = relative_error(out, fused)
            assert out.shape == fused.shape == (n, heads * d) and out.dtype == fused.dtype == torch.float32, case
            continue
        elif expected == "gated":  # the gate as attention.py passes it: strided rows of the [query ; gate] projection
            heads, n, d = args["q"].shape
            gate = (torch.randn(n, heads, 2, d, generator=torch.Generator().manual_seed(n)) * 3).to(args["q"].dtype)
            out = tree_attention(**args, window=window, gate=gate[:, :, 1], **launch)
            want = gated_heads_reference(tree_attention_reference(**args, window=window), gate[:, :, 1])
            errors[case] = relative_error(out, want)
            assert out.shape == (n, heads * d) and out.dtype == args["q"].dtype, case
            continue
        elif expected == "pairs":
            out = tree_attention(**args, window=window, **launch)
            want = tree_attention_reference(**pair_decoded(args), window=window)
        else:
            out = tree_attention(**args, window=window, **launch)
            want = model_path(args, window) if expected == "model" else tree_attention_reference(**args, window=window)
        assert out.shape == args["q"].shape and out.dtype == args["q"].dtype, case
        errors[case] = relative_error(out, want)
    errors["byte-perm-mismatches"] = byte_perm_mismatches()
    json.dump(errors, sys.stdout)


if __name__ == "__main__":
    main()
