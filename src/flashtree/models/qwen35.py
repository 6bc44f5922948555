"""The qwen35 target (Qwen3.5 / Qwen3.6): hybrid Gated DeltaNet + gated attention, loaded from GGUF.

    h = x + Mixer(norm(x)) ; h = h + MLP(norm(h))  for every layer, then output_norm and the LM head.

(Each residual add runs inside the launch of the norm after it, `add_rms_norm`; the projections of one
input are one matmul where their types allow, `Projections.fused`.)

`forward` processes either a run of new tokens after the cache (prefill, decode) or a draft tree
(verify); `commit` then folds the accepted root-to-leaf path of a verified tree into the cache.
"""

from __future__ import annotations

import contextlib
from functools import partial
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from flashtree.models.cache import TargetCache
from flashtree.errors import FlashtreeError
from flashtree.formats.gguf_file import GGUFFile
from flashtree.kernels import indexed, on_device
from flashtree.kernels.activations import silu_mul
from flashtree.kernels.commit_rows import move_rows_together
from flashtree.kernels.quant_matmul import DENSE_MIN_M
from flashtree.kernels.rms_norm import add_rms_norm, rms_norm
from flashtree.models.attention import GatedAttention
from flashtree.models.deltanet import GatedDeltaNet, commit_layers
from flashtree.models.layers import (GluLinear, Linear, Projections, QuantizedEmbedding, activation_dtype,
                                    load_weight, x_f16_type)
from flashtree.models.qwen35_config import Qwen35Config
from flashtree.models.step import Step, padded_offsets
from flashtree.models.weight_pool import WeightPool


class MLP:
    def __init__(self, gate: Linear, up: Linear, down: Linear):
        self.inputs = Projections.separate([gate, up])  # one matmul once `fuse`d
        self.down = down
        self.glu: GluLinear | None = None  # once `fuse`d, where gate and up take the tensor-core GLU epilogue

    def fuse(self) -> None:
        self.glu = GluLinear.of(*self.inputs.linears)
        self.inputs = None if self.glu is not None else self.inputs.fused()

    @classmethod
    def load(cls, gguf: GGUFFile, prefix: str, config: Qwen35Config, dtype, device) -> "MLP":
        d, f = config.hidden_size, config.intermediate_size
        return cls(
            Linear.load(gguf, f"{prefix}.ffn_gate.weight", f, d, dtype, device),
            Linear.load(gguf, f"{prefix}.ffn_up.weight", f, d, dtype, device),
            Linear.load(gguf, f"{prefix}.ffn_down.weight", d, f, dtype, device),
        )

    @property
    def input_matmul(self) -> GluLinear | Projections:
        """The matmul that reads the MLP's input."""
        return self.glu or self.inputs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.glu is not None:
            return self.down(self.glu(x))
        gate, up = self.inputs(x)
        return self.down(silu_mul(gate, up))


class DecoderLayer:
    def __init__(self, index: int, mixer, mlp: MLP, attn_norm: torch.Tensor, post_norm: torch.Tensor, eps: float):
        self.index, self.mixer, self.mlp = index, mixer, mlp
        self.attn_norm, self.post_norm, self.eps = attn_norm, post_norm, eps

    @property
    def is_recurrent(self) -> bool:
        return isinstance(self.mixer, GatedDeltaNet)

    @property
    def device(self) -> torch.device:
        return self.attn_norm.device

    @classmethod
    def load(cls, gguf: GGUFFile, index: int, config: Qwen35Config, dtype, device) -> "DecoderLayer":
        prefix = f"blk.{index}"
        mixer_cls = GatedDeltaNet if config.recurrent_layers[index] else GatedAttention
        norm_shape = (config.hidden_size,)
        return cls(
            index,
            mixer_cls.load(gguf, prefix, config, dtype, device),
            MLP.load(gguf, prefix, config, dtype, device),
            load_weight(gguf, f"{prefix}.attn_norm.weight", norm_shape, torch.float32, device),
            load_weight(gguf, f"{prefix}.post_attention_norm.weight", norm_shape, torch.float32, device),
            config.rms_eps,
        )

    def fuse(self) -> None:
        """Concatenate the projections of one input where their types allow (`Projections.fused`)."""
        self.mixer.fuse()
        self.mlp.fuse()

    def __call__(self, h: torch.Tensor, delta: torch.Tensor | None, step: Step,
                 cache: TargetCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, delta) -> (h', delta'): the residual stream arrives with the previous layer's MLP output
        not yet added (`delta`; None for the first layer), so that each add runs in the launch of the
        norm that follows it. The layer's output is h' + delta'. Each norm also writes the float16 x its matmul takes
        where it has one (`x_f16_type`)."""
        rows = h.shape[0]
        if delta is None:
            x = rms_norm(h, self.attn_norm, self.eps)
        else:
            h, x = add_rms_norm(h, delta, self.attn_norm, self.eps, x_f16_type(self.mixer.inputs, rows))
        if self.is_recurrent:
            mixed, scratch = self.mixer(x, step, cache.deltanet[self.index], partial(cache.fold_buffers, self.index))
            if scratch is not None:
                cache.pending[self.index] = scratch
        else:
            mixed = self.mixer(x, step, cache.attention[self.index])
        h, x = add_rms_norm(h, mixed, self.post_norm, self.eps, x_f16_type(self.mlp.input_matmul, rows))
        return h, self.mlp(x)


class Shard(Protocol):
    """One share of the target, cut from each layer as it loads (tensor parallel: flashtree.parallel.tp.RankShard)."""

    def local_config(self, config: Qwen35Config) -> Qwen35Config:
        """The share's config: its heads and MLP width."""

    def layer(self, layer: DecoderLayer, full: Qwen35Config, local: Qwen35Config, dtype: torch.dtype) -> None:
        """Replace `layer`'s weights with the share's, in place (`dtype`: of any weight that cannot stay quantized)."""

    def head(self, head: Linear, vocab: int, dtype: torch.dtype):
        """The LM head of the share: a linear (or wrapper) that returns the full `vocab` logits."""


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [T, vocab] float32 (or [1, vocab] with last_only)
    features: torch.Tensor | None  # [T, len(capture) * hidden]: outputs of the captured layers, in order


