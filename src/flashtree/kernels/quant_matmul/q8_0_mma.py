"""Q8_0 times 1-32 rows of x on tensor cores (q8_0_mma.cu, CUDA C compiled at run time like `mma`), from the weight's
GGUF fields as `QuantWeight` keeps them (qs [N, K] int8, d [N, K / 32] float16): no load-time re-layout.

x is converted once per call by mma.cu's `prep_x<Q4_K>` (float16 scaled by a power of two per row; its sub-block
sums are written and not read here), the weights' integers enter the MMAs exactly and each block's scale multiplies
its float32 partial sums: the result differs from the float32 dequantized product by x's float16 rounding and the
sums' order only. A row's bits do not depend on how many rows are multiplied with it (decode and verify agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.kernels.cuda_functions import functions, launch
from flashtree.kernels.quant_matmul import mma

_SOURCE = Path(__file__).with_name("q8_0_mma.cu")
CHUNK = 128  # K values a warp takes at once (q8_0_mma.cu Q8_CHUNK)
_C_TYPES = {torch.bfloat16: "u16", torch.float32: "float"}


@dataclass(frozen=True)
class Q8Config:
    """rt: 16-row tiles a CTA owns (x's loads shared by them); warps: the CTA's warps, which take K in turn."""

    rt: int = 1
    warps: int = 8

    def __post_init__(self):
        if self.rt not in (1, 2, 4) or self.warps not in (1, 2, 4, 8, 16):
            raise FlashtreeError(f"Q8_0 MMA config: rt in 1, 2, 4 and warps in 1-16 (a power of two), got {self}")


def supports(shape: tuple[int, int]) -> bool:
    """Whole 16-row tiles, and K in 128-value chunks that `prep_x<Q4_K>` (256-value super-blocks) converts."""
    n, k = shape
    return n % mma.TILE_ROWS == 0 and k % mma.SUPER == 0


def takes(qtype: QType, shape: tuple[int, int], device: torch.device) -> bool:
    """Whether a weight of this type and shape on `device` goes through this kernel (1-32 rows of x)."""
    return qtype == QType.Q8_0 and device.type == "cuda" and supports(shape) and mma.available()


def choose_config(m: int, n: int, k: int, sms: int = 132) -> Q8Config:
    """Two tiles a CTA from two token groups where the matrix still gives every SM a CTA (x read half as often)."""
    return Q8Config(rt=2 if mma.token_groups(min(m, mma.MAX_M)) >= 2 and n // 32 >= sms else 1, warps=8)


def source() -> str:
    return mma.X_F16_SOURCE.read_text() + "\n" + _SOURCE.read_text()


def _instance(config: Q8Config, tg: int, out_dtype: torch.dtype) -> str:
    out = "_of32" if out_dtype == torch.float32 else ""
    return f"q8_0_mm_t{tg}_r{config.rt}_w{config.warps}{out}"


def _wrapper(name: str, config: Q8Config, tg: int, out_dtype: torch.dtype) -> str:
    ot = _C_TYPES[out_dtype]
    return (f'extern "C" __global__ void __launch_bounds__({32 * config.warps}) {name}(const u16* xh, '
            f"const float* scale, const unsigned char* qs, const u16* d, {ot}* out, int M, int N, int K) {{ "
            f"q8_0_mm<{tg}, {config.rt}, {config.warps}>(xh, scale, qs, d, out, M, N, K); }}\n")


def cuda_jobs(shapes, sms: int, dtype: torch.dtype) -> list[tuple[str, str]]:
    """(name, whole source) of every launch Q8_0 weights of these (n, k) shapes take in a model whose x and out are
    `dtype` (1-32 rows: each count of token groups), and x's conversion (mma.cu `prep_x<Q4_K>`)."""
    if dtype not in _C_TYPES:
        raise FlashtreeError(f"the Q8_0 MMA kernel takes and writes bf16 or float32 rows, not {dtype}")
    jobs = {}
    for n, k in shapes:
        for m in (1, 8, 16, 24, 32):
            config, tg = choose_config(m, n, k, sms), mma.token_groups(m) or 1
            name = _instance(config, tg, dtype)
            jobs[name] = source() + _wrapper(name, config, tg, dtype)
    prep = mma._prep_x_instance(QType.Q4_K, dtype)
    jobs.update(mma.with_source([(prep, mma._prep_x_wrapper(QType.Q4_K, dtype))]))
    return list(jobs.items())


def matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, n: int, k: int, out_dtype: torch.dtype | None = None,
           config: Q8Config | None = None) -> torch.Tensor:
    """x [M, K] bf16 or float32 @ W^T -> [M, N] in `out_dtype` (bf16 or float32; default x's), 32 rows a launch."""
    m = x.shape[0]
    out_dtype = out_dtype or x.dtype
    if x.dtype not in _C_TYPES or out_dtype not in _C_TYPES:
        raise FlashtreeError(f"the Q8_0 MMA kernel takes and writes bf16 or float32 rows, not {x.dtype} -> {out_dtype}")
    if m < 1 or not supports((n, k)):
        raise FlashtreeError(f"the Q8_0 MMA kernel needs at least one row and N % 16 == K % 256 == 0, got M {m}, "
                             f"[{n}, {k}]")
    xh, _, scale = mma.prepare_x(x, QType.Q4_K)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    for start in range(0, m, mma.MAX_M):
        rows = min(mma.MAX_M, m - start)
        c = config or choose_config(rows, n, k, mma.sm_count(x.device))
        tg = mma.token_groups(rows) or 1  # one row: one token group (no separate one-row kernel)
        name = _instance(c, tg, out_dtype)
        fn = functions(x.device).function(name, lambda: source() + _wrapper(name, c, tg, out_dtype))
        launch(fn, (-(-n // (16 * c.rt)), 1), 32 * c.warps,
               [xh[start:], scale[start:], qs, d, out[start:], rows, n, k], x.device)
    return out
