"""Memory planner: what a target (+ DFlash draft) at a given context, KV types and tree budget needs on
the device, computed from shapes alone (GGUF metadata and tensor table, draft config.json) -- no
weights are loaded.

Every line is bytes the engine allocates or a stated estimate:

* target weights: the GGUF tensors as stored (quantized): what CUDA keeps resident (`QuantLinear`), a
  tied LM head (no output.weight) counted twice, as the loader holds the embedding and the head apart;
  the CPU path, and types without a GPU kernel, dequantize at load (`dequantized_weights`).
* draft weights: parameter count x the compute dtype (the loader casts the draft to it); with
  `--draft-type q8_0` the decoder layers' matrices as Q8_0 blocks instead (`DFlashDraft.quantize_layers`).
* KV cache: attention layers x kv_heads x rows x (K row bytes + V row bytes), rows = ctx + budget + 2
  (the engine's context size: committed tokens plus tree scratch rows).
* DeltaNet state: per recurrent layer the float32 [v_heads, d, d] state + the conv tail.
* tree buffers: what a verify keeps per DeltaNet layer for the commit (the conv inputs, u, Gamma and k of each
  node): FOLD_ROWS nodes a layer kept by the cache (`FoldBuffers`), and a larger tree's own (TreeScratch).
* draft context ring: the draft's per-layer K/V of the last `draft_window` committed positions.
* prefill feature capture: the captured target features of one prefill chunk (each chunk's features
  go straight into the draft's context ring, so they do not grow with the prompt).
* activations (estimate): the largest forward (a prefill chunk or a verify) -- hidden, MLP and
  projection intermediates, logits, and one layer's K/V dequantized to the compute dtype (quantized
  types): all its rows, or, past `PREFILL_DEQUANT_BYTES`, the piece of the prefix a prefill chunk attends to
  at a time plus the float32 output the pieces are merged into (models/attention.py). Attention scores are
  assumed not materialized (fused / flash kernel).
* CUDA context + libraries: what the process holds on each GPU outside PyTorch's allocator (the CUDA
  context, cuBLAS workspaces, Triton and NVRTC modules), `PlanRequest.cuda_overhead`: the plan's total
  is the whole process's footprint, what a card's memory must hold.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from gguf import GGMLQuantizationType

from flashtree.engine.config import (DEFAULT_BUDGET, DEFAULT_CUDA_OVERHEAD, DEFAULT_DRAFT_TYPE, DEFAULT_DRAFT_WINDOW,
                                     DEFAULT_PREFILL_CHUNK, DENSE_DRAFT, cache_rows, check_draft_type)
from flashtree.errors import FlashtreeError
from flashtree.formats.gguf_file import GGUFFile
from flashtree.formats.quant_mix import quant_types
from flashtree.formats.quants import bytes_for
from flashtree.kernels.gated_delta_triton import FOLD_ROWS
from flashtree.kernels.kv_quant import kv_type
from flashtree.kernels.quant_matmul import DENSE_BLOCK_BYTES, DENSE_MIN_M
from flashtree.kernels.tree_attention import MAX_TREE_QUERIES
from flashtree.models.attention import PREFILL_DEQUANT_BYTES
from flashtree.models.dflash import DFlashDraft, DraftConfig
from flashtree.models.gguf_config import read_config
from flashtree.models.layers import activation_dtype
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.synthetic import tensor_shapes


GIB = 1024**3
PREFIX_CACHE_LINE = "prefix cache snapshots"
MIB = 1024**2
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
_TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def activation_bytes(dtype: str) -> int:
    """Bytes of one activation between kernels (residual stream, matmul outputs, the DeltaNet conv path) in a
    model of `dtype`: float32 in a bf16/f16 one (`models.layers.activation_dtype`, docs/FIDELITY.md)."""
    return activation_dtype(_TORCH_DTYPES[dtype]).itemsize
_DRAFT_QTYPES = {"q8_0": GGMLQuantizationType.Q8_0}  # --draft-type -> the blocks its layer matrices take
CUDA_OVERHEAD_LINE = "CUDA context + libraries"  # every GPU holds its own (per_device, per_rank)


@dataclass(frozen=True)
class DraftShape:
    """What the planner needs of a DFlash draft."""

    params: int
    layers: int
    kv_heads: int
    head_dim: int
    feature_size: int  # len(target_layer_ids) * hidden
    layer_matrices: tuple[tuple[int, ...], ...]  # shapes of the decoder layers' matrices (what --draft-type packs)

    @classmethod
    def from_config(cls, config) -> "DraftShape":
        with torch.device("meta"):
            model = DFlashDraft(config)
        params = sum(p.numel() for p in model.parameters())
        matrices = tuple(tuple(p.shape) for p in model.layers.parameters() if p.dim() == 2)
        return cls(params, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.feature_size,
                   matrices)

    def weight_bytes(self, draft_type: str, dtype_bytes: int) -> int:
        """The draft's weights on the device: every parameter in the compute dtype, or the layers' matrices
        as `draft_type` blocks and the rest (`fc`, the norms) in the compute dtype."""
        if draft_type == DENSE_DRAFT:
            return self.params * dtype_bytes
        qtype = _DRAFT_QTYPES[draft_type]
        packed = sum(math.prod(shape) for shape in self.layer_matrices)
        return (self.params - packed) * dtype_bytes + sum(bytes_for(qtype, shape) for shape in self.layer_matrices)

    @classmethod
    def from_dir(cls, path: str | Path) -> "DraftShape":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FlashtreeError(f"draft model: {file} not found")
        try:
            return cls.from_config(DraftConfig.from_json(json.loads(file.read_text())))
        except json.JSONDecodeError as e:
            raise FlashtreeError(f"draft model: {file} is not valid JSON ({e})") from e


@dataclass(frozen=True)
class PlanRequest:
    config: Qwen35Config
    weight_bytes: int  # target tensors as the GPU holds them (stored bytes; a tied LM head counted twice)
    embed_bytes: int  # of which token_embd
    draft: DraftShape | None
    ctx: int
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    budget: int = DEFAULT_BUDGET
    draft_window: int = DEFAULT_DRAFT_WINDOW
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    dtype: str = "bf16"  # compute dtype of activations, draft weights and float state
    dense_params: int = 0  # target parameters outside token_embd (for the dequantized-at-load note)
    layer_bytes: tuple[int, ...] = ()  # stored bytes of each layer's tensors (blk.i.*): a layer split's shares
    cuda_overhead: int = DEFAULT_CUDA_OVERHEAD  # bytes per GPU outside PyTorch's allocator
    prefix_cache_device_bytes: int = 0  # the prefix cache's device budget (snapshots past it go to host RAM)
    draft_type: str = DEFAULT_DRAFT_TYPE  # the draft's layer matrices: dense or q8_0
    # a GPU model keeps token_embd in pinned host memory (models.layers.QuantizedEmbedding): not the GPU's bytes
    embed_on_host: bool = True

    @property
    def device_embed_bytes(self) -> int:
        return 0 if self.embed_on_host else self.embed_bytes

    @property
    def device_weight_bytes(self) -> int:
        """The target's tensors on the GPU (the embedding left out when the host keeps it)."""
        return self.weight_bytes - self.embed_bytes + self.device_embed_bytes

    def __post_init__(self) -> None:
        check_draft_type(self.draft_type)
        counts = {"ctx": (self.ctx, 2), "budget": (self.budget, 1), "draft_window": (self.draft_window, 1),
                  "prefill_chunk": (self.prefill_chunk, 1)}
        for name, (value, low) in counts.items():
            if value < low:
                raise FlashtreeError(f"{name} must be >= {low}, got {value}")
        if self.cuda_overhead < 0:
            raise FlashtreeError(f"cuda_overhead must be >= 0 bytes, got {self.cuda_overhead}")


