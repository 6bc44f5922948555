"""Q8_0, Q5_K and IQ4_XS on tensor cores (kernels/quant_matmul/block32_mma.cu): their routing and compile on any
machine, their results against the float32 dequantization on a GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.formats import quants
from flashtree.kernels.quant_matmul import (KERNELS, QuantWeight, block32_mma, blocks_on_tensor_cores, mma,
                                            quant_matmul, quant_matmul_rounded, round_rows_f16)
from tests.kernels.test_mma import _nvrtc_available

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TYPES = block32_mma.TYPES


def _random_blocks(qtype: QType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF bytes [n, row bytes]: random quants, scales and high bits, each float16 field a small random value of
    either sign."""
    block, size = GGML_QUANT_SIZES[qtype]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // block, size), generator=gen, dtype=torch.uint8)
    for f in KERNELS[qtype].fields:
        if f.dtype == torch.float16:
            sign = torch.randint(0, 2, (blocks.shape[0],), generator=gen) * 2 - 1
            d = (torch.rand(blocks.shape[0], generator=gen) * 0.02 + 1e-3) * sign
            blocks[:, f.start:f.stop] = d.half().view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def test_only_the_block_types_decode_and_verify_rows_on_cuda_take_the_kernel(monkeypatch):
    monkeypatch.setattr(block32_mma.mma, "available", lambda: True)
    monkeypatch.setenv("FLASHTREE_BLOCK32", "0")
    assert not block32_mma.takes(QType.Q8_0, (5120, 5120), torch.device("cuda", 0))  # off until timed on a GPU
    monkeypatch.setenv("FLASHTREE_BLOCK32", "1")
    assert block32_mma.takes(QType.IQ4_XS, (5120, 5120), torch.device("cuda", 0))
    assert block32_mma.supports((5120, 17408)) and block32_mma.supports((16, 256))
    assert not block32_mma.supports((5120, 17408 + 32)) and not block32_mma.supports((5120 + 8, 256))
    cuda = torch.device("cuda", 0)
    assert not block32_mma.takes(QType.Q8_0, (5120, 5120), torch.device("cpu"))
    assert not block32_mma.takes(QType.Q4_K, (5120, 5120), cuda) and not block32_mma.takes(QType.Q6_K, (16, 256), cuda)
    weight = QuantWeight.from_gguf_bytes(_random_blocks(QType.Q8_0, 16, 256).reshape(-1), QType.Q8_0, (16, 256))
    assert not blocks_on_tensor_cores(torch.zeros(1, 256), weight)  # on the CPU the reference path serves
    with pytest.raises(FlashtreeError, match="Q8_0, Q5_K, IQ4_XS, not Q4_K"):
        block32_mma.matmul(torch.zeros(1, 256), {}, QType.Q4_K, 16, 256)


def test_two_tiles_a_cta_where_the_matrix_fills_the_gpu():
    assert block32_mma.choose_config(QType.Q8_0, 1, 5120, 17408, 132) == block32_mma.BlockConfig(rt=1, warps=8)
    assert block32_mma.choose_config(QType.IQ4_XS, 23, 5120, 17408, 132).rt == 2
    assert block32_mma.choose_config(QType.Q5_K, 23, 5120, 17408, 132).rt == 1  # two tiles spill
    assert block32_mma.choose_config(QType.Q8_0, 23, 1024, 5120, 132).rt == 1  # 32 two-tile CTAs leave SMs idle
    with pytest.raises(FlashtreeError, match="rt in 1, 2, 4"):
        block32_mma.BlockConfig(rt=3)


@pytest.mark.skipif(not _nvrtc_available(), reason="needs cuda-python and NVRTC")
def test_every_launch_a_model_takes_compiles_for_sm90():
    """CI has no GPU: this keeps block32_mma.cu compiling, each type and token-group count in both output types."""
    for dtype in (torch.bfloat16, torch.float32):
        jobs = block32_mma.cuda_jobs([(qtype, 5120, 17408) for qtype in TYPES] + [(QType.Q8_0, 1024, 5120)], 132, dtype)
        names = [name for name, _ in jobs]
        assert len(names) == len(set(names)) == 3 * 4 + 3 + 1  # tg 1-4 per type, the small matrix's rt 1 at 2-4
        assert mma._prep_x_instance(QType.Q4_K, dtype) in names
        for name, source in jobs:
            assert mma.compile_cubin(source, "sm_90")[:4] == b"\x7fELF", name
    # the largest launch shape: its warps' sums meet in shared memory in slices (static shared memory is 48 KB)
    largest = block32_mma.BlockConfig(rt=4, warps=16)
    for qtype in TYPES:
        name = block32_mma._instance(qtype, largest, 4, torch.float32)
        assert mma.compile_cubin(block32_mma.source() + block32_mma._wrapper(name, qtype, largest, 4, torch.float32),
                                 "sm_90")


HOST_HARNESS = Path(__file__).with_name("block32_host.cpp")
# (M, N, K, token groups, row tiles a CTA, warps): one row; rows past M, a partial last CTA of two tiles, K in chunks
# the warps share unevenly; four token groups on 4-tile CTAs
HOST_CASES = [(1, 32, 512, 1, 1, 2), (9, 48, 768, 2, 2, 4), (30, 64, 256, 4, 4, 1)]


