"""The decoding loops `Engine.generate` runs after its checks, on the engine's `ModelRunner`
(engine/runner.py): `autoregressive` (mode ar: one target step per token) and `speculative` (modes chain
and ddtree).

Speculative decoding: draft a block, build a chain or DDTree, verify it in one target forward, commit
the longest target-agreeing path.

Lossless: the tree mask and the ancestor-path DeltaNet recurrence make each node's logits those of
its root-to-node sequence, and each node's distribution is processed with that sequence's own
history (penalties). Greedy: every committed token is the target's argmax given exactly the
committed prefix. Sampling: the walk draws the target's token at each visited node from that node's
distribution and moves to the child carrying it, stopping at the first draw no child carries (that
draw is the next bonus token) -- so each emitted token is an exact draw from the target given the
tokens before it, and the output is distributed as autoregressive sampling (docs/SAMPLING.md).

Adaptive: while speculation does not pay on a request, its policy (engine/adaptive.py) shrinks the tree or
runs plain AR steps, which feed the draft their features as a prefill does; either way each committed
token is the target's own choice, so the output does not change.
"""

from __future__ import annotations

import time

import torch

from flashtree.drafting.ddtree import DraftTree, build_chain, build_tree, follow, topk_table
from flashtree.drafting.proposer import DFlashProposer, Proposer
from flashtree.engine.adaptive import AdaptiveBudget, FixedBudget, budget_policy, step_clock
from flashtree.engine.config import GenerationConfig, GenerationStats
from flashtree.engine.cuda_graphs import CapturedSteps, GraphedForward
from flashtree.engine.output import OutputTracker, TokenLogprob, logprobs_of
from flashtree.engine.runner import ModelRunner
from flashtree.kernels.tree_build import MAX_TABLE_ROWS, MAX_TOPK, MAX_TREE_ROWS


def autoregressive(engine: ModelRunner, prompt_ids: list[int], config: GenerationConfig, out: OutputTracker,
                   stats: GenerationStats, started: float) -> None:
    sampler = engine.sampler(prompt_ids, config)
    cache = engine.new_cache(len(prompt_ids), config)
    logits = engine.prefill_prompt(cache, prompt_ids, config, stats=stats)[None]
    stats.prefill_s = time.perf_counter() - started
    token = sampler.choose(sampler.distribution(logits)[0])
    while not out.push(token, logprobs_of(logits, [token], config.logprobs)[0]):
        sampler.record(token)
        step_start = time.perf_counter()
        logits = engine.step_forward(torch.tensor([token]), cache).logits
        token = sampler.choose(sampler.distribution(logits)[0])
        stats.verify_s += time.perf_counter() - step_start
        stats.steps += 1
        stats.accepted[1] += 1


FLOAT32_EXACT_IDS = 1 << 24  # token ids below this are exact in float32


def tree_width(mode: str, budget: int, draft_rows: int) -> int:
    """The most nodes below the root a step's tree can have: a chain is at most one draft block long (15 of a
    budget of 22: its verify pads to 16 rows, not 23), a DDTree has its budget."""
    return min(budget, draft_rows) if mode == "chain" else budget


def make_tree(mode: str, bonus: int, draft_logits: torch.Tensor, budget: int, topk: int) -> DraftTree:
    if mode == "chain":
        return build_chain(bonus, draft_logits.argmax(-1), tree_width(mode, budget, draft_logits.shape[0]))
    logprobs, ids = topk_table(draft_logits, min(topk, draft_logits.shape[-1]))
    if draft_logits.shape[-1] > FLOAT32_EXACT_IDS:
        return build_tree(bonus, logprobs, ids, budget)
    # one copy to the host, not one per tensor (each waits for the device)
    table = torch.stack([logprobs, ids.float()]).cpu()
    return build_tree(bonus, table[0], table[1].long(), budget)


def speculative(engine: ModelRunner, prompt_ids: list[int], config: GenerationConfig, out: OutputTracker,
                stats: GenerationStats, started: float) -> None:
    proposer = proposer_for(engine, config)
    sampler = engine.sampler(prompt_ids, config)
    cache = engine.new_cache(len(prompt_ids), config)
    logits = engine.prefill_prompt(cache, prompt_ids, config, proposer, stats)[None]
    stats.prefill_s = time.perf_counter() - started
    policy, clock = budget_policy(config, engine.speculation(config)), step_clock()
    bonus = sampler.choose(sampler.distribution(logits)[0])
    [bonus_logprob] = logprobs_of(logits, [bonus], config.logprobs)
    runner = device_step_runner(engine, proposer, sampler, config)
    try:
        speculative_loop(engine, cache, proposer, sampler, bonus, bonus_logprob, config, out, stats, policy, clock,
                         runner)
    finally:
        if runner is not None:
            runner.settle()  # a step launched ahead of an output that ended: its commit counts (prefix cache)


