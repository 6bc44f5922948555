"""y = x @ W^T with W kept as GGUF quantized blocks on the device (Triton kernels, one module per type).

`QuantWeight.from_gguf_bytes` validates a tensor's raw bytes and stores them field-major: every
block field (quants, high bits, scales, fp16 d...) becomes one contiguous [N, blocks, width] array,
all concatenated in one uint8 buffer. Values are untouched (the GGUF bytes come back exactly with
`gguf_bytes()`); the point is aligned, vectorizable loads, since GGUF block sizes (e.g. Q6_K's 210
bytes) break alignment, and a row's quants are contiguous across blocks. On CUDA with cuda-python, Q4_K and
Q6_K weights are instead re-laid in tensor-core fragment order (`mma.py`, CUDA kernels in `mma.cu`):
bf16 rows, 32 a launch, multiply the exact quantized integers (Q4_K's float16 kernel with the sub-block
scales inside the exact float16 weights, x scaled by a power of two per row; Q6_K's bf16 kernel scaling
each sub-block in float32; no weight rounding); chunks of DENSE_MIN_M rows and more go through a dense
temporary and cuBLAS, float32 x through a float32 one.
What follows describes the Triton kernels the other types (and machines without cuda-python) use. `quant_matmul` runs the
type's Triton kernel on CUDA (or on CPU under TRITON_INTERPRET=1), else a torch
dequantize-then-matmul. F32/F16/BF16 weights go to torch.

Numerics (see `_launch.py` for the kernels): by default, 2-64 rows of bf16/f16 x take the v2
"tiled" kernel, which dequantizes each weight tile once per program and ROUNDS THE WEIGHTS TO x's
DTYPE (bf16: 8 significant bits) before a tensor-core `tl.dot` with float32 accumulation, exactly
as a dense bf16/f16 model stores its weights; the prefill paths (M > 64: v1 with the same dot;
M >= DENSE_MIN_M: the weight dequantized to x's dtype, then cuBLAS) do the same. A single row
(decode) takes v1's float32 multiply-adds with float32 weights, except for Q6_K. Against a float32
dequantization the error is that weight rounding plus the final rounding of the output to x's
dtype; float32 x keeps float32 weights (tf32x3 dot, ~float32 error). Results are deterministic:
split-K partials are summed in a fixed order, never with atomics.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass, field
from types import ModuleType

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from flashtree.errors import FlashtreeError
from flashtree.formats import quants
from flashtree.kernels import triton_runs_on
from flashtree.kernels.activations import GLU_GROUP, interleaved_silu_mul
from flashtree.kernels.quant_matmul import block32_mma, mma


@dataclass(frozen=True)
class Field:
    """Bytes [start, stop) of every block, read by the kernel as `dtype`."""

    name: str
    start: int
    stop: int
    dtype: torch.dtype = torch.uint8


@dataclass(frozen=True)
class QuantKernel:
    module: str  # imported on first use: it needs triton, the layout does not
    fields: tuple[Field, ...]  # stored in this order; widest first keeps every field aligned

    def load(self) -> ModuleType:
        return _import_kernel(self.module)


@functools.cache
def _import_kernel(module: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{module}")


_F16 = torch.float16
KERNELS: dict[QType, QuantKernel] = {
    QType.Q4_K: QuantKernel("q4_k", (Field("qs", 16, 144), Field("scales", 4, 16),
                                     Field("d", 0, 2, _F16), Field("dmin", 2, 4, _F16))),
    QType.Q5_K: QuantKernel("q5_k", (Field("qs", 48, 176), Field("qh", 16, 48), Field("scales", 4, 16),
                                     Field("d", 0, 2, _F16), Field("dmin", 2, 4, _F16))),
    QType.Q6_K: QuantKernel("q6_k", (Field("ql", 0, 128), Field("qh", 128, 192),
                                     Field("scales", 192, 208, torch.int8), Field("d", 208, 210, _F16))),
    QType.Q8_0: QuantKernel("q8_0", (Field("qs", 2, 34, torch.int8), Field("d", 0, 2, _F16))),
    QType.IQ4_XS: QuantKernel("iq4_xs", (Field("qs", 8, 136), Field("scales_l", 4, 8),
                                         Field("scales_h", 2, 4), Field("d", 0, 2, _F16))),
}
PLAIN_TYPES: dict[QType, torch.dtype] = {QType.F32: torch.float32, QType.F16: torch.float16,
                                         QType.BF16: torch.bfloat16}
SUPPORTED_TYPES: tuple[QType, ...] = (*KERNELS, *PLAIN_TYPES)
# prefill chunks of at least this many rows (bf16/f16 x): the weight is dequantized once into a dense
# temporary and multiplied by cuBLAS, which beats v1's tiles once the dequantization is amortized
DENSE_MIN_M = 512
X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _supported_names() -> str:
    return ", ".join(t.name for t in SUPPORTED_TYPES)


# prefill chunks of fragment-ordered weights go through a dense temporary up to this size; a bigger
# weight (the 248K-row LM head) is multiplied 32 rows at a time instead
DENSE_MAX_BYTES = 512 << 20
# ... and the temporary holds at most this much of it: a bigger weight (the 27B's fused gate/up, 356 MB in
# float16) is dequantized and multiplied in row blocks, so that a prefill chunk's scratch leaves the memory to the KV
# cache (issue #20) at the price of a launch or two more per matrix
DENSE_BLOCK_BYTES = 64 << 20


def uses_mma_layout(qtype: QType, shape: tuple[int, int], device: torch.device) -> bool:
    """Q4_K/Q6_K weights on CUDA are stored in tensor-core fragment order for the CUDA kernels of
    `mma` (when cuda-python is installed; FLASHTREE_MMA=0 keeps the Triton kernels)."""
    return device.type == "cuda" and mma.supports(qtype, shape) and mma.available()


@dataclass
class QuantWeight:
    raw: torch.Tensor  # uint8: field-major or fragment-ordered (`mma_layout`) blocks, or plain values' bytes
    qtype: QType
    shape: tuple[int, int]  # (N out, K in)
    mma_layout: bool = False
    _fields: dict[str, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_gguf_bytes(cls, raw: torch.Tensor, qtype: QType | int, shape: tuple[int, int]) -> QuantWeight:
        try:
            qtype = QType(qtype)
        except ValueError:
            qtype = None
        if qtype not in SUPPORTED_TYPES:
            raise FlashtreeError(f"quant_matmul does not support tensor type {quants.type_name(qtype or 0)}"
                                 f" (supported: {_supported_names()})")
        if len(shape) != 2:
            raise FlashtreeError(f"quant_matmul weights are 2-D (N, K), got shape {tuple(shape)}")
        if raw.dtype != torch.uint8:
            raise FlashtreeError(f"raw weight bytes must be uint8, got {raw.dtype}")
        n, k = (int(s) for s in shape)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if k % block:
            raise FlashtreeError(f"{qtype.name} weight of shape ({n}, {k}): K must be a multiple of {block}")
        expected = n * (k // block) * type_size
        if raw.numel() != expected:
            raise FlashtreeError(f"{qtype.name} weight of shape ({n}, {k}) needs {expected} bytes, "
                                 f"got {raw.numel()}")
        if qtype in PLAIN_TYPES:
            return cls(raw.reshape(-1).contiguous(), qtype, (n, k))
        if uses_mma_layout(qtype, (n, k), raw.device):
            return cls(mma.to_mma_layout(raw, qtype, n, k), qtype, (n, k), mma_layout=True)
        blocks = raw.reshape(n * (k // block), type_size)
        packed = torch.cat([blocks[:, f.start:f.stop].reshape(-1) for f in KERNELS[qtype].fields])
        return cls(packed, qtype, (n, k))

    @property
    def nbytes(self) -> int:
        """Bytes one call reads from the weight (all of it)."""
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def to(self, device) -> QuantWeight:
        device = torch.device(device)
        if self.qtype in PLAIN_TYPES or self.mma_layout == uses_mma_layout(self.qtype, self.shape, device):
            return QuantWeight(self.raw.to(device), self.qtype, self.shape, self.mma_layout)
        return QuantWeight.from_gguf_bytes(self.gguf_bytes().to(device), self.qtype, self.shape)

    def fields(self) -> dict[str, torch.Tensor]:
        """Each field's bytes as a flat tensor of its dtype (views of `raw`, made once)."""
        if self.mma_layout:
            raise FlashtreeError("a fragment-ordered weight has no GGUF fields (use gguf_bytes())")
        if self._fields is None:
            self._fields = self._field_views()
        return self._fields

    def _field_views(self) -> dict[str, torch.Tensor]:
        n, k = self.shape
        count = n * k // GGML_QUANT_SIZES[self.qtype][0]
        views, offset = {}, 0
        for f in KERNELS[self.qtype].fields:
            size = count * (f.stop - f.start)
            views[f.name] = self.raw[offset:offset + size].view(f.dtype)
            offset += size
        return views

    def gguf_bytes(self) -> torch.Tensor:
        """The original GGUF bytes, uint8 [N, row_bytes]."""
        n, k = self.shape
        if self.qtype in PLAIN_TYPES:
            return self.raw.reshape(n, -1)
        if self.mma_layout:
            return mma.from_mma_layout(self.raw, self.qtype, n, k)
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        blocks = torch.empty(n * (k // block), type_size, dtype=torch.uint8, device=self.raw.device)
        for f, values in zip(KERNELS[self.qtype].fields, self.fields().values()):
            blocks[:, f.start:f.stop] = values.view(torch.uint8).reshape(-1, f.stop - f.start)
        return blocks.reshape(n, -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.mma_layout:
            return mma.dequantize(self.raw, self.qtype, *self.shape, dtype)
        return quants.dequantize(self.gguf_bytes(), self.qtype, self.shape, dtype)


def _check_x(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise FlashtreeError(f"quant_matmul needs x of shape [M, {weight.shape[1]}], got {tuple(x.shape)}")
    if x.dtype not in X_DTYPES:
        raise FlashtreeError(f"quant_matmul needs x in one of {X_DTYPES}, got {x.dtype}")
    if x.device != weight.device:
        raise FlashtreeError(f"x is on {x.device} but the weight is on {weight.device}")
    return x.contiguous()


def _triton_runs(x: torch.Tensor) -> bool:
    return triton_runs_on(x.device)


def quant_matmul(x: torch.Tensor, weight: QuantWeight, config=None) -> torch.Tensor:
    """x [M, K] (f32/f16/bf16) @ W^T -> [M, N] in x.dtype.

    `config` (a `_launch.LaunchConfig`) overrides the kernel/tile/split-K choice, for autotuning
    (default: `_launch.choose_config`).
    """
    x = _check_x(x, weight)
    n, k = weight.shape
    if weight.qtype in PLAIN_TYPES:
        return x @ weight.raw.view(PLAIN_TYPES[weight.qtype]).reshape(n, k).to(x.dtype).T
    if weight.mma_layout:
        return _mma_matmul(x, weight)
    if not _triton_runs(x):
        return (x.float() @ weight.dequantize().T).to(x.dtype)
    if config is None and blocks_on_tensor_cores(x, weight):
        return block32_mma.matmul(x, weight.fields(), weight.qtype, n, k)
    return KERNELS[weight.qtype].load().matmul(x, weight.fields(), n, k, config)  # in x.dtype


def blocks_on_tensor_cores(x: torch.Tensor, weight: QuantWeight) -> bool:
    """Q8_0, Q5_K and IQ4_XS decode and verify rows (at most mma.MAX_M, bf16 or float32) on CUDA go through
    `block32_mma` where it is switched on (FLASHTREE_BLOCK32=1) and NVRTC loads; prefill chunks stay on Triton."""
    return (x.shape[0] <= mma.MAX_M and x.dtype in (torch.bfloat16, torch.float32)
            and block32_mma.takes(weight.qtype, weight.shape, x.device))


def _kernel_rows(m: int, n: int, k: int) -> bool:
    """Whether M rows of a fragment-ordered [n, k] weight go through the tensor-core kernels (up to DENSE_MIN_M rows,
    and any count where the weight is too big for a dense temporary) rather than a dense temporary and cuBLAS."""
    return m < DENSE_MIN_M or n * k * 2 > DENSE_MAX_BYTES


def _mma_matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """Fragment-ordered weights: bf16 x through the tensor-core kernels, 32 rows a launch, up to
    DENSE_MIN_M rows (and at any length when the weight is too big for a dense temporary); longer bf16 x
    through a dense bf16 temporary and cuBLAS (prefill chunks); float32/float16 x against the dense weight
    in x's dtype (float32 stays float32: no TF32 unless torch is told to allow it)."""
    n, k = weight.shape
    m = x.shape[0]
    if x.dtype == torch.bfloat16 and _kernel_rows(m, n, k):
        return mma.matmul(x, weight.raw, weight.qtype, n, k)
    return _dense_blocks(x, weight, x.dtype, x.dtype, lambda w, out: torch.matmul(x, w.T, out=out))


def x_f16_type(weight: QuantWeight, m: int) -> QType | None:
    """The type whose float16 x (`mma.prepare_x`) `quant_matmul_rounded` or `quant_matmul_glu(rounded=True)` of M
    float32 rows against `weight` converts x to (qmh), or None (the other kernels read x as it is): what the norm
    before the matmul may write in its own launch (kernels/rms_norm.py `add_rms_norm`'s `x_f16`)."""
    n, k = weight.shape
    if not (weight.mma_layout and _kernel_rows(m, n, k)):
        return None
    return weight.qtype if mma.kernel_for(weight.qtype, mma.token_groups(min(m, mma.MAX_M)), n, k) == "qmh" else None


def dense_block_rows(n: int, k: int) -> int:
    """Rows of an [n, k] fragment-ordered weight dequantized at once for a prefill chunk (whole tiles of 16):
    DENSE_BLOCK_BYTES of float16 / bf16, or all of them."""
    return min(n, max(mma.TILE_ROWS, DENSE_BLOCK_BYTES // (2 * k) // mma.TILE_ROWS * mma.TILE_ROWS))


def _dense_blocks(x: torch.Tensor, weight: QuantWeight, w_dtype: torch.dtype, out_dtype: torch.dtype,
                  multiply_into) -> torch.Tensor:
    """x W^T [M, N] in `out_dtype` from the weight dequantized to `w_dtype` `dense_block_rows` at a time:
    `multiply_into(dense rows [r, K], out[:, those r columns])` writes each block's product in place."""
    n, k = weight.shape
    rows = dense_block_rows(n, k)
    out = torch.empty(x.shape[0], n, dtype=out_dtype, device=x.device)
    for start in range(0, n, rows):
        count = min(rows, n - start)
        multiply_into(mma.dequantize(weight.raw, weight.qtype, n, k, w_dtype, (start, count)), out[:, start:start + count])
    return out


def f16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x 2^e [M, K] float16, 2^-e [M, 1] float32): each row scaled by a power of two (exact) so
    that its largest |x| lies in [1, 2), then rounded to float16. Whatever the row's magnitude, float16 then
    neither overflows nor loses precision to subnormals (but for values 2^-14 below the row's largest), and
    x W^T of the scaled row stays far below float16's range. mma.cu's `prep_x` scales the same way (into
    [256, 512)), so the rounding is the one its tensor-core kernels apply."""
    largest = x.abs().amax(dim=-1, keepdim=True).float()
    _, exponent = torch.frexp(torch.where(torch.isfinite(largest), largest, torch.ones_like(largest)))
    return torch.ldexp(x.float(), 1 - exponent).half(), torch.ldexp(torch.ones_like(largest), exponent - 1)


def round_rows_f16(x: torch.Tensor) -> torch.Tensor:
    """`f16_rows`' rounding as float32 values: what a matmul of float16 x sees."""
    scaled, unscale = f16_rows(x)
    return scaled.float() * unscale


def quant_matmul_rounded(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """A bf16/f16 model's matmul (docs/FIDELITY.md, design D): x [M, K] (its float32 activations) -> float32
    [M, N], the weights never rounded below float16, x rounded as the weight's fastest kernel takes it.

    - Q4_K/Q6_K in fragment order (`mma`): the kernels read x as it is and write float32; qmh rounds x to
      float16 (scaled by a power of two per row, `prep_x`), the one-row and small-matrix kernels (qmv, qmm) to
      bf16 at their load. Prefill chunks of DENSE_MIN_M rows and more: `f16_rows` x times the float16 dense
      weight (cuBLAS), unscaled in float32.
    - Q8_0, Q5_K and IQ4_XS at 1-32 rows on CUDA with FLASHTREE_BLOCK32=1 (`block32_mma`): x rounded to float16
      as qmh rounds it, the exact integer weights, each block's scale applied to its float32 partial sums.
    - The Triton kernels' other types take float32 x: float32 weights and products (tf32x3 dots at 2-64 rows).
    - Plain weights and the CPU: `f16_rows`-rounded x times the weight in its own precision."""
    x = _check_x(x, weight)
    n, k = weight.shape
    if weight.mma_layout:
        if _kernel_rows(x.shape[0], n, k):
            return mma.matmul(x, weight.raw, weight.qtype, n, k, out_dtype=torch.float32)
        scaled, unscale = f16_rows(x)  # once for every block; each block's float16 product unscaled in float32
        return _dense_blocks(x, weight, torch.float16, torch.float32,
                             lambda w, out: torch.mul(scaled @ w.T, unscale, out=out))
    if weight.qtype in PLAIN_TYPES:
        w = weight.raw.view(PLAIN_TYPES[weight.qtype]).reshape(n, k)
        if x.is_cuda and w.dtype == torch.bfloat16:  # x rounded to bf16 as the weight is: a bf16 GEMM
            return (x.bfloat16() @ w.T).float()
        if x.is_cuda and w.dtype == torch.float16:
            return f16_rows_matmul(x, w)
        return round_rows_f16(x) @ w.float().T
    if not _triton_runs(x):
        return round_rows_f16(x) @ weight.dequantize(torch.float32).T
    if blocks_on_tensor_cores(x, weight):
        return block32_mma.matmul(x, weight.fields(), weight.qtype, n, k, out_dtype=torch.float32)
    return KERNELS[weight.qtype].load().matmul(x.float(), weight.fields(), n, k, None)


def glu_weight(gate: QuantWeight, up: QuantWeight) -> QuantWeight:
    """A gate and an up projection (same type and shape [F, K], F % GLU_GROUP == 0) as one [2F, K] weight, their
    rows interleaved GLU_GROUP at a time (each row's GGUF bytes unchanged; `glu_parts` gives the two back): a
    16-row tile of the tensor-core kernels then holds output i's gate and up rows 8 apart, and their epilogue
    writes SiLU(gate) * up (`quant_matmul_glu`)."""
    if gate.qtype != up.qtype or gate.shape != up.shape or gate.shape[0] % GLU_GROUP:
        raise FlashtreeError(f"a gate {gate.qtype.name} {gate.shape} and an up {up.qtype.name} {up.shape} projection "
                             f"do not interleave: same type and shape, rows a multiple of {GLU_GROUP}")
    f, k = gate.shape
    rows = torch.stack([w.gguf_bytes().reshape(f // GLU_GROUP, GLU_GROUP, -1) for w in (gate, up)], dim=1)
    return QuantWeight.from_gguf_bytes(rows.reshape(-1), gate.qtype, (2 * f, k))


def glu_parts(weight: QuantWeight) -> tuple[QuantWeight, QuantWeight]:
    """The gate and up weights a `glu_weight` holds, their GGUF bytes as they were."""
    n, k = weight.shape
    rows = weight.gguf_bytes().reshape(n // (2 * GLU_GROUP), 2, GLU_GROUP, -1)
    return tuple(QuantWeight.from_gguf_bytes(rows[:, side].reshape(-1), weight.qtype, (n // 2, k)) for side in (0, 1))


def quant_matmul_glu(x: torch.Tensor, weight: QuantWeight, rounded: bool = False) -> torch.Tensor:
    """SiLU(x G^T) * (x U^T) [M, F] of a `glu_weight` [2F, K]: `quant_matmul` (or with `rounded`,
    `quant_matmul_rounded`) and `activations.silu_mul` in one, rounded as they round. The tensor-core kernels
    take the product in their epilogue (decode and verify rows); dense prefill chunks, small matrices, other types
    and the CPU multiply, then apply `interleaved_silu_mul`."""
    x = _check_x(x, weight)
    n, k = weight.shape
    m = x.shape[0]
    fused = weight.mma_layout and _kernel_rows(m, n, k) and mma.glu_takes(weight.qtype, m, n, k)
    if fused and rounded and x.dtype == torch.float32:
        return mma.matmul(x, weight.raw, weight.qtype, n, k, out_dtype=torch.float32, glu=True)
    if fused and not rounded and x.dtype == torch.bfloat16:
        return mma.matmul(x, weight.raw, weight.qtype, n, k, glu=True)
    return interleaved_silu_mul(quant_matmul_rounded(x, weight) if rounded else quant_matmul(x, weight))


def f16_rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`f16_rows` x [M, K] times a float16 weight [N, K] (cuBLAS), unscaled in float32."""
    scaled, unscale = f16_rows(x)
    return (scaled @ w.T).float() * unscale


def quant_matmul_reference(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """float32 dequantization of the GGUF bytes, float32 matmul, result in x.dtype."""
    x = _check_x(x, weight)
    w = quants.dequantize(weight.gguf_bytes(), weight.qtype, weight.shape, torch.float32)
    return (x.float() @ w.T).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# random weights of a type (benchmarks and GPU tests: timing, not accuracy)


def random_quant_weight(qtype: QType, n: int, k: int, device="cuda", seed: int = 0) -> QuantWeight:
    """Random block bytes with every fp16 field set to a small finite scale (for timing, not accuracy)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // block, type_size), generator=g, dtype=torch.uint8, device=device)
    scale = torch.tensor([1 / 64], dtype=torch.float16, device=device).view(torch.uint8)
    for f in KERNELS[qtype].fields:
        if f.dtype == torch.float16:
            blocks[:, f.start:f.stop] = scale
    return QuantWeight.from_gguf_bytes(blocks, qtype, (n, k))
