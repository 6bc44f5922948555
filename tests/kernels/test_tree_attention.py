"""Tree attention from the KV cache: the Triton kernel through the interpreter in a subprocess
(TRITON_INTERPRET must be set before triton is imported), the torch reference against the model's current
path in-process, argument errors, and real sizes plus CUDA-graph replay on GPU."""


import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels.activations import gated_heads
from flashtree.kernels.kv_quant import kv_type, rotate, unrotate
from flashtree.kernels.qk_norm_rope import qk_norm_rope, rope_tables
from flashtree.kernels.kv_quant import TQ3_LEVELS
from flashtree.kernels.tree_attention import (KV_KINDS, TQ3_PAIRS, _launch_defaults, _plan, _query_in_operands,
                                              _tq3_f16_byte_tables, _tq3_pairs_by_default, _triton_supports,
                                              choose_splits, graphed_mask, programs_per_sm, tq3_pair_values,
                                              tree_attention, tree_attention_reference)
from flashtree.models.step import Step

from tests.kernels import tree_attention_cases as cases
from tests.kernels.interpreter import run_cases

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}  # of max |expected|; bf16: one output rounding


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_cases("tests.kernels.tree_attention_cases")


@pytest.mark.slow  # the Triton interpreter: seconds per case
@pytest.mark.parametrize("case", cases.case_ids())
def test_triton_kernel_matches_reference_and_model_path(interpreter_errors, case):
    dtype = "bfloat16" if case.endswith("bfloat16") else "float32"
    # a query normed and rotated in the kernel rounds to bf16 twice more before the scores (as the model does)
    # normed bf16: the normed q (rounded at the kernel's load, in the reference's own op), the output and
    # its gate each round once (an unseeded norm weight drew up to 2.2e-2: three roundings, not two)
    roundings = 3 if case.startswith("normed") and dtype == "bfloat16" else 1
    assert interpreter_errors[case] <= roundings * TOLERANCE[dtype]  # NaN (garbage rows leaking) fails too


@pytest.mark.slow
def test_byte_perm_in_the_interpreter_follows_ptx_prmt(interpreter_errors):
    """The pair decode's byte permutes run as PTX prmt on the GPU and emulated in the interpreter, where every
    pair case above checks the decode: the emulation is PTX's documented semantics on random operands."""
    assert interpreter_errors["byte-perm-mismatches"] == 0


def test_tq3_pair_values_are_the_dequantized_values_in_float16():
    rows = kv_type("tq3_0").quantize(torch.randn(3, 40, 256) * 7)
    pairs, exact = tq3_pair_values(rows), kv_type("tq3_0").dequantize(rows)
    assert torch.equal(pairs, pairs.half().float())  # float16 values
    # two float16 roundings (the level, the product), each within 2^-11 of its value
    assert ((pairs - exact).abs() <= exact.abs() * 2.0 ** -10 * 1.01).all()
    assert ((pairs - exact).abs() > 0).any()  # not the float32 products themselves


def test_tq3_f16_byte_tables_hold_each_levels_float16_bytes():
    low, high = (t & 0xFFFFFFFF for t in _tq3_f16_byte_tables())
    for i, level in enumerate(TQ3_LEVELS):
        bits = (low >> (8 * i) & 0xFF) | (high >> (8 * i) & 0xFF) << 8
        assert torch.tensor([bits], dtype=torch.int32).short().view(torch.float16).item() == \
            torch.tensor(level).half().item()


@pytest.mark.parametrize("k, v, operands, interpreter, pairs", [
    ("tq3_0", "tq3_0", torch.bfloat16, False, True), ("tq3_0", "q8_0", torch.float16, False, True),
    ("f16", "tq3_0", torch.bfloat16, False, True),
    ("tq3_0", "bf16", torch.bfloat16, False, False),  # bf16 values may lie beyond f16's range
    ("tq3_0", "tq3_0", torch.float32, False, False),  # a float32 model keeps exact float32 dots
    ("tq3_0", "tq3_0", torch.bfloat16, True, False)])  # the interpreter decodes in float32 unless asked
def test_tq3_0_decodes_as_float16_pairs_on_the_gpu_by_default(k, v, operands, interpreter, pairs):
    assert _tq3_pairs_by_default(kv_type(k), kv_type(v), operands, interpreter) is pairs


