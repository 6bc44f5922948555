"""The DFlash block-diffusion draft model (z-lab checkpoint format).

A DFlash draft is a small stack of Qwen3 decoder layers without embedding or LM head (both are
borrowed from the target). It is conditioned on the concatenated hidden states of a few target
layers ("context features"): `fc` + `hidden_norm` project them to the hidden size, and every
layer turns them into extra K/V entries with its own k_proj/v_proj/k_norm/RoPE ("KV injection").
The draft input is one block `[bonus, mask x (block_size-1)]`; a single forward gives hidden
states for all block positions at once. Attention is non-causal, except that, like the reference
(dflash 0.1.0), sliding-window layers are causal unless config.json sets `is_causal`.

Batch size is 1 throughout and tensors carry no batch dimension: features are [n, F], block
embeddings [block, D]. Context K/V are cached across calls (`DraftContextCache`) because the
context only ever grows by committed positions; the block's own K/V are never persisted.

The modules' `forward`s are the differentiable torch reference (train/draft.py trains through them).
`forward_block` and `append_context` run the same arithmetic through the project's fused kernels
(one launch per norm, residual add + norm, q/k norm + RoPE, K/V write, SiLU * up; the attention in
`tree_attention`'s launch with q's norm and RoPE at its load, or fused SDPA in the compute dtype), about
80 launches for a 5-layer block pass instead of about 400 small ones; where Triton does not run (the CPU)
those kernels fall back to the same torch arithmetic.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from flashtree.errors import FlashtreeError
from flashtree.formats.quants import quantize_q8_0
from flashtree.kernels import gemm_layout, triton_runs_on
from flashtree.kernels.activations import silu_mul
from flashtree.kernels.qk_norm_rope import norm_rope_into_cache, qk_norm_rope, rope_tables
from flashtree.kernels.quant_matmul import QuantWeight, quant_matmul
from flashtree.kernels.rms_norm import add_rms_norm, rms_norm
from flashtree.kernels.tree_attention import tree_attention

LAYER_TYPES = ("full_attention", "sliding_attention")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default feature layers: evenly spaced from layer 1 to layer N-3 (the middle one if only one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    vocab_size: int
    # The reference makes sliding layers causal unless the config says otherwise; None = that default.
    is_causal: bool | None = None

    def __post_init__(self) -> None:
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "num_target_layers", "vocab_size"):
            _require(_is_int(getattr(self, key)) and getattr(self, key) > 0, key, "a positive integer")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"a divisor of num_attention_heads={self.num_attention_heads}")
        _require(self.head_dim % 2 == 0, "head_dim", "even (RoPE rotates halves)")
        _require(_is_int(self.block_size) and self.block_size >= 2, "block_size", "an integer >= 2")
        _require(_is_int(self.mask_token_id) and 0 <= self.mask_token_id < self.vocab_size, "mask_token_id",
                 f"a token id in [0, {self.vocab_size})")
        _require(_is_finite_positive(self.rms_norm_eps), "rms_norm_eps", "a positive number")
        _require(_is_finite_positive(self.rope_theta), "rope_theta", "a positive number")
        _require(len(self.target_layer_ids) > 0
                 and all(_is_int(i) and 0 <= i < self.num_target_layers for i in self.target_layer_ids),
                 "target_layer_ids", f"a non-empty list of layer ids in [0, {self.num_target_layers})")
        _require(len(self.layer_types) == self.num_hidden_layers and set(self.layer_types) <= set(LAYER_TYPES),
                 "layer_types", f"{self.num_hidden_layers} entries from {LAYER_TYPES}")
        _require(self.sliding_window is None or (_is_int(self.sliding_window) and self.sliding_window > 0),
                 "sliding_window", "null or a positive integer")
        _require(self.is_causal is None or isinstance(self.is_causal, bool), "is_causal", "null or a boolean")

    @property
    def feature_size(self) -> int:
        """Width of one position's context feature: the concatenated target hidden states."""
        return len(self.target_layer_ids) * self.hidden_size

    def layer_is_causal(self, layer: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_json(cls, d: dict) -> DraftConfig:
        """Read a z-lab `config.json` (HF Qwen3 config plus `dflash_config`), defaulting as z-lab does."""
        if "DFlash2DraftModel" in (d.get("architectures") or ()):
            raise FlashtreeError("draft config: DFlash2 drafts (DFlash2DraftModel) are not supported")
        draft = d.get("dflash_config") or {}

        def required(key: str):
            if d.get(key) is None:
                raise FlashtreeError(f"draft config: missing required key {key!r}")
            return d[key]

        def dflash_value(key: str, default=None):
            # z-lab reads dflash_config first, then the top level.
            return draft.get(key, d.get(key, default))

        num_layers = required("num_hidden_layers")
        mask_token_id = dflash_value("mask_token_id")
        if mask_token_id is None:
            raise FlashtreeError("draft config: missing required key 'dflash_config.mask_token_id'")
        target_ids = dflash_value("target_layer_ids")
        if target_ids is None:
            target_ids = build_target_layer_ids(required("num_target_layers"), num_layers)
        # HF Qwen3Config drops the window unless use_sliding_window is set.
        window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
        layer_types = d.get("layer_types") or [
            "sliding_attention" if window is not None and i >= d.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)
        ]
        return cls(
            hidden_size=required("hidden_size"),
            intermediate_size=required("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=required("num_attention_heads"),
            num_key_value_heads=required("num_key_value_heads"),
            head_dim=required("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(d),
            block_size=dflash_value("block_size", 16),
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(target_ids),
            num_target_layers=required("num_target_layers"),
            layer_types=tuple(layer_types),
            sliding_window=window,
            vocab_size=required("vocab_size"),
            is_causal=d.get("is_causal"),
        )

    def to_json(self) -> dict:
        """The z-lab `config.json` form; `from_json(to_json())` round-trips."""
        d = asdict(self)
        d.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_act="silu",
            attention_bias=False,
            layer_types=list(self.layer_types),
            use_sliding_window=self.sliding_window is not None,
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        )
        for key in ("mask_token_id", "target_layer_ids") + (("is_causal",) if self.is_causal is None else ()):
            del d[key]
        return d


def _rope_theta(d: dict) -> float:
    """rope_theta is required: a wrong default silently ruins acceptance (Luce shipped exactly that bug)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise FlashtreeError(f"draft config: rope type {rope_type!r} is not supported (only default RoPE)")
    theta = d.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta")
    if theta is None:
        raise FlashtreeError("draft config: missing required key 'rope_theta'")
    return theta


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _require(ok: bool, key: str, expected: str) -> None:
    if not ok:
        raise FlashtreeError(f"draft config: {key} must be {expected}")


# --------------------------------------------------------------------------------------------
# Building blocks (module names mirror the checkpoint's tensor names)
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, cast back, then scale by the (plain, not 1+w) weight. Inference
    calls `kernels.rms_norm` with the weight instead (one launch; it scales before the one cast back)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class _Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.q_proj = _linear(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = _linear(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.head_dim = c.head_dim

    def write_key_value(self, x: Tensor, rope: tuple[Tensor, Tensor], keys: Tensor, values: Tensor,
                        slots: Tensor) -> None:
        """K (normed, rotated at x's positions) and V of x [n, D] into rows `slots` [n] of keys/values
        [kv_heads, rows, head_dim]: one launch after the two projections."""
        n = x.shape[0]
        norm_rope_into_cache(self.k_proj(x).view(n, -1, self.head_dim), self.v_proj(x).view(n, -1, self.head_dim),
                             self.k_norm.weight, self.k_norm.eps, *rope, keys, values, slots)

    def forward(self, x: Tensor, keys: Tensor, values: Tensor, rope: tuple[Tensor, Tensor], slots: Tensor,
                mask: Tensor | BlockRows | None) -> Tensor:
        """The block x [n, D] attends to keys/values [kv_heads, L, head_dim] after writing its own K/V into
        their rows `slots` (the last n, or with `BlockRows` the n after the valid context), so context and
        block are one run of rows: no concatenation. `mask`: `_additive_mask`'s for SDPA, or None, or the
        `BlockRows` that `tree_attention` reads the rows by."""
        n, kv_heads = x.shape[0], keys.shape[0]
        self.write_key_value(x, rope, keys, values, slots)
        if isinstance(mask, BlockRows):  # one launch, q's norm and RoPE at its load
            q = self.q_proj(x).view(n, -1, self.head_dim).transpose(0, 1)
            out = tree_attention(q, keys, values, keys.dtype, values.dtype, mask.start, mask.visible, mask.positions,
                                 keys.shape[1], self.head_dim**-0.5,
                                 q_norm=(self.q_norm.weight, self.q_norm.eps, *rope))
            return self.o_proj(out.transpose(0, 1).reshape(n, -1))
        q = qk_norm_rope(self.q_proj(x).view(n, -1, self.head_dim), self.q_norm.weight, self.q_norm.eps, *rope)
        out = F.scaled_dot_product_attention(_fold_groups(q, kv_heads), keys[None], values[None], attn_mask=mask,
                                             scale=self.head_dim**-0.5)
        return self.o_proj(_unfold_groups(out, n))


@dataclass(frozen=True)
class BlockRows:
    """How `tree_attention` reads a block pass's rows: the valid context [0, start) (a device int64 [1]),
    seen by every query, then the block's own rows at start.. with `visible` [n, n] (all, or causal)."""
    start: Tensor
    visible: Tensor
    positions: Tensor  # [n] the block's positions (the kernel's window rule; no window here)


class _Q8Linear(nn.Module):
    """A bias-free nn.Linear whose weight is kept as Q8_0 blocks (kernels/quant_matmul)."""

    def __init__(self, weight: Tensor):
        super().__init__()
        raw = quantize_q8_0(weight.detach())
        self.quant = QuantWeight.from_gguf_bytes(raw, GGMLQuantizationType.Q8_0, tuple(weight.shape))
        self.register_buffer("packed", self.quant.raw, persistent=False)  # counted and moved with the module

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return quant_matmul(rows, self.quant).reshape(*x.shape[:-1], self.quant.shape[0])


class _MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused(self, x: Tensor) -> Tensor:
        """`forward` with SiLU(gate) * up in one launch (no autograd: inference only)."""
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class _Layer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, h: Tensor, delta: Tensor | None, keys: Tensor, values: Tensor, rope: tuple[Tensor, Tensor],
                slots: Tensor, mask: Tensor | BlockRows | None) -> tuple[Tensor, Tensor]:
        """(h, delta) -> (h', delta'): the residual stream arrives with the previous layer's MLP output not
        yet added (`delta`; None for the first layer), so that each add runs in the launch of the norm
        after it (as in qwen35). The layer's output is h' + delta'."""
        norm = self.input_layernorm
        if delta is None:
            x = rms_norm(h, norm.weight, norm.eps)
        else:
            h, x = add_rms_norm(h, delta, norm.weight, norm.eps)
        attended = self.self_attn(x, keys, values, rope, slots, mask)
        h, x = add_rms_norm(h, attended, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return h, self.mlp.fused(x)


def _fold_groups(q: Tensor, kv_heads: int) -> Tensor:
    """[n, heads, head_dim] queries -> [1, kv_heads, group * n, head_dim], group-major: the query heads
    sharing one KV head (repeat_interleave grouping) become more queries of that head. SDPA's fused
    kernels take neither 3-D inputs nor grouped K/V with a mask; folded, they read K/V as they are."""
    n, heads, dim = q.shape
    return q.view(n, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, dim)


def _unfold_groups(out: Tensor, n: int) -> Tensor:
    """SDPA's output for `_fold_groups`' queries, [1, kv_heads, group * n, head_dim], back to token-major
    [n, heads * head_dim]: one copy, whatever strides the chosen SDPA backend gave it."""
    return out[0].unflatten(1, (-1, n)).permute(2, 0, 1, 3).reshape(n, -1)


def _hidden_keys(dist: Tensor | None, causal: bool, window: int | None) -> Tensor | None:
    """Which keys each query must not see, from `dist` = query position - key position (None = it sees all).

    Same rule as the reference's index-based mask (its cache keeps positions contiguous): causal
    hides keys after the query; a window hides keys `window` or more away, on both sides when the
    layer is not causal."""
    hidden = dist < 0 if causal else None
    if window is not None:
        far = dist >= window if causal else dist.abs() >= window
        hidden = far if hidden is None else hidden | far
    return hidden


def _additive_mask(hidden: Tensor | None, unfilled: Tensor | None, queries: int, keys: int, dtype: torch.dtype,
                   device: torch.device) -> Tensor | None:
    """SDPA's mask [queries, keys] in the compute dtype: -inf at `hidden` keys and at the `unfilled` context
    slots (a bool over the first keys), else 0; None when nothing is masked. Additive, so SDPA does not
    convert a boolean mask again in every layer; its rows 16-aligned, so the fused kernels take it uncopied."""
    if hidden is None and unfilled is None:
        return None
    mask = torch.zeros(queries, -(-keys // 16) * 16, dtype=dtype, device=device)[:, :keys]
    if hidden is not None:
        mask.masked_fill_(hidden, float("-inf"))
    if unfilled is not None:
        mask[:, : unfilled.shape[0]].masked_fill_(unfilled, float("-inf"))
    return mask


# --------------------------------------------------------------------------------------------
# Context cache
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class DraftContextCache:
    """Per-layer K/V of committed context positions, in a ring of `max_context` slots, in the draft's
    compute dtype (attention reads them as they are).

    Slot order does not matter to attention (RoPE is applied before caching and masks use the
    stored positions), so eviction is an overwrite, never a shift. K/V hold `block_size` rows past the
    ring: a block pass writes its own K/V right after the context rows it reads (slots that are not
    valid yet, or these spare rows once the ring is full), so it attends to one run of rows."""

    keys: Tensor       # [layers, kv_heads, max_context + block_size, head_dim]
    values: Tensor     # [layers, kv_heads, max_context + block_size, head_dim]
    positions: Tensor  # [max_context] int64, absolute position held by each slot
    count: int = 0     # positions appended since the last reset

    @property
    def max_context(self) -> int:
        return self.positions.shape[0]

    @property
    def length(self) -> int:
        """Number of valid slots; slots fill from 0, so they are always the first `length`."""
        return min(self.count, self.max_context)

    @property
    def block_rows(self) -> int:
        """Rows past the ring: the longest block a pass can write after a full ring."""
        return self.keys.shape[2] - self.max_context

    def reset(self) -> None:
        self.count = 0


# --------------------------------------------------------------------------------------------
# The draft model
# --------------------------------------------------------------------------------------------


class DFlashDraft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        c = self.config = config
        self.fc = _linear(c.feature_size, c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    # ---- loading / saving ----

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
             layer_type: str | None = None) -> DFlashDraft:
        """Load a z-lab draft directory: config.json + model.safetensors (names without `model.`). With
        `layer_type` ("q8_0") the decoder layers' matrices are quantized (`quantize_layers`) on `device`
        one at a time from host copies, so the device never holds the dense layers."""
        path = Path(path)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (path / name).is_file():
                raise FlashtreeError(f"draft model: {path / name} not found")
        try:
            config = DraftConfig.from_json(json.loads((path / CONFIG_FILE).read_text()))
        except json.JSONDecodeError as e:
            raise FlashtreeError(f"draft model: {path / CONFIG_FILE} is not valid JSON ({e})") from e
        with torch.device("meta"):
            model = cls(config)
        tensors = load_file(path / WEIGHTS_FILE, device="cpu" if layer_type is not None else str(device))
        model._check_tensors(tensors)
        model.load_state_dict({k: t.to(dtype) for k, t in tensors.items()}, assign=True)
        if layer_type is not None:
            model.quantize_layers(layer_type, device).to(device)  # then fc and the norms follow
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = gemm_layout(module.weight.data)
        return model.eval()

    def _check_tensors(self, tensors: dict[str, Tensor]) -> None:
        expected = {name: tuple(p.shape) for name, p in self.named_parameters()}
        for name, shape in expected.items():
            if name not in tensors:
                raise FlashtreeError(f"draft model: tensor {name!r} missing from {WEIGHTS_FILE}")
            if tuple(tensors[name].shape) != shape:
                raise FlashtreeError(f"draft model: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                     f"expected {shape} from config.json")
        unexpected = sorted(set(tensors) - set(expected))
        if unexpected:
            raise FlashtreeError(f"draft model: unexpected tensors in {WEIGHTS_FILE}: {unexpected[:5]}")

    def save(self, path: str | Path) -> None:
        """Write config.json + model.safetensors in the layout `load` reads."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.config.to_json(), indent=2))
        save_file({k: t.detach().contiguous().cpu() for k, t in self.state_dict().items()}, path / WEIGHTS_FILE)

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        """Refuse a target this draft was not built for (its embedding, LM head and features are borrowed)."""
        c = self.config
        if hidden_size != c.hidden_size:
            raise FlashtreeError(f"draft hidden_size {c.hidden_size} does not match the target's {hidden_size}")
        if vocab_size != c.vocab_size:
            raise FlashtreeError(f"draft vocab_size {c.vocab_size} does not match the target's {vocab_size}")
        bad = [i for i in c.target_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise FlashtreeError(f"draft target_layer_ids {bad} are outside the target's {num_layers} layers")

    def quantize_layers(self, qtype: str = "q8_0", device: str | torch.device | None = None) -> "DFlashDraft":
        """Keep every matrix of the decoder layers in `qtype` (Q8_0 only): a 27B draft's layers read half
        the bytes of bf16 per step and take 1.83 GiB instead of 3.22. Each matrix is quantized on `device`
        (default: where it is) and replaces its dense module at once, so at most one dense matrix is there
        beside the blocks. `fc` and the norms stay in their dtype where they are. In place; returns self."""
        if qtype != "q8_0":
            raise FlashtreeError(f"draft quantization supports q8_0 only, got {qtype!r}")
        for layer in self.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        weight = child.weight if device is None else child.weight.to(device)
                        setattr(parent, name, _Q8Linear(weight))
        return self

    # ---- forward ----

    @property
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """float32 cos/sin [n, head_dim] (positions reach 1e5+); the kernels rotate in float32 too."""
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta)

    def project_context(self, target_features: Tensor) -> Tensor:
        """[n, len(target_layer_ids)*D] target features -> [n, D] context vectors."""
        if target_features.dim() != 2 or target_features.shape[1] != self.config.feature_size:
            raise FlashtreeError(f"draft context features must be [n, {self.config.feature_size}], "
                                 f"got {list(target_features.shape)}")
        return rms_norm(self.fc(target_features.to(self._dtype)), self.hidden_norm.weight, self.hidden_norm.eps)

    def new_cache(self, max_context: int, device=None) -> DraftContextCache:
        if max_context < 1:
            raise FlashtreeError(f"draft max_context must be >= 1, got {max_context}")
        c = self.config
        device = self.fc.weight.device if device is None else device
        shape = (c.num_hidden_layers, c.num_key_value_heads, max_context + c.block_size, c.head_dim)
        return DraftContextCache(
            keys=torch.zeros(shape, device=device, dtype=self._dtype),
            values=torch.zeros(shape, device=device, dtype=self._dtype),
            positions=torch.zeros(max_context, device=device, dtype=torch.long),
        )

    @torch.no_grad()
    def append_context(self, cache: DraftContextCache, target_features: Tensor, positions: Tensor,
                       count: Tensor | None = None, offsets: Tensor | None = None) -> None:
        """Add newly committed positions ([n, F] features at absolute `positions`) to the cache.

        Only the newest `max_context` positions survive, so older rows of a long chunk are skipped
        before the (expensive) fc projection rather than computed and then evicted. A graph-ready call
        gives the appended count so far as a device `count` (int64 [1]) and advances `cache.count` itself;
        one of a fixed length for any number of live rows also gives each row's slot `offsets` from `count`
        (padding rows repeat row 0: its features, position and offset 0, so they write what it writes)."""
        n = target_features.shape[0]
        if positions.shape != (n,) or (offsets is not None and (offsets.shape != (n,) or n > cache.max_context)):
            raise FlashtreeError(f"draft context positions (and offsets) must be [{n}], n <= {cache.max_context} "
                                 f"with offsets; got {list(positions.shape)}")
        keep = min(n, cache.max_context)
        target_features, positions = target_features[n - keep:], positions[n - keep:].to(cache.positions.device)
        start = (cache.count if count is None else count) + (n - keep)
        if offsets is None:
            offsets = torch.arange(keep, device=cache.positions.device)
        slots = (start + offsets) % cache.max_context
        ctx = self.project_context(target_features)
        rope = self._rope(positions)
        for i, layer in enumerate(self.layers):
            layer.self_attn.write_key_value(ctx, rope, cache.keys[i], cache.values[i], slots)
        cache.positions.index_copy_(0, slots, positions)
        if count is None:
            cache.count += n

    @torch.no_grad()
    def forward_block(self, cache: DraftContextCache, block_embeddings: Tensor, start_position: int | Tensor,
                      rows: int | None = None, context_length: Tensor | None = None) -> Tensor:
        """[block, D] embeddings of [bonus, mask...] at positions start.. -> final-normed hidden [block, D].

        Block queries attend to every cached context position and to the whole block, restricted
        per layer by `layer_is_causal` / `layer_window` (see `_hidden_keys`). A graph-ready call
        (engine/cuda_graphs.py) gives `start_position` as a device tensor, reads a fixed number of
        context slots `rows` (at least the valid ones) and masks those at or past `context_length`
        (a device int64 [1]). The block's K/V go to the cache rows after those read (`DraftContextCache`), or,
        where the attention reads the rows in its kernel (`BlockRows`), right after the valid context."""
        c = self.config
        shape = block_embeddings.shape
        if block_embeddings.dim() != 2 or shape[1] != c.hidden_size or shape[0] > cache.block_rows:
            raise FlashtreeError(f"draft block embeddings must be [block <= {cache.block_rows}, {c.hidden_size}], "
                                 f"got {list(shape)}")
        n, ctx_len = shape[0], cache.length if rows is None else rows
        if not cache.length <= ctx_len <= cache.max_context:
            raise FlashtreeError(f"draft block pass: rows {ctx_len} must cover the {cache.length} valid context "
                                 f"slots within the {cache.max_context} of the ring")
        device = cache.positions.device
        q_pos = start_position + torch.arange(n, device=device)
        rope = self._rope(q_pos)
        if self._reads_rows_in_kernel(device):  # the block right after the valid context
            start = context_length if context_length is not None else torch.tensor([ctx_len], device=device)
            slots = start + torch.arange(n, device=device)
            ones = torch.ones(n, n, dtype=torch.bool, device=device)  # made in the call: a graph fills its own
            rules = {causal: BlockRows(start, ones.tril() if causal else ones, q_pos)
                     for causal in {c.layer_is_causal(i) for i in range(c.num_hidden_layers)}}
            masks = [rules[c.layer_is_causal(i)] for i in range(c.num_hidden_layers)]
        else:  # after all ctx_len rows read, the unfilled ones masked
            slots = torch.arange(ctx_len, ctx_len + n, device=device)
            masks = self._masks(q_pos, cache.positions[:ctx_len], context_length)
        h, delta = block_embeddings.to(self._dtype), None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, cache.keys[i, :, : ctx_len + n], cache.values[i, :, : ctx_len + n], rope, slots,
                             masks[i])
        return add_rms_norm(h, delta, self.norm.weight, self.norm.eps)[1]

    def _reads_rows_in_kernel(self, device: torch.device) -> bool:
        """Whether the block pass attends through `tree_attention` (`BlockRows`): where Triton runs and no
        layer has a window (the kernel's window counts committed rows as positions, and a ring's slots are
        not positions)."""
        c = self.config
        return triton_runs_on(device) and all(c.layer_window(i) is None for i in range(c.num_hidden_layers))

    def _masks(self, q_pos: Tensor, ctx_pos: Tensor, context_length: Tensor | None) -> list[Tensor | None]:
        """Each layer's `_additive_mask` over [context slots ; block] for the folded queries (`_fold_groups`),
        made once per distinct (causal, window) rule; `context_length` masks the slots at or past it."""
        c = self.config
        n, ctx_len, device = q_pos.shape[0], ctx_pos.shape[0], q_pos.device
        group = c.num_attention_heads // c.num_key_value_heads
        rules = [(c.layer_is_causal(i), c.layer_window(i)) for i in range(c.num_hidden_layers)]
        dist = None
        if any(causal or window is not None for causal, window in rules):
            dist = q_pos.repeat(group)[:, None] - torch.cat([ctx_pos, q_pos])[None, :]
        unfilled = None if context_length is None else torch.arange(ctx_len, device=device) >= context_length
        masks = {rule: _additive_mask(_hidden_keys(dist, *rule), unfilled, group * n, ctx_len + n, self._dtype, device)
                 for rule in dict.fromkeys(rules)}
        return [masks[rule] for rule in rules]
