"""kernels/kv_write: new rows quantized into the cache by the Triton kernel against the torch form
(`index_copy_` of `KVType.quantize`): CPU interpreter in a subprocess, and the 27B shape on the GPU."""

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels.kv_quant import kv_type
from flashtree.kernels.kv_write import write_kv, write_rows
from flashtree.kernels.qk_norm_rope import qk_norm_rope, rope_tables
from tests.kernels import kv_write_cases as cases
from tests.kernels.interpreter import run_cases


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases("tests.kernels.kv_write_cases")


@pytest.mark.parametrize("case", cases.case_ids())
def test_kernel_writes_what_the_torch_form_writes(interpreter_results, case):
    result = interpreter_results[case]
    if case.startswith("kv-"):  # write_kv: the same program as write_rows after the same norm and RoPE
        assert result["bytes"] == 0, result
    elif case.startswith("tq3_0"):
        # another summation order of the norms and the rotation: a rotated value on a level threshold (or at
        # zero, where the sign is rounding) may take the neighbouring code, a norm move by one fp16 unit
        assert result["far_codes"] == 0 and result["max_error"] < 2e-3, result
        if case.endswith("random"):  # (the edge rows' rotation cancels to about zero: each sign a coin flip)
            assert result["codes"] <= result["values"] // 1000, result
    else:  # the same float32 operations: byte-identical, edge rows included
        assert result["bytes"] == 0, result


@pytest.mark.parametrize("name", ["f16", "bf16", "q8_0"])
def test_torch_form_where_the_kernel_does_not_run(name):
    """Without the interpreter (plain CPU) and for float caches: exactly the index_copy_ of quantize."""
    t = kv_type(name)
    x = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    slots = torch.tensor([4, 1, 6])
    got = t.allocate(2, 8, 64, "cpu")
    want = got.clone()
    write_rows(x, got, slots, t)
    want.index_copy_(1, slots, t.quantize(x.transpose(0, 1)))
    assert torch.equal(got, want)


def test_write_kv_takes_the_torch_forms_where_the_kernel_does_not_run():
    """Plain CPU, and a float V cache beside a quantized K cache: each side as `write_rows` writes it."""
    tk, tv = kv_type("q8_0"), kv_type("bf16")
    k, v = torch.randn(3, 2, 64, dtype=torch.bfloat16), torch.randn(3, 2, 64, dtype=torch.bfloat16)
    weight, (cos, sin) = 1 + 0.1 * torch.randn(64), rope_tables(torch.tensor([5, 6, 7]), 32, 1e7)
    slots = torch.tensor([4, 1, 6])
    got_k, got_v = tk.allocate(2, 8, 64, "cpu"), tv.allocate(2, 8, 64, "cpu")
    want_k, want_v = got_k.clone(), got_v.clone()
    write_kv(k, v, got_k, got_v, slots, tk, tv, k_norm=(weight, 1e-6, cos, sin))
    write_rows(qk_norm_rope(k, weight, 1e-6, cos, sin), want_k, slots, tk)
    write_rows(v, want_v, slots, tv)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_mismatched_shapes_name_the_problem():
    t = kv_type("q8_0")
    with pytest.raises(FlashtreeError, match="write_rows takes"):
        write_rows(torch.zeros(3, 2, 64), t.allocate(2, 8, 64, "cpu"), torch.tensor([0, 1]), t)
    with pytest.raises(FlashtreeError, match="write_kv takes"):
        write_kv(torch.zeros(3, 2, 64), torch.zeros(3, 3, 64), t.allocate(2, 8, 64, "cpu"),
                 t.allocate(2, 8, 64, "cpu"), torch.tensor([0, 1, 2]), t, t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "tq3_0"])
@pytest.mark.parametrize("tokens", [1, 23])
def test_27b_rows_on_gpu(name, tokens):
    """4 KV heads, head_dim 256, a decode row and a verify's 23 rows, in a CUDA graph as the step runs it,
    against the torch form on the CPU: on CUDA, torch divides by a Python scalar as a multiply by its
    reciprocal (Q8_0's amax / 127 can differ by one bit), where the kernel divides as the CPU form does."""
    t = kv_type(name)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (3 * torch.randn(tokens, 4, 256, device="cuda", generator=gen)).to(torch.bfloat16)
    slots = torch.randperm(1000, device="cuda", generator=gen)[:tokens]
    got = t.allocate(4, 1000, 256, "cuda")
    want = got.clone()
    write_rows(x, got, slots, t)  # compile outside the capture
    got.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_rows(x, got, slots, t)
    graph.replay()
    got, want = got.cpu(), want.cpu()
    want.index_copy_(1, slots.cpu(), t.quantize(x.cpu().transpose(0, 1)))
    if name == "tq3_0":  # as the interpreter cases: a rotated value on a level threshold may take the next code
        a, b = t.indices(got), t.indices(want)
        differ = a != b
        neighbour = ((a >> 2) == (b >> 2)) & (((a & 3) - (b & 3)).abs() == 1) | (((a & 3) == 0) & ((b & 3) == 0))
        gaps = (t.dequantize(got) - t.dequantize(want)).abs().reshape(differ.shape)
        error = gaps[~differ].max() / x.float().abs().max().cpu()  # the norms: one fp16 unit at most
        assert differ.sum() <= differ.numel() // 1000 and not (differ & ~neighbour).any() and error < 2e-3, (
            int(differ.sum()), int((differ & ~neighbour).sum()), float(error))
    else:
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name_k, name_v", [("tq3_0", "tq3_0"), ("q8_0", "q8_0"), ("q4_0", "tq3_0")])
@pytest.mark.parametrize("tokens", [1, 23])
def test_write_kv_27b_rows_on_gpu(name_k, name_v, tokens):
    """write_kv of the raw keys (strided projection rows) and values in a CUDA graph, against the two-call
    path on the GPU: the fused norm and RoPE round without FMA contraction (the kernel keeps torch's
    rounding for the quantizer), so a key may move by a bf16 unit and its code by one level."""
    tk, tv = kv_type(name_k), kv_type(name_v)
    projection = (3 * torch.randn(tokens, 4, 2, 256, device="cuda")).to(torch.bfloat16)
    k, v = projection[:, :, 0], projection[:, :, 1]
    weight = 1 + 0.1 * torch.randn(256, device="cuda")
    cos, sin = rope_tables(torch.arange(100, 100 + tokens, device="cuda"), 64, 1e7)
    slots = torch.randperm(1000, device="cuda")[:tokens]
    got_k, got_v = tk.allocate(4, 1000, 256, "cuda"), tv.allocate(4, 1000, 256, "cuda")
    want_k, want_v = got_k.clone(), got_v.clone()
    write_kv(k, v, got_k, got_v, slots, tk, tv, k_norm=(weight, 1e-6, cos, sin))  # compile outside the capture
    got_k.zero_()
    got_v.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv(k, v, got_k, got_v, slots, tk, tv, k_norm=(weight, 1e-6, cos, sin))
    graph.replay()
    write_rows(qk_norm_rope(k, weight, 1e-6, cos, sin), want_k, slots, tk)
    write_rows(v, want_v, slots, tv)
    assert torch.equal(got_v, want_v)
    a, b = tk.dequantize(got_k), tk.dequantize(want_k)
    differ = int((a != b).sum())
    assert differ <= a.numel() // 100 and ((a - b).abs().max() / b.abs().max()).item() < 0.1, differ