def speculative_loop(engine: ModelRunner, cache, proposer: Proposer, sampler, bonus: int,
                     bonus_logprob: TokenLogprob | None, config: GenerationConfig, out: OutputTracker,
                     stats: GenerationStats, policy: AdaptiveBudget | FixedBudget, clock,
                     runner: GraphedForward | None) -> None:
    """Steps until the output ends: tree steps (on the device where `runner` is given) or, where the policy says
    so, plain AR steps."""
    current = config.budget
    while not out.push(bonus, bonus_logprob):
        sampler.record(bonus)
        budget = policy.budget
        if budget != current:  # the stats say from which token on the policy changed it
            stats.budget_switches.append((len(out.token_ids), budget))
            current = budget
        if budget == 0:
            bonus, bonus_logprob = ar_step(engine, cache, proposer, sampler, bonus, config, stats)
            policy.record(1, clock() if clock else None, CapturedSteps.captures)
            continue
        if runner is not None and tree_width(config.mode, budget, proposer.block_size - 1) < MAX_TREE_ROWS:
            step = device_tree_step(runner, cache, proposer, bonus, budget, config, out, stats, policy, clock)
        else:
            step = tree_step(engine, cache, proposer, sampler, bonus, budget, config, out, stats, policy, clock)
        if step is None:  # an end-of-generation or stop inside the accepted path
            return
        bonus, bonus_logprob = step


def ar_step(engine: ModelRunner, cache, proposer: Proposer, sampler, token: int, config: GenerationConfig,
            stats: GenerationStats) -> tuple[int, TokenLogprob | None]:
    """One target decode step after `token` inside a speculative request, feeding the draft its features;
    returns the next token and its log-probability entry."""
    step_start = time.perf_counter()
    logits = engine.step_feeding(token, cache, proposer)
    token = sampler.choose(sampler.distribution(logits)[0])
    stats.verify_s += time.perf_counter() - step_start
    stats.steps += 1
    stats.ar_fallback_steps += 1
    stats.accepted[1] += 1
    return token, logprobs_of(logits, [token], config.logprobs)[0]


def tree_step(engine: ModelRunner, cache, proposer: Proposer, sampler, bonus: int, budget: int,
              config: GenerationConfig, out: OutputTracker, stats: GenerationStats,
              policy: AdaptiveBudget | FixedBudget, clock=None) -> tuple[int, TokenLogprob | None] | None:
    """Draft a tree of `budget` nodes below `bonus`, verify it, emit the accepted tokens and commit them;
    returns the next bonus token and its entry, or None when the output ended inside the accepted path."""
    t0 = time.perf_counter()
    draft_logits = proposer.propose(bonus, cache.length)
    tree = make_tree(config.mode, bonus, draft_logits, budget, config.topk)
    t1 = time.perf_counter()
    result = engine.step_forward(tree.tokens, cache, tree, proposer.capture_layers,
                                 pad_to=tree_width(config.mode, budget, draft_logits.shape[0]) + 1)
    accepted, bonus = walk(tree, result.logits, sampler)
    stats.draft_s += t1 - t0
    stats.verify_s += time.perf_counter() - t1
    stats.steps += 1
    stats.accepted[len(accepted)] += 1
    stats.proposed += len(tree) - 1
    policy.record(len(accepted), clock() if clock else None, CapturedSteps.captures)
    tokens = tree.tokens[accepted[1:]].tolist()
    # each accepted token, then the bonus, was chosen from its parent node's row: the path's rows in order
    rows = result.logits[accepted] if config.logprobs is not None else None  # no gather unless asked for
    *entries, bonus_logprob = logprobs_of(rows, tokens + [bonus], config.logprobs)
    # a draft on its own device starts the next block during the commit, unless the next step is an AR step
    next_bonus = bonus if policy.budget else None
    committed = out.takes_without_ending(tokens)
    if committed:  # the device commits (and drafts) while the host streams these tokens
        engine.commit_step(cache, accepted, proposer, result.features, next_bonus=next_bonus)
    for token, entry in zip(tokens, entries):
        if out.push(token, entry):  # emit up to the end, no further (the path is then never committed)
            return None
        sampler.record(token)
    if not committed:
        engine.commit_step(cache, accepted, proposer, result.features, next_bonus=next_bonus)
    return bonus, bonus_logprob