@pytest.fixture(scope="module")
def host_build(tmp_path_factory):
    """block32_mma.cu built for the host around tests/kernels/block32_host.cpp, one binary per type and launch shape."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ (the CUDA C kernel built for the host)")
    folder = tmp_path_factory.mktemp("block32_host")
    (folder / "kernel.cu").write_text(Path(block32_mma.__file__).with_name("block32_mma.cu").read_text())
    built = {}

    def build(qtype: QType, tg: int, rt: int, warps: int) -> Path:
        key = (qtype, tg, rt, warps)
        if key not in built:
            binary = folder / f"{qtype.name}_t{tg}_r{rt}_w{warps}"
            subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", f"-DHOST_QT={qtype.name}", f"-DHOST_TG={tg}",
                            f"-DHOST_RT={rt}", f"-DHOST_WARPS={warps}", f"-I{folder}", str(HOST_HARNESS), "-o", str(binary)], check=True,
                           capture_output=True)
            built[key] = binary
        return built[key]
    return build


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", HOST_CASES, ids=lambda c: f"m{c[0]}_n{c[1]}_k{c[2]}_t{c[3]}r{c[4]}w{c[5]}")
def test_the_kernel_built_for_the_host_is_the_float32_product(host_build, qtype, case):
    """The CUDA C kernel's threads as host threads (block32_host.cpp: its indexing, the type's bit work, Q5_K's
    sums of x, the warps' shared-memory sums) against float16 x times the float32 dequantization of the GGUF bytes."""
    m, n, k, tg, rt, warps = case
    weight = QuantWeight.from_gguf_bytes(_random_blocks(qtype, n, k, seed=m).reshape(-1), qtype, (n, k))
    dense = quants.dequantize(weight.gguf_bytes(), qtype, (n, k), torch.float32)
    xh = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).half()
    fields = weight.fields()
    stdin = [np.array([m, n, k], dtype=np.int32).tobytes(), xh.view(torch.int16).numpy().tobytes(),
             np.ones(m, dtype=np.float32).tobytes()]
    for name in block32_mma._ARGUMENTS[qtype]:
        raw = fields[name].contiguous().view(torch.uint8).numpy().tobytes() if name else b""
        stdin += [np.array([len(raw)], dtype=np.int64).tobytes(), raw]
    run = subprocess.run([str(host_build(qtype, tg, rt, warps))], input=b"".join(stdin), capture_output=True,
                         check=True)
    out = torch.from_numpy(np.frombuffer(run.stdout, dtype=np.float32).copy()).reshape(m, n)
    ref = xh.float() @ dense.T
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5


def _gpu_weight(qtype: QType, n: int, k: int, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    weight = QuantWeight.from_gguf_bytes(_random_blocks(qtype, n, k, seed).cuda().reshape(-1), qtype, (n, k))
    return weight, quants.dequantize(weight.gguf_bytes(), qtype, (n, k), torch.float32)


def _matmul(x: torch.Tensor, weight: QuantWeight, **kwargs) -> torch.Tensor:
    return block32_mma.matmul(x, weight.fields(), weight.qtype, *weight.shape, **kwargs)


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(5120, 17408), (1040, 2304), (48, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("config", [None, block32_mma.BlockConfig(1, 4), block32_mma.BlockConfig(2, 8),
                                    block32_mma.BlockConfig(4, 2)],
                         ids=lambda c: "default" if c is None else f"r{c.rt}w{c.warps}")
def test_the_kernel_is_the_float32_product_of_float16_x_on_gpu(qtype, shape, config):
    """Against float32 x (rounded to float16 per row as the kernel takes it) times the float32 dequantization:
    only the sums' order differs, and Q5_K's min term goes through x's block sums (1040 rows: a partial last CTA of
    two tiles; 48 rows: more warps than chunks)."""
    n, k = shape
    weight, dense = _gpu_weight(qtype, n, k)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 2, 8, 9, 23, 32, 45):
        x = torch.randn(m, k, generator=gen, device="cuda")
        err = _relative_error(_matmul(x, weight, out_dtype=torch.float32, config=config), round_rows_f16(x) @ dense.T)
        assert err < (2e-5 if qtype == QType.Q5_K else 2e-6), (m, err)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_bits_do_not_depend_on_the_other_rows_on_gpu(qtype):
    """Decode (1 row) and a verify (23 rows) give a token the same bits, in bf16 and in float32."""
    weight, _ = _gpu_weight(qtype, 5120, 5120)
    x = torch.randn(23, 5120, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        rows = _matmul(x.to(dtype), weight)
        for i in (0, 7, 8, 22):
            assert torch.equal(_matmul(x[i:i + 1].to(dtype), weight)[0], rows[i])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_of_any_magnitude_and_the_public_entries_on_gpu(qtype, monkeypatch):
    """Tiny to huge rows in one launch (x's power-of-two scaling), through quant_matmul (bf16 out, within its
    rounding of the float32 product) and quant_matmul_rounded (float32 out), the kernel switched on."""
    monkeypatch.setenv("FLASHTREE_BLOCK32", "1")
    n, k = 1024, 5120
    weight, dense = _gpu_weight(qtype, n, k)
    x = torch.randn(6, k, device="cuda") * torch.tensor([[1e-8], [1e-3], [1.0], [7.0], [1e5], [1e20]], device="cuda")
    assert blocks_on_tensor_cores(x, weight)
    out = quant_matmul(x.bfloat16(), weight)
    assert out.dtype == torch.bfloat16
    bf16_ref = round_rows_f16(x.bfloat16().float()) @ dense.T
    for row in range(6):
        bound = bf16_ref[row].abs() * 2.0**-8 + 2e-5 * bf16_ref[row].abs().max()
        assert bool(((out[row].float() - bf16_ref[row]).abs() <= bound).all()), row
    rounded = quant_matmul_rounded(x, weight)
    ref = round_rows_f16(x) @ dense.T
    assert rounded.dtype == torch.float32
    for row in range(6):
        assert _relative_error(rounded[row], ref[row]) < 2e-5, row