@dataclass
class MemoryPlan:
    request: PlanRequest
    lines: list[tuple[str, int, str]] = field(default_factory=list)  # (what, bytes, how)

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.lines)

    def bytes_of(self, what: str) -> int:
        return next(b for name, b, _ in self.lines if name == what)

    def dequantized_weights(self) -> int:
        """Target weights with every linear weight dequantized at load (the CPU path)."""
        r = self.request
        return r.dense_params * DTYPE_BYTES[r.dtype] + r.embed_bytes

    def table(self, available: int | None = None) -> str:
        rows = [f"{name:<26} {_gib(b):>10}  {how}" for name, b, how in self.lines]
        rows.append(f"{'total':<26} {_gib(self.total):>10}")
        if available is not None:
            verdict = "fits" if self.total <= available else "DOES NOT FIT"
            rows.append(f"{'available':<26} {_gib(available):>10}  {verdict}, headroom {_gib(available - self.total)}")
        return "\n".join(rows)


def kv_bytes_per_token(config: Qwen35Config, cache_type_k: str, cache_type_v: str) -> int:
    tk, tv = kv_type(cache_type_k), kv_type(cache_type_v)
    tk.check(config.head_dim)
    tv.check(config.head_dim)
    return len(config.attention_layers) * config.num_kv_heads * (tk.row_bytes(config.head_dim) + tv.row_bytes(config.head_dim))