@pytest.mark.parametrize("window", [0, cases.WINDOW])
@pytest.mark.parametrize("n", cases.T_VALUES)
def test_graphed_mask_is_the_eager_mask_plus_hidden_garbage_rows(n, window):
    args = cases.inputs("f32", n, 1)
    start = int(args["start_t"][0])
    eager = Step(args["positions"], start, args["visible"], None, torch.arange(start, start + n), start + n)
    mask = graphed_mask(args["start_t"], args["visible"], args["positions"], cases.KV_END, window)
    assert torch.equal(mask[:, : start + n], eager.attention_mask(0, window))
    assert not mask[:, start + n :].any()


@pytest.mark.parametrize("cache", cases.CACHES)
@pytest.mark.parametrize("window", [0, cases.WINDOW])
@pytest.mark.parametrize("group", cases.GROUPS)
@pytest.mark.parametrize("n", cases.T_VALUES)
def test_reference_matches_model_path(n, group, window, cache):
    args = cases.inputs(cache, n, group, garbage="finite")
    ref = tree_attention_reference(**args, window=window)
    assert cases.relative_error(ref, cases.model_path(args, window)) <= 1e-5


def test_reference_ignores_nan_garbage_rows():
    args = cases.inputs("q8_0", 5, 4, garbage="nan")
    assert torch.isfinite(tree_attention_reference(**args)).all()


def test_without_triton_runtime_falls_back_to_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = cases.inputs("q4_0", 5, 4)
    assert torch.equal(tree_attention(**args, window=cases.WINDOW),
                       tree_attention_reference(**args, window=cases.WINDOW))


@pytest.mark.parametrize("d, kernel", [(128, True), (256, True), (512, True), (384, False)])
def test_tq3_0_runs_in_the_kernel_for_power_of_two_head_dims(monkeypatch, d, kernel):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only read by _triton_supports here; nothing is launched
    pytest.importorskip("triton")
    q = torch.zeros(4, 5, d)
    for k, v in (("tq3_0", "tq3_0"), ("tq3_0", "q8_0"), ("bf16", "tq3_0")):
        assert _triton_supports(q, kv_type(k), kv_type(v)) is kernel, (k, v)


def test_tq3_0_without_triton_runtime_falls_back_to_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = cases.inputs("tq3_0", 5, 4, cache_v="q4_0")
    assert torch.equal(tree_attention(**args, window=cases.WINDOW),
                       tree_attention_reference(**args, window=cases.WINDOW))


