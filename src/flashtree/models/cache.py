"""Static per-sequence state of the target: attention KV rows and Gated DeltaNet conv + recurrent state.

Allocated once for a fixed capacity (gpt-fast style). Attention rows beyond `length` are scratch: a
tree verify writes its nodes there and the commit moves the accepted ones into place, so rejected
nodes need no rollback. DeltaNet state is only ever replaced by the state at the end of an accepted
path, never touched by a rejected branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels.commit_rows import RowTable, WindowTable
from flashtree.kernels.gated_delta_triton import FoldBuffers, FoldTables
from flashtree.kernels.kv_quant import KVType, kv_type
from flashtree.models.layers import activation_dtype
from flashtree.models.qwen35_config import Qwen35Config


@dataclass
class AttentionKV:
    """K and V rows of one attention layer. A float type stores [kv_heads, capacity, head_dim] in its
    dtype; a quantized type stores [kv_heads, capacity, row_bytes] uint8 blocks (kernels/kv_quant.py),
    quantized on write. Either way a row is indexed along dim 1, so commits move rows the same way."""

    k: torch.Tensor
    v: torch.Tensor
    type_k: KVType | None = None  # None: the float type of the tensor's dtype
    type_v: KVType | None = None
    window: int = 0  # > 0: each query sees only keys less than `window` positions behind it

    def __post_init__(self) -> None:
        self.type_k = kv_type(self.type_k if self.type_k is not None else self.k.dtype)
        self.type_v = kv_type(self.type_v if self.type_v is not None else self.v.dtype)


@dataclass
class DeltaNetState:
    conv: torch.Tensor  # [conv_kernel - 1, conv_dim]: the last pre-conv inputs, oldest first (activation dtype)
    ssm: torch.Tensor  # [v_heads, head_dim, head_dim] float32


@dataclass
class TreeScratch:
    """What a DeltaNet layer keeps from a tree verify so that the commit needs no second forward: on the GPU views of
    the cache's `FoldBuffers`, where the verify's kernels wrote them, so that none of its own tensors outlive it."""

    conv_inputs: torch.Tensor  # [T, conv_dim] pre-conv projections of every node
    k: torch.Tensor  # [T, H, dk] the nodes' normalized keys
    # the verify's per-node u and gamma (`gated_delta.ancestor_chunk`, `tree_verify_with_fold`): the commit folds
    # the path's into the state (`gated_delta.fold`, `fold_path`) instead of rerunning the recurrence over it
    u: torch.Tensor
    gamma: torch.Tensor


@dataclass
class TargetCache:
    config: Qwen35Config
    capacity: int
    attention: dict[int, AttentionKV]
    deltanet: dict[int, DeltaNetState]
    length: int = 0
    pending: dict[int, TreeScratch] = field(default_factory=dict)
    # where the GPU tree verify leaves u, Gamma and k for the commit, per DeltaNet layer, and per device the table of
    # their addresses that commits every layer in one launch (`fold_buffers`); kept for the cache's life, since a
    # captured graph writes and reads them where they are
    fold: dict[int, FoldBuffers] = field(default_factory=dict)
    fold_tables: dict[torch.device, FoldTables] = field(default_factory=dict)
    window_tables: dict[torch.device, WindowTable] = field(default_factory=dict)  # the conv windows, with them
    # the attention layers' K and V caches grouped for the commit's row moves, one launch a group
    # (`move_rows_together`): made with the cache, whose tensors never move
    row_tables: list[RowTable] = field(default_factory=list)

    @classmethod
    @torch.inference_mode(False)  # a cache outlives the call that makes it (a graphed engine keeps it for the next
    # request): normal tensors, so that code outside inference mode may still update them in place
    def allocate(cls, config: Qwen35Config, capacity: int, device, dtype: torch.dtype,
                 cache_type_k=None, cache_type_v=None, attn_window: int = 0) -> "TargetCache":
        """`cache_type_k/v`: a KV type name (f32, f16, bf16, q8_0, q4_0, tq3_0); None = `dtype`, the model's.
        The DeltaNet conv state holds activations: float32 in a bf16/f16 model (`activation_dtype`)."""
        type_k = kv_type(cache_type_k if cache_type_k is not None else dtype)
        type_v = kv_type(cache_type_v if cache_type_v is not None else dtype)
        if attn_window < 0:
            raise FlashtreeError(f"attention window must be >= 0 (0 = full attention), got {attn_window}")
        heads, hd = config.num_kv_heads, config.head_dim
        # `device` may list one device per layer (a layer split, flashtree.parallel): each layer's state lives with it
        devices = list(device) if isinstance(device, (list, tuple)) else [device] * config.num_layers
        attention = {
            i: AttentionKV(type_k.allocate(heads, capacity, hd, devices[i]), type_v.allocate(heads, capacity, hd, devices[i]),
                           type_k, type_v, attn_window)
            for i in config.attention_layers
        }
        d = config.gdn_head_dim
        deltanet = {
            i: DeltaNetState(
                torch.zeros(config.conv_kernel - 1, config.conv_dim, device=devices[i], dtype=activation_dtype(dtype)),
                torch.zeros(config.gdn_v_heads, d, d, device=devices[i], dtype=torch.float32),
            )
            for i in config.deltanet_layers
        }
        caches = [side for kv in attention.values() for side in (kv.k, kv.v)]
        return cls(config, capacity, attention, deltanet, row_tables=RowTable.group(caches))

    def fold_buffers(self, index: int, k_heads: int, dk: int) -> FoldBuffers:
        """DeltaNet layer `index`'s `FoldBuffers` (with its nodes' conv inputs). The first call makes them for every
        DeltaNet layer, and each device's `FoldTables` and `WindowTable`: it must not come during CUDA graph capture
        (the graph runner's first call of a step runs it eagerly before capturing, and a tree verify is where it is
        first asked for)."""
        if not self.fold:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise FlashtreeError("the fold buffers are made outside CUDA graph capture: run the step once first")
            with torch.inference_mode(False):  # updated in place outside inference mode too
                layers: dict[torch.device, list[int]] = {}
                for i, state in self.deltanet.items():
                    heads, _, dv = state.ssm.shape
                    self.fold[i] = FoldBuffers.allocate(heads, dv, k_heads, dk, state.ssm.device, conv_like=state.conv)
                    layers.setdefault(state.ssm.device, []).append(i)
                self.fold_tables = {device: FoldTables.of([self.deltanet[i].ssm for i in indices],
                                                          [self.fold[i] for i in indices])
                                    for device, indices in layers.items()}
                self.window_tables = {device: WindowTable.of([self.deltanet[i].conv for i in indices],
                                                             [self.fold[i].conv for i in indices])
                                      for device, indices in layers.items()}
        return self.fold[index]

    def reserve(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise FlashtreeError(
                f"context full: {self.length} cached + {n_new} new tokens exceed the context size {self.capacity}; "
                "raise --ctx or shorten the prompt"
            )

    def reset(self) -> None:
        self.length = 0
        self.pending.clear()
        for state in self.deltanet.values():
            state.conv.zero_()
            state.ssm.zero_()
