"""What one target forward is asked to process: a run of new tokens or a draft tree."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Step:
    positions: torch.Tensor  # int64 [T]: RoPE position of each token
    start: int  # first cache slot written (= tokens already committed)
    visible: torch.Tensor  # bool [T, T]: token i sees new token j (causal, or ancestors-or-self in a tree)
    parents: torch.Tensor | None  # int64 [T], -1 = attached to the committed prefix; None for a plain run

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

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
