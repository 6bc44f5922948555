"""Q8_0 on tensor cores (kernels/quant_matmul/q8_0_mma.cu): its routing and compile on any machine, its results
against the float32 dequantization on a GPU."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.formats import quants
from flashtree.kernels.quant_matmul import (QuantWeight, mma, q8_0_mma, q8_0_on_tensor_cores, quant_matmul,
                                            quant_matmul_rounded, round_rows_f16)
from tests.kernels.test_mma import _nvrtc_available

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _q8_0_rows(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF Q8_0 bytes [n, row bytes]: every int8 value (-128 included), small random positive and negative d."""
    block, size = GGML_QUANT_SIZES[QType.Q8_0]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // block, size), generator=gen, dtype=torch.uint8)
    d = ((torch.rand(blocks.shape[0], generator=gen) * 0.02 + 1e-3) * (torch.randint(0, 2, (blocks.shape[0],),
                                                                                     generator=gen) * 2 - 1))
    blocks[:, 0:2] = d.half().view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def test_only_q8_0_decode_and_verify_rows_on_cuda_take_the_kernel():
    assert q8_0_mma.supports((5120, 17408)) and q8_0_mma.supports((16, 256))
    assert not q8_0_mma.supports((5120, 17408 + 32)) and not q8_0_mma.supports((5120 + 8, 256))
    cpu = torch.device("cpu")
    assert not q8_0_mma.takes(QType.Q8_0, (5120, 5120), cpu)
    assert not q8_0_mma.takes(QType.Q4_K, (5120, 5120), torch.device("cuda", 0))
    weight = QuantWeight.from_gguf_bytes(_q8_0_rows(16, 256).reshape(-1), QType.Q8_0, (16, 256))
    assert not q8_0_on_tensor_cores(torch.zeros(1, 256), weight)  # on the CPU the reference path serves


def test_two_tiles_a_cta_where_the_matrix_fills_the_gpu():
    assert q8_0_mma.choose_config(1, 5120, 17408, 132) == q8_0_mma.Q8Config(rt=1, warps=8)
    assert q8_0_mma.choose_config(23, 5120, 17408, 132).rt == 2
    assert q8_0_mma.choose_config(23, 1024, 5120, 132).rt == 1  # 32 two-tile CTAs would leave SMs idle
    with pytest.raises(FlashtreeError, match="rt in 1, 2, 4"):
        q8_0_mma.Q8Config(rt=3)


@pytest.mark.skipif(not _nvrtc_available(), reason="needs cuda-python and NVRTC")
def test_every_launch_a_model_takes_compiles_for_sm90():
    """CI has no GPU: this keeps q8_0_mma.cu compiling, each token-group count in both output types."""
    for dtype in (torch.bfloat16, torch.float32):
        jobs = q8_0_mma.cuda_jobs([(5120, 17408), (1024, 5120)], 132, dtype)
        names = [name for name, _ in jobs]
        assert len(names) == len(set(names))
        assert mma._prep_x_instance(QType.Q4_K, dtype) in names
        for name, source in jobs:
            assert mma.compile_cubin(source, "sm_90")[:4] == b"\x7fELF", name
    # the largest launch shape: its warps' sums meet in shared memory in slices (static shared memory is 48 KB)
    largest = q8_0_mma.Q8Config(rt=4, warps=16)
    name = q8_0_mma._instance(largest, 4, torch.float32)
    assert mma.compile_cubin(q8_0_mma.source() + q8_0_mma._wrapper(name, largest, 4, torch.float32), "sm_90")


def _gpu_weight(n: int, k: int, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    weight = QuantWeight.from_gguf_bytes(_q8_0_rows(n, k, seed).cuda().reshape(-1), QType.Q8_0, (n, k))
    return weight, quants.dequantize(weight.gguf_bytes(), QType.Q8_0, (n, k), torch.float32)


def _matmul(x: torch.Tensor, weight: QuantWeight, **kwargs) -> torch.Tensor:
    fields = weight.fields()
    return q8_0_mma.matmul(x, fields["qs"], fields["d"], *weight.shape, **kwargs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(5120, 17408), (1040, 2304), (48, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("config", [None, q8_0_mma.Q8Config(1, 4), q8_0_mma.Q8Config(2, 8), q8_0_mma.Q8Config(4, 2)],
                         ids=lambda c: "default" if c is None else f"r{c.rt}w{c.warps}")
def test_the_kernel_is_the_float32_product_of_float16_x_on_gpu(shape, config):
    """Against float32 x (rounded to float16 per row as the kernel takes it) times the float32 dequantization:
    only the sums' order differs (1040 rows: a partial last CTA of two tiles; 48 rows: more warps than chunks)."""
    n, k = shape
    weight, dense = _gpu_weight(n, k)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 2, 8, 9, 23, 32, 45):
        x = torch.randn(m, k, generator=gen, device="cuda")
        ref = round_rows_f16(x) @ dense.T
        y = _matmul(x, weight, out_dtype=torch.float32, config=config)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-6, (m, err)


@pytest.mark.gpu
@gpu
def test_a_rows_bits_do_not_depend_on_the_other_rows_on_gpu():
    """Decode (1 row) and a verify (23 rows) give a token the same bits, in bf16 and in float32."""
    weight, _ = _gpu_weight(5120, 5120)
    x = torch.randn(23, 5120, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        rows = _matmul(x.to(dtype), weight)
        for i in (0, 7, 8, 22):
            assert torch.equal(_matmul(x[i:i + 1].to(dtype), weight)[0], rows[i])


@pytest.mark.gpu
@gpu
def test_rows_of_any_magnitude_and_the_public_entries_on_gpu():
    """Tiny to huge rows in one launch (x's power-of-two scaling), through quant_matmul (bf16 out, within its
    rounding of the float32 product) and quant_matmul_rounded (float32 out)."""
    n, k = 1024, 5120
    weight, dense = _gpu_weight(n, k)
    x = torch.randn(6, k, device="cuda") * torch.tensor([[1e-8], [1e-3], [1.0], [7.0], [1e5], [1e20]], device="cuda")
    ref = round_rows_f16(x) @ dense.T
    out = quant_matmul(x.bfloat16(), weight)
    assert out.dtype == torch.bfloat16
    bf16_ref = round_rows_f16(x.bfloat16().float()) @ dense.T
    for row in range(6):
        bound = bf16_ref[row].abs() * 2.0**-8 + 1e-5 * bf16_ref[row].abs().max()
        assert bool(((out[row].float() - bf16_ref[row]).abs() <= bound).all()), row
    rounded = quant_matmul_rounded(x, weight)
    assert rounded.dtype == torch.float32
    for row in range(6):
        assert ((rounded[row] - ref[row]).abs().max() / ref[row].abs().max()).item() < 2e-6, row