def plan(req: PlanRequest) -> MemoryPlan:
    c = req.config
    if req.ctx < 2:
        raise FlashtreeError(f"ctx must be >= 2 tokens, got {req.ctx}")
    if req.dtype not in DTYPE_BYTES:
        raise FlashtreeError(f"unknown dtype {req.dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    b, a = DTYPE_BYTES[req.dtype], activation_bytes(req.dtype)
    tk, tv = kv_type(req.cache_type_k), kv_type(req.cache_type_v)
    rows = cache_rows(req.ctx, req.budget)
    nodes = req.budget + 1
    n_gdn, n_attn = len(c.deltanet_layers), len(c.attention_layers)
    out = MemoryPlan(req)
    add = out.lines.append

    where = "in pinned host memory, not counted" if req.embed_on_host else "included"
    add(("target weights", req.device_weight_bytes,
         f"GGUF tensors as the GPU holds them (token_embd {_gib(req.embed_bytes)} {where})"))
    if req.draft is not None:
        add(("draft weights", req.draft.weight_bytes(req.draft_type, b), _draft_note(req)))
    per_token = kv_bytes_per_token(c, tk.name, tv.name)
    add(("KV cache", per_token * rows,
         f"K {tk.name} / V {tv.name}: {per_token} B/token x {rows} rows ({n_attn} layers x {c.num_kv_heads} kv heads)"))
    ssm = c.gdn_v_heads * c.gdn_head_dim**2 * 4
    conv = (c.conv_kernel - 1) * c.conv_dim * a
    add(("DeltaNet state", n_gdn * (ssm + conv), f"{n_gdn} layers x (f32 state {_mib(ssm)} + conv {_mib(conv)})"))
    if req.draft is not None:
        # per node: the conv inputs, and u, Gamma and k (per value head, as the tree kernel reads them) in float32;
        # FOLD_ROWS of them kept with the cache (`FoldBuffers`), where a tree of that many nodes leaves its own
        per_node = c.conv_dim * a + c.gdn_v_heads * (2 * c.gdn_head_dim + 1) * 4
        scratch = 0 if nodes <= FOLD_ROWS else nodes * per_node
        how = f"fold buffers of {FOLD_ROWS} nodes" + (f" + verify scratch of {nodes}" if scratch else "")
        add(("tree buffers", n_gdn * (FOLD_ROWS * per_node + scratch), f"{how} x {n_gdn} DeltaNet layers"))
        d = req.draft
        window = min(req.draft_window, req.ctx)
        ring = d.layers * 2 * d.kv_heads * window * d.head_dim * b + window * 8
        add(("draft context ring", ring, f"{d.layers} layers x K+V x {d.kv_heads} heads x {window} positions"))
        chunk = min(req.prefill_chunk, req.ctx)
        add(("prefill feature capture", chunk * d.feature_size * a,
             f"{chunk} tokens (one prefill chunk) x {d.feature_size} features, streamed into the ring"))
    add(("activations (estimate)", sum(_activation_parts(req, rows).values()), _activation_note(req)))
    if req.prefix_cache_device_bytes:
        add((PREFIX_CACHE_LINE, req.prefix_cache_device_bytes,
             "device budget of the prefix cache (least recently used snapshots past it go to host RAM)"))
    add((CUDA_OVERHEAD_LINE, req.cuda_overhead, "outside PyTorch's allocator: CUDA context, cuBLAS workspaces, "
         "Triton/NVRTC modules (--cuda-overhead)"))
    return out


def _activation_parts(req: PlanRequest, rows: int) -> dict[str, int]:
    """forward: hidden, MLP and projection intermediates of the largest forward (`activation_bytes` each, the
    model's dtype in a chunk of DENSE_MIN_M tokens or more: `Qwen35Model.forward_dtype`); logits; dequant: one
    attention layer's K/V in the compute dtype; dense: a block of one FFN weight dequantized for a long chunk."""
    c = req.config
    b = DTYPE_BYTES[req.dtype]
    m = max(min(req.prefill_chunk, req.ctx), req.budget + 1)  # largest forward
    a = b if m >= DENSE_MIN_M else activation_bytes(req.dtype)
    logit_rows = req.budget + 1  # a prefill chunk computes the last token's logits only
    per_token = (6 * c.hidden_size + 3 * c.intermediate_size + 3 * c.num_heads * c.head_dim
                 + 3 * c.conv_dim + c.gdn_value_dim) * a + 4 * c.gdn_value_dim * 3
    per_row = _dequantized_row_bytes(req)
    held, merge = _dequantized_rows(req, rows, per_row), 0
    if held < rows:  # a prefill chunk attends in pieces, merged into float32 [heads, chunk, head_dim] (2 buffers)
        merge = 2 * c.num_heads * min(req.prefill_chunk, req.ctx) * c.head_dim * 4
    dequant = held * per_row + merge
    # prefill chunks of >= DENSE_MIN_M tokens multiply by one dequantized weight at a time (the fused gate/up, the
    # largest), in row blocks of at most DENSE_BLOCK_BYTES
    dense_weight = min(DENSE_BLOCK_BYTES, 2 * c.intermediate_size * c.hidden_size * b) if m >= DENSE_MIN_M else 0
    return {"forward": m * per_token, "logits": logit_rows * c.vocab_size * (4 + b), "dequant": dequant,
            "dense": dense_weight}


def _dequantized_row_bytes(req: PlanRequest) -> int:
    """Bytes of one cache row of one attention layer dequantized to the compute dtype: the K and V sides stored
    in another type (a side in the compute dtype is read as it is)."""
    c = req.config
    return sum(c.num_kv_heads * c.head_dim * DTYPE_BYTES[req.dtype] for t in (req.cache_type_k, req.cache_type_v)
               if kv_type(t).name != req.dtype)


def _dequantized_rows(req: PlanRequest, rows: int, per_row: int) -> int:
    """Cache rows of one attention layer held dequantized at once (`per_row` bytes each): a prefill chunk
    attends to a prefix past PREFILL_DEQUANT_BYTES in pieces of that size (its own rows one piece,
    models/attention.py); a tree of more than MAX_TREE_QUERIES nodes, which CUDA's in-place kernel does not
    take, and a float32 compute dtype, which its flash kernel does not take, dequantize every row."""
    if not per_row or req.budget + 1 > MAX_TREE_QUERIES or req.dtype == "f32":
        return rows
    piece = max(1, PREFILL_DEQUANT_BYTES // per_row)
    return rows if rows <= piece else max(piece, min(req.prefill_chunk, req.ctx))


def _draft_note(req: PlanRequest) -> str:
    d = req.draft
    if req.draft_type == DENSE_DRAFT:
        return f"{d.params / 1e9:.2f} B params x {req.dtype}"
    packed = sum(math.prod(shape) for shape in d.layer_matrices)
    return (f"{packed / 1e9:.2f} B params of the layers' matrices in {req.draft_type}, "
            f"{(d.params - packed) / 1e9:.2f} B x {req.dtype}")


def _activation_note(req: PlanRequest) -> str:
    m = max(min(req.prefill_chunk, req.ctx), req.budget + 1)
    dense = ", the FFN weight dequantized a block at a time" if m >= DENSE_MIN_M else ""
    rows = cache_rows(req.ctx, req.budget)
    held = _dequantized_rows(req, rows, _dequantized_row_bytes(req))
    kv = (f"one layer's K/V dequantized to {req.dtype}" if held == rows
          else f"one layer's K/V dequantized to {req.dtype} {held} rows at a time")
    return f"forward of {m} tokens + verify logits + {kv}{dense}"


def max_ctx(req: PlanRequest, available: int) -> int:
    """Largest context (a multiple of 256) whose plan fits in `available` bytes; 0 if none."""
    lo, hi = 0, max(req.config.context_length, req.ctx) // 256
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(replace(req, ctx=mid * 256)).total <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo * 256


def per_device(result: MemoryPlan, counts: Sequence[int], draft_device: int = 0) -> list[dict[str, int]]:
    """`result`'s lines shared out over the devices of a layer split (`counts`: layers per device, in
    order; the embedding on the first device, the output norm and LM head on the last, as
    `parallel.placement` places them) with the draft, its ring and the prefill capture on device
    `draft_device` (which may be past the split's devices: a draft on a GPU of its own). Every device
    running layers needs its own forward intermediates; the logits are made on the last device and
    copied to the first. Every device holds its own CUDA context and library workspaces."""
    req = result.request
    c = req.config
    if sum(counts) != c.num_layers or any(n < 1 for n in counts):
        raise FlashtreeError(f"layer split {list(counts)} does not cover the {c.num_layers} layers, one or more each")
    if len(req.layer_bytes) != c.num_layers:
        raise FlashtreeError("this plan has no per-layer weight sizes, so it cannot be split over devices")
    stage = [d for d, n in enumerate(counts) for _ in range(n)]
    devices = [dict.fromkeys((name for name, _, _ in result.lines), 0)
               for _ in range(max(len(counts), draft_device + 1))]
    last = len(counts) - 1
    devices[0]["target weights"] = req.device_embed_bytes
    for i, nbytes in enumerate(req.layer_bytes):
        devices[stage[i]]["target weights"] += nbytes
    # output norm and head
    devices[last]["target weights"] += req.weight_bytes - req.embed_bytes - sum(req.layer_bytes)
    for name in ("KV cache", "DeltaNet state", "tree buffers", PREFIX_CACHE_LINE):  # snapshots: DeltaNet states
        if name in devices[0]:
            owners = [stage[i] for i in (c.attention_layers if name == "KV cache" else c.deltanet_layers)]
            for owner in owners:
                devices[owner][name] += result.bytes_of(name) // len(owners)
    for name in ("draft weights", "draft context ring", "prefill feature capture"):
        if name in devices[0]:
            devices[draft_device][name] = result.bytes_of(name)
    for device in devices:
        device[CUDA_OVERHEAD_LINE] = req.cuda_overhead
    parts = _activation_parts(req, cache_rows(req.ctx, req.budget))
    attention_owners = {stage[i] for i in c.attention_layers}
    for d in range(len(counts)):
        devices[d]["activations (estimate)"] = (parts["forward"] + parts["dense"]
                                                + (parts["dequant"] if d in attention_owners else 0)
                                                + (parts["logits"] if d in (0, last) else 0))
    return devices


def per_rank(result: MemoryPlan, world: int) -> dict[str, int]:
    """One rank's share of `result` under tensor parallel over `world` ranks (`parallel.tp`): the layers' and
    the LM head's weights, the KV cache, the DeltaNet state and the tree buffers split; the embedding, the
    draft (a replica per rank), its ring and the prefill capture whole, as is each rank's CUDA context. The
    activations are not split (an upper bound: the logits, the hidden states and the dequantized K/V of a
    chunk stay whole)."""
    req = result.request
    if world < 1 or req.config.num_kv_heads % world:
        raise FlashtreeError(f"tensor parallel {world} needs the {req.config.num_kv_heads} KV heads to divide evenly")
    share = {name: nbytes for name, nbytes, _ in result.lines}
    share["target weights"] = req.device_embed_bytes + (req.weight_bytes - req.embed_bytes) // world
    for name in ("KV cache", "DeltaNet state", "tree buffers"):
        if name in share:
            share[name] //= world
    return share


def refusal(result: MemoryPlan, counts: Sequence[int], draft_device: int, available: Sequence[int],
            names: Sequence[str]) -> str | None:
    """Why `result`, placed as `per_device` places it (`names[i]` the device of share i), does not fit
    `available[i]` bytes on each device; None when it fits."""
    shares = per_device(result, counts, draft_device)
    over = [f"{name} needs {fmt_bytes(sum(share.values()))} of {fmt_bytes(free)} "
            f"(weights {fmt_bytes(share['target weights'])}, KV {fmt_bytes(share['KV cache'])}, "
            f"CUDA context + libraries {fmt_bytes(share[CUDA_OVERHEAD_LINE])})"
            for name, share, free in zip(names, shares, available) if sum(share.values()) > free]
    if not over:
        return None
    r = result.request
    return (f"does not fit: ctx {r.ctx} with K {r.cache_type_k} / V {r.cache_type_v}: {'; '.join(over)}. "
            f"Try a smaller --ctx, -ctk/-ctv q8_0, q4_0 or tq3_0, or --layer-split / --draft-device "
            f"(`flashtree plan` shows the budget line by line)")


# ----------------------------------------------------------------------------------------------
# Shapes from a GGUF (metadata + tensor table only) or from a synthetic preset
# ----------------------------------------------------------------------------------------------


def target_from_gguf(path: str | Path) -> tuple[Qwen35Config, int, int, int, tuple[int, ...]]:
    """(config, bytes of the tensors the trunk uses as the GPU holds them, token_embd bytes, parameters
    outside token_embd, stored bytes per layer), reading no weights. A tied LM head (no output.weight) is
    token_embd loaded a second time, re-laid for the matmul kernels: its bytes count twice."""
    gguf = GGUFFile(path)
    config, _ = read_config(gguf)
    trunk = tuple(f"blk.{i}." for i in range(config.num_layers))
    used = [t for t in gguf.tensors.values() if not t.name.startswith("blk.") or t.name.startswith(trunk)]
    embed_info = gguf.tensors["token_embd.weight"]
    tied = "output.weight" not in gguf.tensors
    dense = sum(math.prod(t.shape) for t in used if t.name != "token_embd.weight")
    weights = sum(t.nbytes for t in used)
    if tied:
        weights, dense = weights + embed_info.nbytes, dense + math.prod(embed_info.shape)
    return config, weights, embed_info.nbytes, dense, _layer_bytes({t.name: t.nbytes for t in used}, config)


def _layer_bytes(sizes: dict[str, int], config: Qwen35Config) -> tuple[int, ...]:
    per_layer = [0] * config.num_layers
    for name, nbytes in sizes.items():
        if name.startswith("blk."):
            per_layer[int(name.split(".")[1])] += nbytes
    return tuple(per_layer)


SYNTHETIC = {
    # Qwen3.5-27B / Qwen3.6-27B text decoder (qwen35-gguf-format.md 1.2) with a Q4_K_M mix, and the
    # z-lab DFlash draft shape (lucebox-dflash-spec.md 2.1).
    "qwen3.6-27b": {
        "target": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=64, num_mtp_layers=0,
                       num_heads=24, num_kv_heads=4, head_dim=256, rope_dim=64, rope_theta=1e7, rms_eps=1e-6,
                       attention_scale=256**-0.5, conv_kernel=4, gdn_head_dim=128, gdn_qk_heads=16,
                       gdn_v_heads=48, context_length=262144, name="qwen3.6-27b (synthetic shape)"),
        "scheme": "q4_k_m",
        "draft": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 5, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e7,
                  "block_size": 16, "vocab_size": 248320, "num_target_layers": 64,
                  "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}},
    },
}


def target_from_preset(name: str) -> tuple[Qwen35Config, int, int, int, DraftShape, tuple[int, ...]]:
    if name not in SYNTHETIC:
        raise FlashtreeError(f"unknown synthetic preset {name!r}; choose one of {', '.join(SYNTHETIC)}")
    preset = SYNTHETIC[name]
    shape = dict(preset["target"])
    shape["recurrent_layers"] = tuple((i + 1) % 4 != 0 for i in range(shape["num_layers"]))
    config = Qwen35Config(**shape)
    shapes = tensor_shapes(config)
    types = quant_types(shapes, preset["scheme"])
    sizes = {n: bytes_for(types[n], s) for n, s in shapes.items()}
    draft = DraftShape.from_config(DraftConfig.from_json(preset["draft"]))
    dense = sum(math.prod(s) for n, s in shapes.items() if n != "token_embd.weight")
    return config, sum(sizes.values()), sizes["token_embd.weight"], dense, draft, _layer_bytes(sizes, config)


# a number, then a prefix with iB (binary), B (decimal) or nothing (binary, as llama.cpp's 24G), or B alone
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(ib|b)?|(b))?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'24GiB', '24G', '23.5GiB', '24000MiB' (powers of 2), '24GB' (powers of 10), '4096B' (bytes), '24'
    (GiB) -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise FlashtreeError(f"cannot read memory size {text!r}; write e.g. 24GiB, 23.5GiB, 24000MiB or 24GB "
                             "(a bare number is GiB)")
    value, prefix, suffix, bytes_only = m.groups()
    if bytes_only:
        return int(float(value))
    power = "kmgt".index((prefix or "g").lower()) + 1
    base = 1000 if (suffix or "").lower() == "b" else 1024
    return int(float(value) * base**power)


def _gib(n: int) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    return f"{sign}{n / GIB:.2f} GiB" if n >= 0.1 * GIB else f"{sign}{n / MIB:.1f} MiB"


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


def fmt_bytes(n: int) -> str:
    return _gib(n)


__all__ = ["DraftShape", "PlanRequest", "MemoryPlan", "plan", "per_device", "per_rank", "refusal", "max_ctx", "kv_bytes_per_token", "target_from_gguf",
           "target_from_preset", "parse_size", "fmt_bytes", "SYNTHETIC", "GIB"]
