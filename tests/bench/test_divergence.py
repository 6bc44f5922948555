"""Bench notes where a mode's tokens first differ from AR's, with the target's margin there."""

import pytest
import torch

from flashtree.bench.cli import _print_table
from flashtree.bench.divergence import describe, divergences, first_difference
from flashtree.bench.fidelity import MARGIN
from flashtree.engine.config import GenerationConfig
from flashtree.engine.generate import Engine
from flashtree.engine.loader import load_target

PROMPT = [5, 17, 3, 29, 11, 8]


@pytest.mark.parametrize("tokens,reference,expected", [([1, 2, 3], [1, 2, 3], None), ([1, 9, 3], [1, 2, 3], 1),
                                                       ([1, 2], [1, 2, 3], 2), ([4], [1], 0)])
def test_first_difference(tokens, reference, expected):
    assert first_difference(tokens, reference) == expected


def test_a_constructed_divergence_reports_its_position_and_the_targets_margin(make_gguf):
    target = load_target(make_gguf(), device="cpu")
    engine = Engine(target)
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    reference = engine.generate(PROMPT, config).token_ids
    position = 7
    prefix = PROMPT + reference[:position]
    logits = target.model.forward(torch.tensor(prefix), target.model.new_cache(len(prefix) + 1)).logits[-1]
    top2 = logits.topk(2)
    assert top2.indices[0].item() == reference[position]  # greedy AR chose the top token there
    # a run that took the runner-up at `position` and went its own way after it
    other = reference[:position] + [top2.indices[1].item()] + reference[position + 1:]
    entries = divergences(engine, [PROMPT, PROMPT], [reference, other], [reference, reference], config)
    assert len(entries) == 1
    entry = entries[0]
    assert (entry["prompt"], entry["position"], entry["ar_token"], entry["token"]) == \
        (1, position, reference[position], other[position])
    assert entry["margin"] == pytest.approx((top2.values[0] - top2.values[1]).item(), abs=1e-4)


def test_notes_tell_a_near_tie_from_a_decided_position(capsys):
    tie = {"prompt": 3, "position": 117, "ar_token": 1, "token": 2, "margin": MARGIN / 10}
    decided = {**tie, "prompt": 4, "margin": 10 * MARGIN}
    assert "near-tie" in describe("humaneval", "ddtree", tie)
    assert "bug" in describe("humaneval", "ddtree", decided)
    row = {"dataset": "humaneval", "mode": "ddtree", "budget": 22, "acceptance_length": 5.0, "tokens_per_s": 10.0,
           "ms_per_step": 1.0, "speedup": 2.0, "identical_to_ar": 18, "prompts": 20, "ar_fallback_steps": 7,
           "divergences": [tie, decided]}
    _print_table({"device": "cpu", "model": "m", "prompts_per_dataset": 20, "max_tokens": 256,
                  "weights_bytes_per_step": 1, "warmup_s": {"ar": 0.5, "ddtree": 1.25}, "rows": [row], "mean": []})
    printed = capsys.readouterr().out
    assert "prompt 3 differs from ar at token 117" in printed and "prompt 4" in printed
    assert printed.splitlines()[1].endswith("ar 0.50 s, ddtree 1.25 s")  # what the untimed warm-up cost
    assert printed.splitlines()[3].split()[-1] == "7"  # the AR steps column