class Qwen35Model:
    def __init__(self, config: Qwen35Config, embed: QuantizedEmbedding, layers: list[DecoderLayer],
                 output_norm: torch.Tensor, lm_head: Linear, device: torch.device, dtype: torch.dtype):
        self.config, self.embed, self.layers = config, embed, layers
        self.output_norm, self.lm_head = output_norm, lm_head
        self.device, self.dtype = device, dtype  # `device`: where the embedding, inputs and outputs live
        # `dtype` stores the KV cache and feeds attention; the activations between kernels are `act_dtype`
        # (float32 in a bf16/f16 model: `activation_dtype`)
        self.act_dtype = activation_dtype(dtype)
        self.boundaries: dict[int, torch.device] = {}  # layer split (flashtree.parallel): layer index -> its device
        self._heads: dict[torch.dtype, Linear] = {}  # `head_for`'s copies of a dense head, by dtype

    @classmethod
    def load(cls, gguf: GGUFFile, config: Qwen35Config, device="cpu", dtype=torch.float32, progress=None,
             shard: Shard | None = None) -> "Qwen35Model":
        """The target from `gguf` (a file, or any source with its tensor table), layer by layer on `device`;
        `progress(done, total)` after each layer. With `shard` (tensor parallel) each layer and the LM head
        are cut to one rank's share as they load, and the model has the rank's config."""
        device = indexed(device)
        local = shard.local_config(config) if shard is not None else config
        d, vocab = config.hidden_size, config.vocab_size
        embed = QuantizedEmbedding.load(gguf, "token_embd.weight", vocab, d, activation_dtype(dtype), device)
        head_name = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        weights = WeightPool(device)  # each piece's temporaries apart: no holes between the weights

        def head():
            lm_head = Linear.load(gguf, head_name, vocab, d, dtype, device)
            return lm_head if shard is None else shard.head(lm_head, vocab, dtype)

        def layer(i: int) -> DecoderLayer:
            built = DecoderLayer.load(gguf, i, config, dtype, device)
            if shard is not None:
                shard.layer(built, config, local, dtype)
            built.fuse()
            return built

        lm_head = weights.build(head)
        layers = []
        for i in range(config.num_layers):
            layers.append(weights.build(lambda: layer(i)))
            if progress is not None:
                progress(i + 1, config.num_layers)
        weights.close()
        output_norm = load_weight(gguf, "output_norm.weight", (d,), torch.float32, device)
        return cls(local, embed, layers, output_norm, lm_head, device, dtype)

    def new_cache(self, capacity: int, cache_type_k=None, cache_type_v=None, attn_window: int = 0) -> TargetCache:
        """KV types by name (f16, bf16, f32, q8_0, q4_0, tq3_0; None = the model dtype); `attn_window`
        > 0 limits attention to the last `attn_window` positions (changes output)."""
        devices = [layer.device for layer in self.layers] if self.boundaries else self.device
        return TargetCache.allocate(self.config, capacity, devices, self.dtype, cache_type_k, cache_type_v,
                                    attn_window)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens.to(self.device))

    def head_for(self, dtype: torch.dtype) -> tuple[Linear, torch.dtype]:
        """The LM head for hidden states of `dtype`, and the dtype its input takes: itself and `act_dtype`, but for a
        dense head on the CPU asked for another dtype (a bf16 draft beside a float32 target, `draft_dtype`) a copy of
        its weight in `dtype`, made once (6 MiB for the demo pair, whose 15 draft rows then take 0.45 ms instead of
        2.2; a 27B head's copy would be 2.5 GB)."""
        head = self.lm_head
        if dtype == self.act_dtype or type(head) is not Linear or head.device.type != "cpu":
            return head, self.act_dtype
        if dtype not in self._heads:
            self._heads[dtype] = Linear(head.weight.to(dtype))
        return self._heads[dtype], dtype

    def logits(self, hidden: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the hidden states `hidden` (+ `delta`, the last layer's MLP output not yet added)."""
        hidden = hidden.to(self.output_norm.device)
        with on_device(hidden.device):
            if delta is None:
                normed = rms_norm(hidden, self.output_norm, self.config.rms_eps)
            else:
                normed = add_rms_norm(hidden, delta.to(hidden.device), self.output_norm, self.config.rms_eps,
                                      x_f16_type(self.lm_head, hidden.shape[0]))[1]
            return self.lm_head(normed).float().to(self.device)

    def forward_dtype(self, rows: int) -> torch.dtype:
        """The activations' dtype in a forward of `rows` tokens: `act_dtype`, except in a bf16/f16 model's prefill
        chunks of DENSE_MIN_M tokens and more, which keep the model's dtype. Their matmuls are compute-bound GEMMs
        over a dense temporary, and float32 activations cost the 27B shape's 13K prefill 30 % on the H200
        (8176 -> 5774 tok/s, 2026-12-03; docs/FIDELITY.md): decode, verify and shorter chunks run in float32."""
        return self.dtype if rows >= DENSE_MIN_M else self.act_dtype

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: TargetCache, step: Step | None = None,
                capture: Sequence[int] = (), last_only: bool = False) -> ForwardOutput:
        """Run new tokens after the cache. Without `step` they extend the sequence (and the cache);
        with a tree `step` the cache length is unchanged until `commit`."""
        self._check_tokens(tokens)  # before the copy: on the host it costs no device sync
        tokens = tokens.to(self.device)
        n = tokens.shape[0]
        cache.reserve(n)
        step = step or Step.sequence(cache.length, n, self.device)
        with on_device(self.device):
            result = self.run(tokens, cache, step, capture, last_only)
        if not step.is_tree:
            cache.length += n
        return result

    def run(self, tokens: torch.Tensor, cache: TargetCache, step: Step, capture: Sequence[int] = (),
            last_only: bool = False) -> ForwardOutput:
        """The device work of `forward`, without checks, syncs or the cache length update: what a CUDA
        graph captures (engine/cuda_graphs.py)."""
        cache.pending.clear()
        h, delta = self.embed(tokens).to(self.forward_dtype(tokens.shape[0])), None
        captured = {}
        wanted = set(capture)
        for layer in self.layers:
            if layer.index in self.boundaries:  # layer split: the hidden state hops to the next device
                device = self.boundaries[layer.index]
                h, step = h.to(device), step.to(device)
                delta = None if delta is None else delta.to(device)
            with on_device(h.device) if self.boundaries else contextlib.nullcontext():
                h, delta = layer(h, delta, step, cache)
            if layer.index in wanted:
                captured[layer.index] = h + delta  # the layer's output
        features = torch.cat([captured[i].to(self.device) for i in capture], dim=-1) if capture else None
        logits = self.logits(h[-1:], delta[-1:]) if last_only else self.logits(h, delta)
        return ForwardOutput(logits, features)

    @torch.inference_mode()
    def commit(self, cache: TargetCache, path: torch.Tensor) -> None:
        """Keep the accepted tree nodes `path` (node indices, root first) as the next committed tokens."""
        with on_device(self.device):
            self.run_commit(cache, path.to(self.device), torch.tensor([cache.length], device=self.device))
        cache.pending.clear()
        cache.length += path.shape[0]

    def run_commit(self, cache: TargetCache, path: torch.Tensor, start: torch.Tensor,
                   count: torch.Tensor | None = None) -> None:
        """The device work of `commit` (`start`: int64 [1] committed length): what a CUDA graph captures.
        Accepted K/V rows move from the tree's scratch rows into place; DeltaNet layers rerun the
        recurrence over the path (batched per device). `count` (int64 [1]): a path padded past its live
        length with the root (node 0), so that one graph commits every path of a verify: a padding entry
        repeats the root's move, row `start` onto itself."""
        offsets = padded_offsets(path.shape[0], count, path.device)  # padding moves row start, as the root does
        rows, source = start + offsets, start + path  # shared by the layers
        for table in cache.row_tables:  # every attention layer's K and V of one device and type: one launch
            device = table.caches[0].device
            with on_device(device):
                move_rows_together(table, rows.to(device), source.to(device))
        recurrent: dict[torch.device, list] = {}  # DeltaNet layers per device, committed together below
        for layer in self.layers:
            if layer.is_recurrent:
                state = cache.deltanet[layer.index]
                recurrent.setdefault(state.ssm.device, []).append((layer.mixer, state, cache.pending[layer.index]))
        for device, layers in recurrent.items():
            with on_device(device):
                commit_layers(layers, path.to(device), None if count is None else count.to(device),
                              cache.fold_tables.get(device), cache.window_tables.get(device))

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise FlashtreeError(f"token id out of range [0, {self.config.vocab_size}) in the input")
