"""Where draft tokens come from: the DFlash draft fed with the target's captured layer features.

A proposer sees the committed sequence only through `start` (a new sequence) and `commit`
(features of newly committed tokens: prompt chunks during prefill, then accepted verify paths),
and answers `propose` with one row of logits per block position after the bonus token.
"""

from __future__ import annotations

from typing import Protocol

import torch

from flashtree.engine.cuda_graphs import CapturedSteps, bucket_rows
from flashtree.kernels import on_device
from flashtree.models.dflash import DFlashDraft


class Proposer(Protocol):
    block_size: int  # bonus token + proposed positions
    capture_layers: tuple[int, ...]  # target layers whose outputs the proposer needs

    def start(self) -> None: ...  # a new sequence: forget all context

    def propose(self, bonus: int, position: int) -> torch.Tensor: ...  # [block_size - 1, vocab] logits

    def commit(self, features: torch.Tensor, positions: torch.Tensor) -> None: ...


class DFlashProposer:
    """One non-causal draft pass over [bonus, mask x (block-1)], conditioned on an incremental
    cache of projected target features (only newly committed positions are appended each step)."""

    def __init__(self, target_model, draft: DFlashDraft, window: int, capture_graphs: bool | None = None):
        """`capture_graphs`: None = eager block passes; True/False = graph-ready static passes, captured
        as CUDA graphs or run eagerly (engine/cuda_graphs.py); only with the draft on the target's device."""
        self.target = target_model
        self.draft = draft
        self.block_size = draft.config.block_size
        self.capture_layers = tuple(draft.config.target_layer_ids)
        self.device = draft.fc.weight.device  # the draft's own device (--draft-device), maybe not the target's
        self.cache = draft.new_cache(window, device=self.device)
        same_device = self.device == target_model.device == target_model.lm_head.device
        self.steps = CapturedSteps(self.device, capture_graphs) if capture_graphs is not None and same_device else None
        self._prefetched: tuple[tuple[int, int], torch.Tensor] | None = None  # (bonus, position), block hidden
        # the draft's logits: the target's LM head (a copy in the draft's dtype where it is another, `head_for`)
        self.head, self.head_dtype = target_model.head_for(draft.fc.weight.dtype)

    @property
    def overlaps(self) -> bool:
        """The draft has a device of its own (--draft-device): its next block pass can run while the
        target's device commits the last verify (`ModelRunner.commit_step` then calls `prefetch`)."""
        return self.device != self.target.device

    def start(self) -> None:
        self.cache.reset()
        self._prefetched = None

    def commit(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        with on_device(self.device):
            self.draft.append_context(self.cache, features.to(self.device, self.target.dtype), positions)

    def commit_static(self, features: torch.Tensor, positions: torch.Tensor, count: torch.Tensor,
                      offsets: torch.Tensor | None = None) -> None:
        """`commit` as a device-only function (`count`: int64 [1] positions appended so far; `offsets`: each
        row's slot after them, for rows padded with copies of row 0, `DFlashDraft.append_context`); the
        caller advances `cache.count`."""
        self.draft.append_context(self.cache, features.to(self.target.dtype), positions, count, offsets)

    @torch.inference_mode()
    def propose(self, bonus: int, position: int) -> torch.Tensor:
        if self.steps is not None:
            rows = bucket_rows(max(self.cache.length, 1), self.cache.max_context)
            length = self.cache.length
            with on_device(self.device):
                return self.steps.run((rows,), 3, lambda host: host.copy_(torch.tensor([bonus, position, length])),
                                      lambda packed: self.static_block(packed, rows))
        pending, self._prefetched = self._prefetched, None
        hidden = pending[1] if pending is not None and pending[0] == (bonus, position) else \
            self._block_hidden(bonus, position)
        head = self.head  # on the target's last device: the hidden states go there, the logits come back
        with on_device(head.device):
            return head(hidden[1:].to(head.device, self.head_dtype)).float().to(self.target.device)

    @torch.inference_mode()
    def prefetch(self, bonus: int, position: int) -> None:
        """Launch the block pass that `propose(bonus, position)` will need, without waiting for it, so the
        draft's device works on it while the target's device commits. Only the head's matmul stays for
        `propose`: run here, it would make the target's device wait for the draft before its commit."""
        self._prefetched = ((bonus, position), self._block_hidden(bonus, position))

    def _block_hidden(self, bonus: int, position: int) -> torch.Tensor:
        block = torch.full((self.block_size,), self.draft.config.mask_token_id, dtype=torch.long)
        block[0] = bonus
        embeddings = self.target.embed_tokens(block).to(self.device)
        with on_device(self.device):
            return self.draft.forward_block(self.cache, embeddings, position)

    def static_block(self, packed: torch.Tensor, rows: int) -> torch.Tensor:
        """The block pass as a function of device inputs [bonus, position, context length] only (the context
        read up to `rows`, a bucket of `bucket_rows`): [block_size - 1, vocab] float32 logits. A captured
        function's piece: `propose`, and the whole speculative step (engine/cuda_graphs.py)."""
        first = torch.arange(self.block_size, device=self.device) == 0
        block = torch.where(first, packed[0], self.draft.config.mask_token_id)
        hidden = self.draft.forward_block(self.cache, self.target.embed_tokens(block), packed[1:2], rows, packed[2:3])
        return self.head(hidden[1:].to(self.head_dtype)).float()
