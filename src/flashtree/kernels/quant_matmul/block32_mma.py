"""Q8_0, Q5_K and IQ4_XS times 1-32 rows of x on tensor cores (block32_mma.cu, CUDA C compiled at run time like
`mma`), from the weight's GGUF fields as `QuantWeight` keeps them: no load-time re-layout.

x is converted once per call by mma.cu's `prep_x<Q4_K>` (float16 scaled by a power of two per row; Q5_K's min term
takes each block's sum of x on the MMA, against ones), the weights' integers enter the MMAs exactly and each block's
scale multiplies its float32 partial sums: the result differs from the float32 dequantized product by x's float16
rounding and the sums' order only. A row's bits do not depend on how many rows are multiplied with it (decode and
verify agree).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.kernels.cuda_functions import functions, launch
from flashtree.kernels.quant_matmul import mma

_SOURCE = Path(__file__).with_name("block32_mma.cu")
TYPES = (QType.Q8_0, QType.Q5_K, QType.IQ4_XS)
CHUNK = 128  # K values a warp takes at once (block32_mma.cu B32_CHUNK)
# each type's fields in the kernel's argument order (q, qh, s, sh, d, dmin); None: the type has none (a null pointer)
_ARGUMENTS = {QType.Q8_0: ("qs", None, None, None, "d", None),
              QType.Q5_K: ("qs", "qh", "scales", None, "d", "dmin"),
              QType.IQ4_XS: ("qs", None, "scales_l", "scales_h", "d", None)}


@dataclass(frozen=True)
class BlockConfig:
    """rt: 16-row tiles a CTA owns (x's loads shared by them); warps: the CTA's warps, which take K in turn."""

    rt: int = 1
    warps: int = 8

    def __post_init__(self):
        if self.rt not in (1, 2, 4) or self.warps not in (1, 2, 4, 8, 16):
            raise FlashtreeError(f"block32 MMA config: rt in 1, 2, 4 and warps in 1-16 (a power of two), got {self}")


def supports(shape: tuple[int, int]) -> bool:
    """Whole 16-row tiles, and K in 256-value super-blocks (the K-quants' own, and `prep_x<Q4_K>`'s sums)."""
    n, k = shape
    return n % mma.TILE_ROWS == 0 and k % mma.SUPER == 0


def enabled() -> bool:
    """FLASHTREE_BLOCK32=1 routes these types' 1-32-row matmuls here (and compiles the kernel at load). Off by default
    until the kernel has passed its GPU tests and been timed (built and checked on the host in the thirty-ninth session,
    docs/PERFORMANCE.md; no GPU was lent then): until then the Triton kernels serve, as before."""
    return os.environ.get("FLASHTREE_BLOCK32", "0") == "1"


def takes(qtype: QType, shape: tuple[int, int], device: torch.device) -> bool:
    """Whether a weight of this type and shape on `device` goes through this kernel (1-32 rows of x)."""
    return qtype in TYPES and device.type == "cuda" and supports(shape) and enabled() and mma.available()


def choose_config(qtype: QType, m: int, n: int, k: int, sms: int = 132) -> BlockConfig:
    """Two tiles a CTA from two token groups where the matrix still gives every SM a CTA (x read half as often), but
    for Q5_K, whose two tiles take 255 registers at 3 token groups and spill 16 bytes at 4 (sm_90, NVRTC 13).
    Not yet tuned on a GPU (benchmarks/sweep_block32.py)."""
    two = qtype != QType.Q5_K and mma.token_groups(min(m, mma.MAX_M)) >= 2 and n // 32 >= sms
    return BlockConfig(rt=2 if two else 1, warps=8)


def source() -> str:
    return mma.X_F16_SOURCE.read_text() + "\n" + _SOURCE.read_text()


def _instance(qtype: QType, config: BlockConfig, tg: int, out_dtype: torch.dtype) -> str:
    out = "_of32" if out_dtype == torch.float32 else ""
    return f"b32_{qtype.name.lower()}_t{tg}_r{config.rt}_w{config.warps}{out}"


def _wrapper(name: str, qtype: QType, config: BlockConfig, tg: int, out_dtype: torch.dtype) -> str:
    ot = mma._C_TYPES[out_dtype]
    return (f'extern "C" __global__ void __launch_bounds__({32 * config.warps}) {name}(const u16* xh, '
            f"const float* scale, const unsigned char* q, const unsigned char* qh, const unsigned char* s, "
            f"const u16* sh, const u16* d, const u16* dmin, {ot}* out, int M, int N, int K) {{ "
            f"block32_mm<{qtype.name}, {tg}, {config.rt}, {config.warps}>(xh, scale, q, qh, s, sh, d, dmin, out, "
            f"M, N, K); }}\n")


def cuda_jobs(weights, sms: int, dtype: torch.dtype) -> list[tuple[str, str]]:
    """(name, whole source) of every launch weights of these (qtype, n, k) take in a model whose x and out are `dtype`
    (1-32 rows: each count of token groups), and x's conversion (mma.cu `prep_x<Q4_K>`)."""
    mma._check_dtypes(dtype)
    jobs = {}
    for qtype, n, k in weights:
        for m in (1, 8, 16, 24, 32):
            config, tg = choose_config(qtype, m, n, k, sms), mma.token_groups(m) or 1
            name = _instance(qtype, config, tg, dtype)
            jobs[name] = source() + _wrapper(name, qtype, config, tg, dtype)
    prep = mma._prep_x_instance(QType.Q4_K, dtype)
    jobs.update(mma.with_source([(prep, mma._prep_x_wrapper(QType.Q4_K, dtype))]))
    return list(jobs.items())


def matmul(x: torch.Tensor, fields: dict[str, torch.Tensor], qtype: QType, n: int, k: int,
           out_dtype: torch.dtype | None = None, config: BlockConfig | None = None) -> torch.Tensor:
    """x [M, K] bf16 or float32 @ W^T -> [M, N] in `out_dtype` (bf16 or float32; default x's), W given by its GGUF
    fields (`QuantWeight.fields()`), 32 rows a launch."""
    m = x.shape[0]
    out_dtype = out_dtype or x.dtype
    if qtype not in TYPES:
        raise FlashtreeError(f"the block32 MMA kernel takes {', '.join(t.name for t in TYPES)}, not {qtype.name}")
    mma._check_dtypes(x.dtype, out_dtype)
    if m < 1 or not supports((n, k)):
        raise FlashtreeError(f"the block32 MMA kernel needs at least one row and N % 16 == K % 256 == 0, got M {m}, "
                             f"[{n}, {k}]")
    xh, _, scale = mma.prepare_x(x, QType.Q4_K)  # its block sums are not read
    weights = [fields[name] if name else xh for name in _ARGUMENTS[qtype]]  # a field the type lacks: never read
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    for start in range(0, m, mma.MAX_M):
        rows = min(mma.MAX_M, m - start)
        c = config or choose_config(qtype, rows, n, k, mma.sm_count(x.device))
        tg = mma.token_groups(rows) or 1  # one row: one token group (no separate one-row kernel)
        name = _instance(qtype, c, tg, out_dtype)
        fn = functions(x.device).function(name, lambda: source() + _wrapper(name, qtype, c, tg, out_dtype))
        launch(fn, (-(-n // (16 * c.rt)), 1), 32 * c.warps,
               [xh[start:], scale[start:], *weights, out[start:], rows, n, k], x.device)
    return out