@pytest.mark.parametrize("tq3", [False, True])
@pytest.mark.parametrize("d", [32, 64, 128, 256, 512, 1024])
@pytest.mark.parametrize("query_rows", [6, 12, 18, 60, 138])
def test_quantized_rows_launch_a_chunk_tl_dot_takes(d, query_rows, tq3):
    pytest.importorskip("triton")
    launch = _launch_defaults(query_rows, d, quantized=True, tq3=tq3)
    assert launch.block_n >= 16 and launch.block_n & (launch.block_n - 1) == 0
    assert launch.block_n == max(16, launch.warps * 1024 // d)  # one 32-value block a thread: the CTA covers the chunk
    decode = query_rows <= 8
    if decode and tq3:  # one token's 6-row head group over TQ3_0 rows: the MMAs' sides swapped, 8 rows on 2 warps
        assert (launch.block_m, launch.warps, launch.swap, launch.max_registers) == (8, 2, True, 128)
    elif query_rows <= 16 and tq3:  # two tokens (or a verify's tail): swapped too, 16 rows on 4 warps, capped
        assert (launch.block_m, launch.warps, launch.swap, launch.max_registers) == (16, 4, True, 128)
    else:  # a 16-row decode tile on 4 warps capped at 128 registers; wider tiles uncapped
        assert not launch.swap and launch.block_m >= 16 and launch.warps >= 4
        assert launch.max_registers == (128 if query_rows <= 16 else None)
    assert programs_per_sm(True, 1, launch.warps) == (8 if launch.warps <= 2 else 4)
    if launch.max_registers is not None:  # the programs the splits aim for fit the register file together
        assert launch.max_registers * 32 * launch.warps * programs_per_sm(True, 1, launch.warps) <= 65536
    windowed = _launch_defaults(query_rows, d, quantized=True, windowed=True, tq3=tq3)
    assert not windowed.swap and windowed.max_registers is None and windowed.warps >= 4  # a window's keeps 4 warps


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("query_rows", [6, 138])
def test_float32_operands_take_small_tiles(query_rows, quantized):
    """A float32 model's dots are FMA loops: a 16-row query tile of 4 warps over short chunks (the 128-row
    tile of quantized rows compiled to 57K instructions and 10 KB of stack a thread, in 26 s)."""
    pytest.importorskip("triton")
    assert _launch_defaults(query_rows, 256, quantized, exact=True) == (16, 16, 4, None, None, False)


def test_a_float32_query_rounds_to_the_operands_as_the_kernel_would():
    """A wide tile's float32 query is rounded before the launch as `_query_operand` rounds it in the kernel: to
    nearest, and within f16's range (+-65280, the largest bf16 value f16 holds) for f16 operands."""
    q = torch.tensor([1e6, -1e6, 1.0 + 2**-10, 3.14159])
    clamped = torch.tensor([65280.0, -65280.0, 1.0 + 2**-10, 3.14159]).half()
    assert torch.equal(_query_in_operands(q, torch.float16), clamped)
    assert torch.equal(_query_in_operands(q, torch.bfloat16), q.bfloat16())


def _verify_plan(kv_end: int, cache: str = "tq3_0", tail=None, rows: int = 138, operands=torch.bfloat16):
    quantized, t = cache != "f16", kv_type(cache)
    main = _launch_defaults(rows, 256, quantized, exact=operands == torch.float32, tq3=cache == "tq3_0")
    return main, _plan(rows, 256, main, tail, False, quantized, t, t, operands, False, None, None, None, kv_end, 4, 132)


@pytest.mark.parametrize("cache", ["tq3_0", "q8_0"])
def test_a_verify_over_long_quantized_rows_gives_its_last_rows_a_tile_of_their_own(cache):
    """23 tokens x 6 heads = 138 query rows a KV head: one 128-row tile, and the last 10 rows in a 16-row tile of
    their own (`_launch_defaults` of 10 rows) rather than a second 128-row tile that decodes every K/V row again.
    The main launch keeps the splits of the two-tile launch; the tail takes a decode's."""
    pytest.importorskip("triton")
    main, tiles = _verify_plan(262144, cache)
    assert main.block_m == 128 and [(t.m_base, t.rows) for t in tiles] == [(0, 128), (128, 10)]
    assert tiles[0].launch == main and tiles[0].splits == choose_splits(262144, 4, 2, block_rows=main.block_n)
    tail = _launch_defaults(10, 256, True, tq3=cache == "tq3_0")
    assert tiles[1].launch == tail and tail.block_m == 16
    assert tiles[1].splits == choose_splits(262144, 4, 1, block_rows=tail.block_n,
                                            programs_per_sm=programs_per_sm(True, 1, tail.warps))
    assert tiles[0].fields_ahead  # the wide tile loads a chunk's fields ahead
    if cache == "tq3_0":  # the tail swapped (its 10 rows the MMAs' N side), TQ3_0 as float16 pairs loaded at use
        assert tail.swap and tiles[1].kinds == (TQ3_PAIRS,) * 2 and not tiles[1].fields_ahead
        assert tiles[1].operands == torch.float16
        assert tiles[0].kinds == (TQ3_PAIRS,) * 2 and tiles[0].operands == torch.float16  # long rows: pairs too
    else:
        assert not tail.swap and tiles[1].kinds == (KV_KINDS[cache],) * 2 and tiles[1].fields_ahead


@pytest.mark.parametrize("kv_end, pairs", [(1024, False), (16383, False), (16384, True), (262144, True)])
def test_a_wide_tile_decodes_tq3_0_as_pairs_over_long_rows_only(kv_end, pairs):
    """The verify's 128-row tile takes TQ3_0 rows as float16 pairs from 16K rows (5 % faster there, 4 % slower at
    1K); not in the interpreter, not with float32 operands (a float32 model's exact dots)."""
    pytest.importorskip("triton")
    tiles = _verify_plan(kv_end)[1]
    assert (tiles[0].kinds == (TQ3_PAIRS,) * 2) == pairs and (tiles[0].operands == torch.float16) == pairs
    assert _verify_plan(kv_end, operands=torch.float32)[1][0].kinds == (KV_KINDS["tq3_0"],) * 2
    q8 = _verify_plan(kv_end, "q8_0")[1][0]
    assert q8.kinds == (KV_KINDS["q8_0"],) * 2 and q8.operands == torch.bfloat16


def test_the_tail_tile_only_where_it_pays():
    """Short K/V ranges (an extra launch and combine against a cheap second tile), float caches (no decode to
    repeat), whole tiles and wide remainders keep one launch; `tail` forces either way."""
    pytest.importorskip("triton")
    assert len(_verify_plan(1024)[1]) == 1
    assert len(_verify_plan(262144, "f16")[1]) == 1
    assert len(_verify_plan(262144, rows=128)[1]) == 1  # whole tiles
    assert len(_verify_plan(262144, rows=128 + 40)[1]) == 1  # 40 rows: more than a decode's tile
    assert len(_verify_plan(262144, tail=False)[1]) == 1
    assert len(_verify_plan(262144, operands=torch.float32)[1]) == 1  # a float32 model's 16-row tiles
    forced = _verify_plan(1024, tail=True)[1]
    assert [(t.m_base, t.rows) for t in forced] == [(0, 128), (128, 10)]
    assert len(_verify_plan(1024, tail=True, rows=100)[1]) == 1  # one tile: nothing past it


def test_split_choice():
    assert choose_splits(96, 2, 1) == 1
    assert choose_splits(65536, 4, 1) * 4 >= 2 * 132  # a long decode fills the H200
    assert choose_splits(1047, 4, 3, block_rows=16) * 4 * 3 >= 132  # 23 tokens over 1K rows: latency-bound
    assert 1047 // choose_splits(1047, 4, 3, block_rows=16) > 3 * 16  # but each split walks ~4 chunks
    assert choose_splits(1025, 4, 1, block_rows=32) == 9  # AR decode at 1K rows as before
    assert choose_splits(1 << 22, 1, 1) == 256  # the cap
    assert choose_splits(262144, 4, 1, block_rows=16, programs_per_sm=4) == 132  # 4 programs an SM
    assert choose_splits(262144, 4, 1, block_rows=16, programs_per_sm=8) == 256  # a 2-warp decode: 8, capped
    assert choose_splits(1025, 4, 1, block_rows=16, programs_per_sm=8) == 17  # 4 chunks a split
    assert choose_splits(1025, 4, 1, block_rows=16, programs_per_sm=8, min_chunks=2) == 33  # a swapped decode's 2


def test_errors_name_the_problem():
    args = cases.inputs("q8_0", 5, 4)
    with pytest.raises(FlashtreeError, match="q8_0 rows of head_dim 64"):
        tree_attention(**{**args, "k_cache": args["k_cache"][..., :-2]})
    with pytest.raises(FlashtreeError, match="past the k cache capacity"):
        tree_attention(**{**args, "kv_end": cases.CAPACITY + 1})
    with pytest.raises(FlashtreeError, match="not a multiple of 2 kv heads"):
        tree_attention(**{**args, "q": args["q"][:7]})
    with pytest.raises(FlashtreeError, match="T <= 128"):
        tree_attention(**{**args, "q": torch.zeros(8, 129, 64)})
    with pytest.raises(FlashtreeError, match="visible must be"):
        tree_attention(**{**args, "visible": args["visible"][:4]})


# ---------------------------------------------------------------------------------------------
# GPU

def _real_inputs(cache, n, kv_end, dtype=torch.bfloat16, heads=24, kv_heads=4, d=256, seed=0, cache_v=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache_v = cache_v or cache
    start = kv_end - n - 3  # three garbage rows at the end
    k = kv_type(cache).quantize(torch.randn(kv_heads, kv_end, d, generator=g, device="cuda"))
    v = kv_type(cache_v).quantize(torch.randn(kv_heads, kv_end, d, generator=g, device="cuda"))
    k[:, start + n:] = 255 if k.dtype == torch.uint8 else float("nan")
    v[:, start + n:] = 255 if v.dtype == torch.uint8 else float("nan")
    _, depths, visible = cases.tree(n)
    return dict(q=torch.randn(heads, n, d, generator=g, device="cuda").to(dtype), k_cache=k, v_cache=v,
                kv_type_k=cache, kv_type_v=cache_v, start_t=torch.tensor([start], device="cuda"),
                visible=visible.cuda(), positions=(start + depths).cuda(), kv_end=kv_end, scale=d ** -0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# the fast GPU subset keeps one window and the short cache; the full GPU suite (slow) runs all
@pytest.mark.parametrize("window", [0, pytest.param(1024, marks=pytest.mark.slow)])
@pytest.mark.parametrize("n", [1, 23])
@pytest.mark.parametrize("kv_end", [4096, pytest.param(65536, marks=pytest.mark.slow)])
@pytest.mark.parametrize("cache", ["f16", "bf16", "q8_0", "q4_0", "tq3_0"])
def test_real_sizes_on_gpu(cache, kv_end, n, window):
    for dtype, bound in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        args = _real_inputs(cache, n, kv_end, dtype)
        out = tree_attention(**args, window=window)
        ref = tree_attention_reference(**args, window=window)
        assert cases.relative_error(out, ref) <= bound, (dtype, cases.relative_error(out, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_end", [4096, pytest.param(262144, marks=pytest.mark.slow)])
@pytest.mark.parametrize("n", [1, 23])
@pytest.mark.parametrize("cache, cache_v", [("tq3_0", "tq3_0"), ("q8_0", "tq3_0"), ("tq3_0", "q4_0")])
def test_tq3_0_float16_pairs_on_gpu(cache, cache_v, n, kv_end):
    """The GPU's default TQ3_0 decode (float16 pairs through PTX byte permutes) against the reference over the
    values the pair decode is to give (`tq3_pair_values`): a wrong byte, sign or half is an error of the order
    of the values; f16 operands round q and P at 2^-11, the output bf16 at 2^-8 (H200, 2026-12-05: 0.0041 of the
    largest value with Q8_0 keys). The float32 decode (tq3_pairs=False) still serves."""
    args = _real_inputs(cache, n, kv_end, cache_v=cache_v)
    decoded = {**args}
    for side, name in (("k", cache), ("v", cache_v)):
        if name == "tq3_0":
            decoded[f"{side}_cache"], decoded[f"kv_type_{side}"] = tq3_pair_values(args[f"{side}_cache"]), "f32"
    want = tree_attention_reference(**decoded)
    # both outputs round to bf16 (a 2^-8 ulp of the largest value: 0.0039), and Q8_0 keys to f16 operands
    assert cases.relative_error(tree_attention(**args), want) <= 1e-2
    assert cases.relative_error(tree_attention(**args, tq3_pairs=True), want) <= 1e-2  # forced (a verify's tile too)
    assert cases.relative_error(tree_attention(**args, tq3_pairs=False), tree_attention_reference(**args)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [2, 8, 16])  # a 16-row query tile (capped registers), one 64-row tile, 128-row tiles
@pytest.mark.parametrize("cache", ["q8_0", "tq3_0"])
def test_quantized_rows_at_each_query_tile_on_gpu(cache, n):
    """Each launch default over quantized rows compiles and matches the reference (a register cap on a 64-row
    tile once stopped ptxas at 8 tokens, a shape the kernel sizes above did not reach)."""
    args = _real_inputs(cache, n, 2048)
    assert cases.relative_error(tree_attention(**args), tree_attention_reference(**args)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("launch", [{"num_warps": 1}, {"num_warps": 2, "tq3_pairs": True, "fields_ahead": False},
                                    {"num_warps": 4, "tq3_pairs": True}, {"num_warps": 4}])
@pytest.mark.parametrize("cache", ["q8_0", "tq3_0"])
def test_swapped_decode_on_gpu(cache, launch):
    """A decode with the MMAs' sides swapped (K rows the M side, the head group the 8-wide N side), at the sweep's
    launches: across several splits, the committed chunks and the one holding the new row."""
    args = _real_inputs(cache, 1, 4100)
    out = tree_attention(**args, swap=True, block_m=8, **launch)
    assert cases.relative_error(out, tree_attention_reference(**args)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [10, 23])  # one 64-row query tile; two 128-row tiles
def test_float32_query_over_tq3_0_rows_on_gpu(n):
    """A bf16 model's float32 query over TQ3_0 keys (rotated in its own launch, so not normed in the kernel): a wide
    tile takes it rounded to the operands before the launch (`_query_in_operands`); the output stays float32."""
    args = _real_inputs("tq3_0", n, 4100)
    args["q"] = args["q"].float()
    out = tree_attention(**args, operands=torch.bfloat16)
    assert out.dtype == torch.float32
    assert cases.relative_error(out, tree_attention_reference(**args)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", ["q8_0", "tq3_0"])
def test_tail_tile_on_gpu(cache):
    """A verify's 138 query rows a KV head as one 128-row tile and a 10-row tail tile (`tail`, each launch with
    its own splits and combine; the TQ3_0 values rotated back and gated in both combines, as the model asks), against
    the reference and against the two-tile launch."""
    args = _real_inputs(cache, 23, 20000)
    heads, n, d = args["q"].shape
    gate = torch.randn(n, heads, d, device="cuda").to(args["q"].dtype)
    want = tree_attention_reference(**args)
    for tail in (True, False):
        assert cases.relative_error(tree_attention(**args, tail=tail), want) <= 2e-2, tail
    gated = {tail: tree_attention(**args, tail=tail, gate=gate, unrotate_values=True) for tail in (True, False)}
    assert gated[True].shape == (n, heads * d) and cases.relative_error(gated[True], gated[False]) <= 2e-2


# the sweep's candidates compile a kernel each: in the slow GPU suite, the default in the fast one
CANDIDATES = [{"operands": torch.float16}, {"block_rows": 32}, {"block_rows": 64, "num_stages": 2},
              {"block_m": 128, "num_warps": 8}]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("launch", [{}] + [pytest.param(c, marks=pytest.mark.slow) for c in CANDIDATES])
@pytest.mark.parametrize("n, kv_end", [(23, 1050), (65, 8260), (1, 1030)])
def test_short_context_launches_on_gpu(n, kv_end, launch):
    """The default launch (many splits of whole committed chunks) and the compare sweep's
    candidates at the 27B shape over an f16 cache (benchmarks/sweep_tree_attention.py --compare)."""
    if "block_m" in launch and n == 1:
        pytest.skip("one token's 6-row head group has a 16-row tile")
    args = _real_inputs("f16", n, kv_end)
    assert cases.relative_error(tree_attention(**args, **launch), tree_attention_reference(**args)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_f16_operands_keep_a_huge_bf16_query_finite_on_gpu():
    args = _real_inputs("f16", 23, 1050)
    args["q"][0] *= 1e6  # past f16's range: clamped, not inf (NaN scores)
    assert torch.isfinite(tree_attention(**args, operands=torch.float16)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [1, None])  # the gate at the row loop's store, and at the combine's
@pytest.mark.parametrize("n", [1, 23])
def test_output_gate_at_the_store_on_gpu(n, split):
    """`gate=` gives what `gated_heads` gives on the ungated output, and `q_norm=` what `qk_norm_rope` gives
    before the call, at the 27B attention shape (the raw query and the gate as strided projection rows)."""
    args = _real_inputs("bf16", n, 4096)
    rows = torch.randn(n, 24, 2, 256, device="cuda").to(torch.bfloat16)
    gate = rows[:, :, 1]
    gated = tree_attention(**args, split=split, gate=gate)
    want = gated_heads(tree_attention(**args, split=split), gate)
    assert gated.shape == want.shape == (n, 24 * 256)
    assert cases.relative_error(gated, want) <= 1e-2
    weight, (cos, sin) = 1 + 0.1 * torch.randn(256, device="cuda"), rope_tables(args["positions"], 64, 1e7)
    normed = tree_attention(**{**args, "q": rows[:, :, 0].transpose(0, 1)}, split=split, gate=gate,
                            q_norm=(weight, 1e-6, cos, sin))
    q = qk_norm_rope(rows[:, :, 0], weight, 1e-6, cos, sin).transpose(0, 1)
    want = gated_heads(tree_attention(**{**args, "q": q}, split=split), gate)
    assert cases.relative_error(normed, want) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [1, None])
@pytest.mark.parametrize("n", [5, 23])
def test_a_query_normed_apart_gives_the_fused_output_on_gpu(n, split):
    """attention.py's verify with float32 activations (by default; FLASHTREE_QUERY_NORM_APART=0 keeps the norm fused):
    the raw query normed and roped by `qk_norm_rope` into the bf16 operands, then attended with a float32 output,
    against the same query normed at the kernel's load. Both feed the MMAs the same bf16 query but for the norm's sums
    (an RMS a few ulps apart can move a bf16 rounding of a few query values), so the outputs agree within half a bf16
    rounding."""
    args = _real_inputs("bf16", n, 4096)
    rows = torch.randn(n, 24, 2, 256, device="cuda")
    weight, (cos, sin) = 1 + 0.1 * torch.randn(256, device="cuda"), rope_tables(args["positions"], 64, 1e7)
    common = dict(args, split=split, gate=rows[:, :, 1], operands=torch.bfloat16)
    fused = tree_attention(**{**common, "q": rows[:, :, 0].transpose(0, 1)}, q_norm=(weight, 1e-6, cos, sin))
    q = qk_norm_rope(rows[:, :, 0], weight, 1e-6, cos, sin, out_dtype=torch.bfloat16).transpose(0, 1)
    apart = tree_attention(**{**common, "q": q}, out_dtype=torch.float32)
    assert apart.dtype == fused.dtype == torch.float32 and apart.shape == fused.shape == (n, 24 * 256)
    assert cases.relative_error(apart, fused) <= 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [1, None])  # rotated back in torch, and in the combine launch
@pytest.mark.parametrize("n", [1, 23])
def test_tq3_0_values_rotated_back_in_the_call_on_gpu(n, split):
    """`unrotate_values=True` with the gate gives `gated_heads(unrotate(.))` of the rotated output, at the 27B
    attention shape over TQ3_0 keys and values."""
    args = _real_inputs("tq3_0", n, 4096)
    gate = torch.randn(n, 24, 2, 256, device="cuda").to(torch.bfloat16)[:, :, 1]
    got = tree_attention(**args, split=split, gate=gate, unrotate_values=True)
    want = gated_heads(unrotate(tree_attention(**args, split=split)), gate)
    assert got.shape == want.shape == (n, 24 * 256)
    assert cases.relative_error(got, want) <= 1e-2


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 1024])
@pytest.mark.parametrize("n", [1, 23])
@pytest.mark.parametrize("cache, cache_v", [("tq3_0", "bf16"), ("q8_0", "tq3_0"), ("tq3_0", "tq3_0")])
def test_tq3_0_long_context_on_gpu(cache, cache_v, n, window):
    """D 256, kv_end 65536, TQ3_0 keys and/or values, as attention.py calls it (rotated q, unrotated output),
    against the reference with the same convention, and the kernel's memory next to the cache's."""
    for dtype, bound in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        args = _real_inputs(cache, n, 65536, dtype, cache_v=cache_v)
        rot_k, rot_v = kv_type(cache).rotated, kv_type(cache_v).rotated
        args["q"] = rotate(args["q"]) if rot_k else args["q"]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = tree_attention(**args, window=window)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        ref = tree_attention_reference(**args, window=window)
        out, ref = (unrotate(out), unrotate(ref)) if rot_v else (out, ref)
        assert cases.relative_error(out, ref) <= bound, (dtype, cases.relative_error(out, ref))
        dequantized = 4 * 65536 * 256 * 4  # one float32 copy of one side, as the reference makes
        assert extra < dequantized // 8, extra  # only the output and the split partials


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_follows_start_t():
    args = _real_inputs("q8_0", 23, 4096)
    start_t = args["start_t"]
    tree_attention(**args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(**args)
    for start in (0, 100, 2047, 4096 - 26):  # the last 3 rows hold NaN
        start_t.fill_(start)
        args["positions"].copy_(start + cases.tree(23)[1].cuda())
        graph.replay()
        ref = tree_attention_reference(**args)
        assert cases.relative_error(out, ref) <= 2e-2, start
