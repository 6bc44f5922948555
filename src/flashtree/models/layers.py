"""Building blocks shared by the target and the draft: weights from GGUF, norms, linears, RoPE."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from flashtree.errors import FlashtreeError
from flashtree.formats.gguf_file import GGUFFile
from flashtree.formats.quants import dequantize
from flashtree.kernels import gemm_layout, indexed, triton_runs_on
from flashtree.kernels.host_rows import gather_rows, gpu_reads_host, pinned
from flashtree.kernels.quant_matmul import KERNELS as QUANT_KERNELS
from flashtree.kernels.quant_matmul import (QuantWeight, f16_rows_matmul, glu_parts, glu_weight, quant_matmul,
                                            quant_matmul_glu, quant_matmul_rounded, round_rows_f16)
from flashtree.kernels.quant_matmul import x_f16_type as quant_x_f16_type


def activation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a model's activations between kernels (embedding rows, residual stream, norm and matmul
    outputs, the DeltaNet conv path and state): float32 in a bf16/f16 model, whose `dtype` then only stores
    the KV cache and feeds attention (issue #19, docs/FIDELITY.md design D: each bf16 rounding of an
    activation added 1-5 % to the logits); else `dtype` itself."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def rounds_inputs(dtype: torch.dtype) -> bool:
    """Whether a model of `dtype` has float32 activations that each matmul rounds at its input to the 16-bit
    type its kernel multiplies in (design D: `quant_matmul_rounded`), writing float32."""
    return activation_dtype(dtype) != dtype


def dense_weight_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The dtype of a weight dequantized at load in a model of `dtype`. A bf16/f16 model never rounds a
    weight below float16: float32 on the CPU (exact), float16 on the GPU (the size of bf16, 8x finer)."""
    if not rounds_inputs(dtype):
        return dtype
    return torch.float32 if torch.device(device).type == "cpu" else torch.float16


