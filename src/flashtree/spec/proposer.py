"""Where draft tokens come from: the DFlash draft fed with the target's captured layer features.

A proposer sees the committed sequence only through `start` (a new sequence) and `commit`
(features of newly committed tokens: prompt chunks during prefill, then accepted verify paths),
and answers `propose` with one row of logits per block position after the bonus token.
"""

from __future__ import annotations

from typing import Protocol

import torch

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

    def __init__(self, target_model, draft: DFlashDraft, window: int):
        self.target = target_model
        self.draft = draft
        self.block_size = draft.config.block_size
        self.capture_layers = tuple(draft.config.target_layer_ids)
        self.device = draft.fc.weight.device  # the draft's own device (--draft-device), maybe not the target's
        self.cache = draft.new_cache(window, device=self.device, dtype=target_model.dtype)

    def start(self) -> None:
        self.cache.reset()

    def commit(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        self.draft.append_context(self.cache, features.to(self.device, self.target.dtype), positions)

    @torch.inference_mode()
    def propose(self, bonus: int, position: int) -> torch.Tensor:
        block = torch.full((self.block_size,), self.draft.config.mask_token_id, dtype=torch.long)
        block[0] = bonus
        embeddings = self.target.embed_tokens(block).to(self.device)
        hidden = self.draft.forward_block(self.cache, embeddings, position)
        head = self.target.lm_head  # on the target's last device: the hidden states go there, the logits come back
        return head(hidden[1:].to(head.device, self.target.dtype)).float().to(self.target.device)
