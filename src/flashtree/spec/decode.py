"""Speculative decoding loop: draft a block, build a chain or DDTree, verify it in one target
forward, commit the longest target-agreeing path.

Greedy and lossless: every committed token is the target's argmax given exactly the committed
prefix (the tree mask and the ancestor-path DeltaNet recurrence make each node's logits those of
its root-to-node sequence), so the output equals autoregressive greedy decoding.
"""

from __future__ import annotations

import time

import torch

from flashtree.models.step import Step
from flashtree.spec.ddtree import DraftTree, build_chain, build_tree, follow, topk_table
from flashtree.spec.proposer import DFlashProposer, Proposer


def make_tree(mode: str, bonus: int, draft_logits: torch.Tensor, budget: int, topk: int) -> DraftTree:
    if mode == "chain":
        return build_chain(bonus, draft_logits.argmax(-1), min(budget, draft_logits.shape[0]))
    logprobs, ids = topk_table(draft_logits, min(topk, draft_logits.shape[-1]))
    return build_tree(bonus, logprobs, ids, budget)


def speculative(engine, prompt_ids: list[int], config, out, stats, started: float) -> None:
    model = engine.target.model
    proposer = _proposer(engine, config)
    cache = model.new_cache(engine.context_size(len(prompt_ids), config))
    logits, features = engine.prefill(cache, prompt_ids, config.prefill_chunk, capture=proposer.capture_layers)
    proposer.start(features)
    stats.prefill_s = time.perf_counter() - started
    bonus = int(logits.argmax())
    while not out.push(bonus):
        t0 = time.perf_counter()
        tree = make_tree(config.mode, bonus, proposer.propose(bonus, cache.length), config.budget, config.topk)
        t1 = time.perf_counter()
        step = Step.tree(cache.length, tree.parents.to(model.device), tree.depths.to(model.device),
                         tree.ancestor_mask().to(model.device))
        result = model.forward(tree.tokens, cache, step=step, capture=proposer.capture_layers)
        accepted, bonus = follow(tree, result.logits.argmax(-1).tolist())
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        stats.steps += 1
        stats.accepted[len(accepted)] += 1
        stats.proposed += len(tree) - 1
        out.push_many(tree.tokens[accepted[1:]].tolist())
        if out.done:  # an end-of-generation or stop inside the accepted path: emit up to it, no further
            break
        _commit(model, cache, proposer, result.features, accepted)


def _commit(model, cache, proposer: Proposer, features: torch.Tensor, accepted: list[int]) -> None:
    path = torch.tensor(accepted, device=model.device)
    positions = torch.arange(cache.length, cache.length + len(accepted), device=model.device)
    model.commit(cache, path)
    proposer.commit(features[path], positions)


def _proposer(engine, config) -> Proposer:
    draft = engine.draft
    return DFlashProposer(engine.target.model, draft, config.draft_window) if hasattr(draft, "forward_block") else draft