def load_weight(gguf: GGUFFile, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Dequantize one tensor onto `device`, refusing a shape that differs from what the config implies."""
    info = gguf.tensor(name)
    if tuple(info.shape) != tuple(shape):
        raise FlashtreeError(f"{gguf.path}: tensor {name} has shape {tuple(info.shape)}, expected {tuple(shape)}")
    raw = gguf.raw(name).to(device)
    return dequantize(raw, info.qtype, info.shape, dtype=dtype)


class Linear:
    """y = x W^T with W dequantized at load (the CPU path, and types without a GPU kernel). With
    `rounded_input` (a bf16/f16 model) x is rounded to float16 (scaled by a power of two per row) and y is
    float32 (`rounds_inputs`)."""

    def __init__(self, weight: torch.Tensor, rounded_input: bool = False):
        self.weight = gemm_layout(weight)
        self.rounded_input = rounded_input

    @classmethod
    def load(cls, gguf: GGUFFile, name: str, out_features: int, in_features: int, dtype, device):
        """A QuantLinear where the weight's type has a GPU kernel and the device is CUDA, else a Linear."""
        info = gguf.tensor(name)
        if keeps_quantized(info.qtype, torch.device(device)):
            if tuple(info.shape) != (out_features, in_features):
                raise FlashtreeError(f"{gguf.path}: tensor {name} has shape {tuple(info.shape)}, "
                                     f"expected {(out_features, in_features)}")
            return QuantLinear(QuantWeight.from_gguf_bytes(gguf.raw(name).to(device), info.qtype, info.shape),
                               rounds_inputs(dtype))
        return cls(load_weight(gguf, name, (out_features, in_features), dense_weight_dtype(dtype, device), device),
                   rounds_inputs(dtype))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        """Bytes one call reads from the weight."""
        return self.weight.numel() * self.weight.element_size()

    def to(self, device) -> "Linear":
        """Moves the weight and returns self (subclasses keep their behaviour, e.g. tensor parallel's)."""
        self.weight = gemm_layout(self.weight.to(device))
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rounded_input:
            return F.linear(x, self.weight)
        if self.weight.dtype == torch.float32:  # the CPU: exact weights, float32 products of the rounded x
            y = F.linear(round_rows_f16(x), self.weight)
        else:  # float16 weights (the GPU): a float16 GEMM, its output unscaled in float32
            y = f16_rows_matmul(x, self.weight)
        return y.to(x.dtype)  # float32 activations, or a long prefill chunk's (`Qwen35Model.forward_dtype`)


def keeps_quantized(qtype: GGMLQuantizationType, device: torch.device) -> bool:
    """GPU weights stay in their file encoding when a quantized matmul kernel exists for the type
    (FLASHTREE_DENSE_WEIGHTS=1 dequantizes them at load instead, e.g. to compare with cuBLAS)."""
    return qtype in QUANT_KERNELS and triton_runs_on(device) and os.environ.get("FLASHTREE_DENSE_WEIGHTS") != "1"


class QuantLinear:
    """y = x W^T with W kept as GGUF blocks on the GPU (kernels/quant_matmul): a 27B Q4_K_M model reads
    ~16 GB per token instead of the ~54 GB of its bf16 expansion."""

    def __init__(self, weight: QuantWeight, rounded_input: bool = False):
        self.quant = weight
        self.rounded_input = rounded_input  # a bf16/f16 model: float32 x, float32 y (`quant_matmul_rounded`)

    @property
    def device(self) -> torch.device:
        return self.quant.device

    @property
    def nbytes(self) -> int:
        return self.quant.nbytes

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix (a copy: for code that needs dense rows, e.g. tensor-parallel sharding)."""
        return self.quant.dequantize(torch.bfloat16)

    def to(self, device) -> "QuantLinear":
        self.quant = self.quant.to(device)
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        # float32 activations; a long prefill chunk's x in the model's dtype (`Qwen35Model.forward_dtype`) goes
        # the way it goes in a model of float activations
        rounded = self.rounded_input and rows.dtype == torch.float32
        y = quant_matmul_rounded(rows, self.quant) if rounded else quant_matmul(rows, self.quant)
        return y.reshape(*x.shape[:-1], self.quant.shape[0])


def out_features(linear: Linear | QuantLinear) -> int:
    return linear.quant.shape[0] if isinstance(linear, QuantLinear) else linear.weight.shape[0]


def _joinable(a: Linear | QuantLinear, b: Linear | QuantLinear) -> bool:
    """Whether two projections of one input can share one matrix: same class (not a tensor-parallel
    subclass), device, and encoding (GGUF type, or dtype) and K."""
    if type(a) is not type(b) or a.device != b.device or a.rounded_input != b.rounded_input:
        return False
    if type(a) is QuantLinear:
        return a.quant.qtype == b.quant.qtype and a.quant.shape[1] == b.quant.shape[1]
    return type(a) is Linear and a.weight.dtype == b.weight.dtype and a.weight.shape[1] == b.weight.shape[1]


def _concatenated(linears: list[Linear | QuantLinear]) -> Linear | QuantLinear:
    """One matrix holding `linears`' rows in order (GGUF bytes unchanged, only appended)."""
    if len(linears) == 1:
        return linears[0]
    if isinstance(linears[0], QuantLinear):
        q = linears[0].quant
        rows = torch.cat([linear.quant.gguf_bytes().reshape(-1) for linear in linears])
        n = sum(linear.quant.shape[0] for linear in linears)
        return QuantLinear(QuantWeight.from_gguf_bytes(rows, q.qtype, (n, q.shape[1])), linears[0].rounded_input)
    return Linear(torch.cat([linear.weight for linear in linears]), linears[0].rounded_input)


class GluLinear(QuantLinear):
    """The MLP's gate and up projections as one matmul whose result is SiLU(gate) * up (`quant_matmul_glu`): their
    rows interleaved in one tensor-core weight (`glu_weight`), whose kernels apply the product in their epilogue, so
    a decode or verify step has no `silu_mul` launch nor a [T, 2F] intermediate."""

    @classmethod
    def of(cls, gate: Linear | QuantLinear, up: Linear | QuantLinear) -> GluLinear | None:
        """The two as one, where they share a matrix (`_joinable`) in the tensor-core layout (the only kernels
        with the epilogue); else None, and with FLASHTREE_GLU=0 (the separate `silu_mul`, for A/B timings)."""
        if not (_joinable(gate, up) and type(gate) is QuantLinear and gate.quant.mma_layout):
            return None
        if os.environ.get("FLASHTREE_GLU", "1") == "0":
            return None
        return cls(glu_weight(gate.quant, up.quant), gate.rounded_input)

    def parts(self) -> tuple[QuantLinear, QuantLinear]:
        """The gate and up projections, their GGUF bytes as loaded."""
        return tuple(QuantLinear(w, self.rounded_input) for w in glu_parts(self.quant))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = quant_matmul_glu(rows, self.quant, self.rounded_input and rows.dtype == torch.float32)
        return y.reshape(*x.shape[:-1], self.quant.shape[0] // 2)


def quant_weights(root) -> list[QuantWeight]:
    """Every QuantWeight reachable from `root` (a model: its layers, projections, head), each once."""
    return reachable(root, QuantWeight)


def reachable(root, kind) -> list:
    """Every object of `kind` (a class or a tuple of them) reachable from `root` through lists, tuples, sets,
    dicts and flashtree objects' attributes, each once (not looked into further)."""
    found, seen, stack = [], set(), [root]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (torch.Tensor, str, int, float, bool, type(None))):
            continue
        seen.add(id(item))
        if isinstance(item, kind):
            found.append(item)
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and type(item).__module__.startswith("flashtree."):
            stack.extend(vars(item).values())
    return found


class Projections:
    """Projections of one input (DeltaNet's qkv/z/beta/alpha, attention's q/k/v, the MLP's gate/up),
    returned as a list in the order given. Loaded one matrix each; `fused()` appends neighbours that can
    share a matrix (`_joinable`) into one, so that each group is one matmul (one launch, and one read of
    x) whose output is split back into views."""

    def __init__(self, groups: list[tuple[Linear | QuantLinear, list[int]]]):
        self.groups = groups  # (matrix, output sizes of the projections it holds)

    @classmethod
    def separate(cls, linears: list[Linear | QuantLinear]) -> "Projections":
        return cls([(linear, [out_features(linear)]) for linear in linears])

    @property
    def linears(self) -> list[Linear | QuantLinear]:
        """The separate projections (before `fused`), e.g. for tensor-parallel sharding."""
        if any(len(sizes) > 1 for _, sizes in self.groups):
            raise FlashtreeError("these projections are fused into one matrix; shard or inspect them before fusing")
        return [linear for linear, _ in self.groups]

    def fused(self) -> "Projections":
        runs: list[list[Linear | QuantLinear]] = []
        for linear, _ in self.groups:
            if runs and _joinable(runs[-1][-1], linear):
                runs[-1].append(linear)
            else:
                runs.append([linear])
        return Projections([(_concatenated(run), [out_features(linear) for linear in run]) for run in runs])

    @property
    def nbytes(self) -> int:
        return sum(linear.nbytes for linear, _ in self.groups)

    def to(self, device) -> "Projections":
        self.groups = [(linear.to(device), sizes) for linear, sizes in self.groups]
        return self

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        outputs = []
        for linear, sizes in self.groups:
            y = linear(x)
            outputs.extend(y.split(sizes, dim=-1) if len(sizes) > 1 else (y,))
        return outputs


def x_f16_type(matmul, m: int) -> GGMLQuantizationType | None:
    """The type whose float16 x a call of `matmul` (a QuantLinear, or Projections: its first matrix) on M float32
    rows converts x to (`quant_matmul.x_f16_type`), so that the norm before it writes that x in its own launch; None
    for any other matmul."""
    if isinstance(matmul, Projections):
        return x_f16_type(matmul.groups[0][0], m)
    if isinstance(matmul, QuantLinear) and matmul.rounded_input:
        return quant_x_f16_type(matmul.quant, m)
    return None


# what a layer's matmul attributes can be (subclasses included: GluLinear, the tensor-parallel shards): what moves
# with it between devices, and what a step reads
MATMUL_TYPES = (Linear, QuantLinear, Projections)


class QuantizedEmbedding:
    """Token embedding kept in its file encoding; only the looked-up rows are dequantized.

    A 27B embedding is ~0.7 GB in Q4_K and 2.5 GB in bf16, so keeping it quantized matters. For a GPU model it
    stays in the host's pinned memory (`on_host`), where the GPU reads the few rows a step needs in place
    (`host_rows.gather_rows`): 0.67 GiB of a 24 GiB card's memory left to the KV cache (issue #20).
    """

    def __init__(self, raw_rows: torch.Tensor, qtype: GGMLQuantizationType, dim: int, dtype: torch.dtype):
        self.raw_rows = raw_rows  # uint8 [vocab, bytes_per_row]
        self.qtype = qtype
        self.dim = dim
        self.dtype = dtype

    @property
    def on_host(self) -> bool:
        return self.raw_rows.is_pinned()

    @classmethod
    def load(cls, gguf: GGUFFile, name: str, vocab: int, dim: int, dtype, device,
             on_host: bool = True) -> "QuantizedEmbedding":
        """`on_host`: for a CUDA `device`, keep the rows in pinned host memory where that GPU reads it in place
        (`gpu_reads_host`); else on `device`."""
        info = gguf.tensor(name)
        if tuple(info.shape) != (vocab, dim):
            raise FlashtreeError(f"{gguf.path}: tensor {name} has shape {tuple(info.shape)}, expected {(vocab, dim)}")
        raw = gguf.raw(name).view(vocab, -1)
        device = torch.device(device)
        host = on_host and device.type == "cuda" and gpu_reads_host(indexed(device))
        return cls(pinned(raw) if host else raw.to(device), info.qtype, dim, dtype)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = gather_rows(self.raw_rows, tokens.reshape(-1))
        out = dequantize(rows.reshape(-1), self.qtype, (rows.shape[0], self.dim), dtype=self.dtype)
        return out.reshape(*tokens.shape, self.dim)