def device_step_runner(engine: ModelRunner, proposer: Proposer, sampler, config: GenerationConfig) -> GraphedForward | None:
    """The graph runner when a whole speculative step can run on the device (`device_tree_step`): greedy
    with nothing that needs the host between verify and walk (no penalties, bias or log-probabilities), and a
    graph-ready draft on the target's device."""
    params = sampler.params
    if not params.greedy or params.penalized or params.logit_bias or config.logprobs is not None:
        return None
    if config.mode == "ddtree" and config.topk > MAX_TOPK or proposer.block_size - 1 > MAX_TABLE_ROWS:
        return None  # past the device build's table (its heap keys pack rank and row in a few bits)
    runner = engine.graph_runner()
    static = getattr(proposer, "steps", None) is not None and hasattr(proposer, "static_block")
    return runner if runner is not None and static else None


def device_tree_step(runner: GraphedForward, cache, proposer: Proposer, bonus: int, budget: int,
                     config: GenerationConfig, out: OutputTracker, stats: GenerationStats,
                     policy: AdaptiveBudget | FixedBudget, clock=None) -> tuple[int, None] | None:
    """`tree_step` as one graph on the device (`GraphedForward.speculative_step`): the same tree, verify, greedy
    walk and commit, with one wait for the accepted tokens instead of a host tree build and walk between
    two waits. Its time counts as verify time (the draft's share is not measured apart)."""
    started = time.perf_counter()
    nodes = tree_width(config.mode, budget, proposer.block_size - 1)
    result = runner.speculative_step(cache, proposer, bonus, config.mode, nodes, config.topk)
    count, bonus = result[0], result[1]
    tokens = result[2 + nodes + 1 :][1:count]  # the path's tokens below the root
    stats.verify_s += time.perf_counter() - started
    stats.steps += 1
    stats.accepted[count] += 1
    stats.proposed += nodes
    policy.record(count, clock() if clock else None, CapturedSteps.captures)
    if policy.budget == budget and out.takes_without_ending(tokens + [bonus]):
        runner.launch_ahead(cache, proposer, bonus, config.mode, nodes, config.topk)  # runs while these stream
    for token in tokens:
        if out.push(token):  # the step committed past this end (the prefix cache knows: cache.length)
            return None
    return bonus, None


def walk(tree: DraftTree, logits: torch.Tensor, sampler) -> tuple[list[int], int]:
    """Accepted node indices (root first) and the next bonus token."""
    counts = _path_counts(tree, tree.ancestor_mask().to(logits.device), logits.shape[-1]) if sampler.params.penalized else None
    dist = sampler.distribution(logits, counts)
    if sampler.params.greedy:
        return follow(tree, dist.argmax(-1).tolist())
    accepted, node = [0], 0
    while True:  # draws only along the realised path, one per visited node
        token = sampler.choose(dist[node])
        child = tree.children(node).get(token)
        if child is None:
            return accepted, token
        accepted.append(child)
        node = child


def _path_counts(tree: DraftTree, ancestors: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V] counts of each node's path tokens below the root (the root is already in the output)."""
    below_root = ancestors.float().clone()
    below_root[:, 0] = 0
    one_hot = torch.nn.functional.one_hot(tree.tokens.to(ancestors.device), vocab).float()
    return below_root @ one_hot


def proposer_for(engine: ModelRunner, config: GenerationConfig) -> Proposer:
    """The engine's proposer for a request: the draft itself, or a DFlashProposer over it (graph-ready and
    kept across requests where the target's steps replay CUDA graphs)."""
    draft = engine.draft
    if not hasattr(draft, "forward_block"):
        return draft
    runner = engine.graph_runner()  # graph-ready target steps: the draft's block pass is made static too
    if runner is None:
        return DFlashProposer(engine.target.model, draft, config.draft_window)
    kept = runner.proposer  # reused across requests, like the cache, so its captured graphs stay valid
    if kept is None or kept.draft is not draft or kept.cache.max_context != config.draft_window:
        kept = runner.proposer = DFlashProposer(engine.target.model, draft, config.draft_window,
                                                capture_graphs=runner.steps.capture_graphs)
    return kept
