"""Where a mode's tokens first differ from our AR run's on a prompt, and how decided the target was there:
the margin (top-1 minus top-2 logit) of its distribution after the common prefix. A near-tie (a margin
that rounding can cross: a decode row and a verify row round differently on a GPU) explains a
difference; a wide margin points at a bug."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from flashtree.bench.fidelity import MARGIN


def first_difference(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where `tokens` and `reference` differ (the shorter one's end when one is a
    prefix of the other); None when they are equal."""
    if list(tokens) == list(reference):
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def margin_after(engine, sequence: list[int], config) -> float:
    """The target's top-1 minus top-2 logit for the last token of `sequence`, given the tokens before it
    (a difference of log-probabilities is one of logits), scored in one pass over the sequence."""
    last = engine.runner.score_prompt(sequence, replace(config, prompt_logprobs=2))[-1]
    (_, first), (_, second) = last.top
    return first - second


def divergences(engine, prompts: list[list[int]], outputs: list[list[int]], ar_outputs: list[list[int]],
                config) -> list[dict]:
    """One entry per prompt whose `outputs` differ from `ar_outputs`: the prompt's index, the first
    differing token's position, both tokens there, and the target's margin there (None past AR's end)."""
    entries = []
    for index, (prompt, tokens, reference) in enumerate(zip(prompts, outputs, ar_outputs)):
        position = first_difference(tokens, reference)
        if position is None:
            continue
        ar_token = reference[position] if position < len(reference) else None
        margin = margin_after(engine, prompt + reference[: position + 1], config) if ar_token is not None else None
        entries.append({"prompt": index, "position": position, "ar_token": ar_token,
                        "token": tokens[position] if position < len(tokens) else None,
                        "margin": None if margin is None else round(margin, 6)})
    return entries


def describe(dataset: str, mode: str, entry: dict) -> str:
    """One line of the table's notes for a divergence."""
    where = f"{dataset} {mode}: prompt {entry['prompt']} differs from ar at token {entry['position']}"
    if entry["margin"] is None:
        return f"{where} (past the end of ar's output)"
    verdict = "near-tie" if entry["margin"] <= MARGIN else "decided: look for a bug"
    return f"{where}, target margin {entry['margin']:.4f} ({verdict})"
