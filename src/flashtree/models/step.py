"""What one target forward is asked to process: a run of new tokens or a draft tree."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashtree.models.layers import rope_tables


@dataclass(frozen=True)
class Step:
    positions: torch.Tensor  # int64 [T]: RoPE position of each token
    start: int  # first cache slot written (= tokens already committed)
    visible: torch.Tensor  # bool [T, T]: token i sees new token j (causal, or ancestors-or-self in a tree)
    parents: torch.Tensor | None  # int64 [T], -1 = attached to the committed prefix; None for a plain run
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

    def attention_mask(self, lo: int, window: int) -> torch.Tensor:
        """bool [T, start - lo + T]: committed rows from `lo` on, then the new tokens' own visibility,
        limited to keys less than `window` positions back when window > 0. Built once per forward."""
        key = ("mask", lo, window)
        if key not in self._memo:
            n, device = self.positions.shape[0], self.positions.device
            mask = torch.cat([torch.ones(n, self.start - lo, dtype=torch.bool, device=device), self.visible], dim=1)
            if window > 0:
                key_pos = torch.cat([torch.arange(lo, self.start, device=device), self.positions])
                mask = mask & (self.positions[:, None] - key_pos[None, :] < window)
            self._memo[key] = mask
        return self._memo[key]

    def to(self, device) -> "Step":
        """The same step with its tensors on `device` (a layer-split boundary, flashtree.dist)."""
        parents = None if self.parents is None else self.parents.to(device)
        return Step(self.positions.to(device), self.start, self.visible.to(device), parents)

    @classmethod
    def sequence(cls, start: int, n: int, device) -> "Step":
        positions = torch.arange(start, start + n, device=device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        return cls(positions, start, causal, None)

    @classmethod
    def tree(cls, start: int, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor) -> "Step":
        return cls(start + depths, start, ancestors, parents)
