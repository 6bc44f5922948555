"""What one target forward is asked to process: a run of new tokens or a draft tree.

An eager step knows the committed length as a Python int and reads exactly the cache rows it needs.
A graphed step (`start_t` set, engine/cuda_graphs.py) keeps every per-step number in device tensors
that are refilled before each replay, and reads the cache up to a fixed `kv_end`, masking the rows
past the committed length plus the new tokens; the same captured kernels then serve every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashtree.kernels.qk_norm_rope import rope_tables
from flashtree.kernels.tree_attention import graphed_mask


def padded_offsets(rows: int, count: torch.Tensor | None, device) -> torch.Tensor:
    """int64 [rows]: each row's offset from the committed length along an accepted path of `rows` entries;
    with `count` (int64 [1] on the device) the path is padded with the root past its live length, and the
    padding rows get offset 0, the root's (one captured commit serves every path length of a verify)."""
    offsets = torch.arange(rows, device=device)
    return offsets if count is None else offsets * (offsets < count)


@dataclass(frozen=True)
class Step:
    positions: torch.Tensor  # int64 [T]: RoPE position of each token
    start: int  # first cache slot written (= tokens already committed); unused when graphed
    visible: torch.Tensor  # bool [T, T]: token i sees new token j (causal, or ancestors-or-self in a tree)
    parents: torch.Tensor | None  # int64 [T], -1 = attached to the committed prefix; None for a plain run
    slots: torch.Tensor  # int64 [T]: cache rows the new tokens' K/V are written to
    kv_end: int  # cache rows [.., kv_end) that attention reads
    start_t: torch.Tensor | None = None  # graphed: int64 [1] device copy of the committed length
    _memo: dict = field(default_factory=dict, compare=False, repr=False)  # per-forward tables shared by layers

    def rope(self, rot_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of this step's positions, computed once per forward and shared by every attention layer."""
        key = ("rope", rot_dim, theta)
        if key not in self._memo:
            self._memo[key] = rope_tables(self.positions, rot_dim, theta)
        return self._memo[key]

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def graphed(self) -> bool:
        return self.start_t is not None

    def start_tensor(self) -> torch.Tensor:
        """int64 [1] committed length on the device: `start_t` when graphed, else made once per forward."""
        if self.start_t is not None:
            return self.start_t
        if "start" not in self._memo:
            self._memo["start"] = torch.tensor([self.start], device=self.positions.device)
        return self._memo["start"]

    def first_row(self, window: int) -> int:
        """The lowest cache row any query of this step can see: every query sits at position >= start,
        so a window hides the rows below start - window + 1 (a graphed step masks them instead)."""
        return max(0, self.start - window + 1) if window > 0 and not self.graphed else 0

    def attention_mask(self, lo: int, window: int) -> torch.Tensor:
        """bool [T, kv_end - lo]: committed rows from `lo` on, then the new tokens' own visibility,
        limited to keys less than `window` positions back when window > 0. Built once per forward."""
        key = ("mask", lo, window)
        if key not in self._memo:
            self._memo[key] = self._graphed_mask(window) if self.graphed else self._eager_mask(lo, window)
        return self._memo[key]

    def _eager_mask(self, lo: int, window: int) -> torch.Tensor:
        n, device = self.positions.shape[0], self.positions.device
        mask = torch.cat([torch.ones(n, self.start - lo, dtype=torch.bool, device=device), self.visible], dim=1)
        if window > 0:
            key_pos = torch.cat([torch.arange(lo, self.start, device=device), self.positions])
            mask = mask & (self.positions[:, None] - key_pos[None, :] < window)
        return mask

    def _graphed_mask(self, window: int) -> torch.Tensor:
        return graphed_mask(self.start_t, self.visible, self.positions, self.kv_end, window)

    def to(self, device) -> "Step":
        """The same step with its tensors on `device` (a layer-split boundary, flashtree.parallel)."""
        parents = None if self.parents is None else self.parents.to(device)
        start_t = None if self.start_t is None else self.start_t.to(device)
        return Step(self.positions.to(device), self.start, self.visible.to(device), parents, self.slots.to(device),
                    self.kv_end, start_t)

    @classmethod
    def sequence(cls, start: int, n: int, device) -> "Step":
        slots = torch.arange(start, start + n, device=device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        return cls(slots, start, causal, None, slots, start + n)

    @classmethod
    def tree(cls, start: int, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor) -> "Step":
        slots = torch.arange(start, start + parents.shape[0], device=parents.device)
        return cls(start + depths, start, ancestors, parents, slots, start + parents.shape[0])
