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
from flashtree.models.qwen35_config import Qwen35Config


@dataclass
class AttentionKV:
    k: torch.Tensor  # [kv_heads, capacity, head_dim]
    v: torch.Tensor


@dataclass
class DeltaNetState:
    conv: torch.Tensor  # [conv_kernel - 1, conv_dim]: the last pre-conv inputs, oldest first
    ssm: torch.Tensor  # [v_heads, head_dim, head_dim] float32


@dataclass
class TreeScratch:
    """What a DeltaNet layer keeps from a tree verify so that the commit needs no second forward."""

    conv_inputs: torch.Tensor  # [T, conv_dim] pre-conv projections of every node
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


@dataclass
class TargetCache:
    config: Qwen35Config
    capacity: int
    attention: dict[int, AttentionKV]
    deltanet: dict[int, DeltaNetState]
    length: int = 0
    pending: dict[int, TreeScratch] = field(default_factory=dict)

    @classmethod
    def allocate(cls, config: Qwen35Config, capacity: int, device, dtype: torch.dtype) -> "TargetCache":
        attention = {
            i: AttentionKV(
                torch.zeros(config.num_kv_heads, capacity, config.head_dim, device=device, dtype=dtype),
                torch.zeros(config.num_kv_heads, capacity, config.head_dim, device=device, dtype=dtype),
            )
            for i in config.attention_layers
        }
        d = config.gdn_head_dim
        deltanet = {
            i: DeltaNetState(
                torch.zeros(config.conv_kernel - 1, config.conv_dim, device=device, dtype=dtype),
                torch.zeros(config.gdn_v_heads, d, d, device=device, dtype=torch.float32),
            )
            for i in config.deltanet_layers
        }
        return cls(config, capacity, attention, deltanet)

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
