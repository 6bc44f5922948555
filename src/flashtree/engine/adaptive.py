"""How much a speculative request speculates: the tree budget of each of its steps, from the acceptance
measured on the request itself against what a step costs (`StepCost`, in autoregressive steps).

A step at budget b pays while the tokens it commits exceed its cost c(b) in AR steps. The policy leaves
a paying budget alone (the trees the request asked for). When the last WINDOW steps at the current
budget did not pay, it moves to the rung of the ladder B, B/2, B/4, ..., 1 that those same steps say
would have paid best (a tree of b nodes commits at most b + 1 tokens, so a step that committed n would
have committed min(n, b + 1)), or, when none would have paid, to AR steps (budget 0). Away from the
configured budget it stays for a backoff of steps, then probes the configured budget again; each probe
that fails doubles the backoff, so a request on which speculation never pays spends a shrinking share
of its steps on probes, and one whose text turns predictable gets its trees back.

What a step costs is measured where the loop times its steps: the configured `StepCost` is the prior, and
once both an AR step and a speculative step have been timed (each shape's first step, which may compile
or capture a graph, is left out; an engine's requests share the times) the measured ratio scales it.
When WINDOW steps have been timed and no AR step has, the policy runs CALIBRATION AR steps to time one
(an engine's first request only), so that a device where a tree step costs far more than the prior
says (a small model on a GPU) falls back to AR all the same.

Output does not depend on the budget: every step, AR or speculative, commits the target's own tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from flashtree.engine.config import GenerationConfig, StepCost

WINDOW = 8  # steps at one budget averaged before a decision (the demo pair's acceptance swings from 1 to 16)
FIRST_BACKOFF = 16  # steps away from the configured budget before the first probe back
MAX_BACKOFF = 256  # the longest stretch between probes
CALIBRATION = 3  # AR steps run to time one when none has been (the first is a warm-up, left out)
TIMED = 8  # the most recent step times kept per budget


@dataclass
class SpeculationHistory:
    """What an engine's requests learn and hand on (ModelRunner.speculation): step times per budget (0: AR)
    and where the last request's policy left off, so that the next request of the same workload starts
    there instead of re-learning it (a small model on a GPU starts in AR steps, probing as before)."""

    times: dict[int, list[float]] = field(default_factory=dict)
    budget: int | None = None  # the last request's budget at its end
    backoff: int | None = None  # and its probe backoff
    steps_away: int = 0  # and its steps since the configured budget was left: the next probe is due across
    # requests (requests shorter than the backoff would otherwise never probe again)


def budget_ladder(budget: int) -> tuple[int, ...]:
    """The budgets the policy moves between: `budget` halved down to 1. Few, since each is a step shape of
    its own (a CUDA graph each)."""
    rungs = [budget]
    while rungs[-1] > 1:
        rungs.append(rungs[-1] // 2)
    return tuple(rungs)


class FixedBudget:
    """Every step at the configured budget (adaptive off)."""

    def __init__(self, budget: int):
        self.budget = budget

    def record(self, committed: int, now: float | None = None, captures: int = 0) -> None:
        pass


class AdaptiveBudget:
    """`budget`: the budget of the next step (0: an AR step); `record(committed)` after each step."""

    def __init__(self, budget: int, cost: StepCost, window: int = WINDOW, first_backoff: int = FIRST_BACKOFF,
                 max_backoff: int = MAX_BACKOFF, history: SpeculationHistory | None = None):
        self.ladder = budget_ladder(budget)
        self.cost = cost
        self.window = window
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.history = history or SpeculationHistory()
        resumable = self.history.budget is not None and self.history.budget in (*self.ladder, 0)
        self.budget = self.history.budget if resumable else budget
        # steps away from the configured budget before the next probe
        self.backoff = self.history.backoff if resumable else first_backoff
        self.steps_away = self.history.steps_away if resumable else 0  # steps since the configured budget was left
        self.probing = False  # back at the configured budget after a backoff, not yet shown to pay
        self.recent: list[int] = []  # tokens committed by the steps at `budget` since the last decision
        self.times = self.history.times  # seconds of recent steps per budget (0: AR), warm-ups left out
        self.calibrating = 0  # AR steps left to run for timing before going back to `resume`
        self.resume = budget
        self.last: float | None = None  # the clock at the previous record
        self.last_captures = 0  # and the graphs captured by then

    def record(self, committed: int, now: float | None = None, captures: int = 0) -> None:
        """After a step at `self.budget`: the tokens it committed (an AR step: 1) and, where the loop times
        its steps, the clock (`time.perf_counter()`): a step's time runs from the previous record to this
        one, so that it holds all of the step's work (its commit, output, and the device's queue).
        `captures`: CUDA graphs captured so far (`CapturedSteps.captures`); a step in which one was
        captured is not timed: a capture costs 10-100 steps, and a chain's commits capture one graph per
        path length (the demo pair on an H200, 2026-12-01, timed such steps and left chain mode for AR)."""
        self._record(committed, now, captures)
        if not self.calibrating:  # a calibration is the engine's business once, not the next request's start
            self.history.budget, self.history.backoff = self.budget, self.backoff
            self.history.steps_away = self.steps_away

    def _record(self, committed: int, now: float | None, captures: int) -> None:
        if now is not None:
            if self.last is not None and captures == self.last_captures:
                self._time(self.budget, now - self.last)
            self.last, self.last_captures = now, captures
        if self.calibrating:
            self.calibrating -= 1
            if not self.calibrating:
                self.budget = self.resume
                self._decide()
            return
        if self.budget != self.ladder[0]:
            self.steps_away += 1
            if self.steps_away >= self.backoff:
                self._probe()
                return
        if self.budget == 0:
            return
        self.recent.append(committed)
        if len(self.recent) < self.window:
            return
        if self.times and 0 not in self.times:  # steps are timed, but no AR step yet: time some first
            self.calibrating, self.resume, self.budget = CALIBRATION, self.budget, 0
            return
        self._decide()

    def _decide(self) -> None:
        """The recent steps at `budget` paid (keep it) or not (leave it)."""
        if self.rate(self.budget) >= 1:
            if self.budget == self.ladder[0]:  # the configured budget pays again: the next failure is a fresh one
                self.probing, self.backoff = False, self.first_backoff
            self.recent = []
            return
        self._leave()

    def rate(self, budget: int) -> float:
        """Tokens per AR step's cost that steps of `budget` would have given on the recent steps (AR: 1)."""
        if budget == 0:
            return 1.0
        committed = sum(min(n, budget + 1) for n in self.recent) / len(self.recent)
        return committed / self.cost_of(budget)

    def cost_of(self, budget: int) -> float:
        """A step of `budget` in AR steps: the prior, scaled by what the timed steps measured."""
        ar = self._mean(0)
        measured = [(b, self._mean(b) / ar) for b in self.times if b and ar and self._mean(b)]
        if not measured:
            return self.cost.of(budget)
        scale = sum(ratio / self.cost.of(b) for b, ratio in measured) / len(measured)
        return self.cost.of(budget) * scale

    def _time(self, budget: int, seconds: float) -> None:
        if budget not in self.times:  # a shape's first step may compile or capture a graph: not timed
            self.times[budget] = []
            return
        self.times[budget] = (self.times[budget] + [seconds])[-TIMED:]

    def _mean(self, budget: int) -> float | None:
        times = self.times.get(budget)
        return sum(times) / len(times) if times else None

    def _leave(self) -> None:
        """The current budget does not pay: the smaller rung that would have paid best, else AR steps."""
        if self.budget == self.ladder[0]:
            if self.probing:
                self.backoff = min(2 * self.backoff, self.max_backoff)
            self.probing, self.steps_away = False, 0
        smaller = [b for b in self.ladder if b < self.budget] + [0]
        self.budget = max(smaller, key=self.rate)  # the first, largest, of equals
        self.recent = []

    def _probe(self) -> None:
        self.budget, self.probing, self.recent = self.ladder[0], True, []


def step_clock() -> Callable[[], float] | None:
    """What the loop times its steps with: none under torch.distributed (tensor parallel), whose ranks run
    the same loop in lock step and must take the same budget at every step; the tokens a step accepts are
    the same on every rank, its time is not, so there the policy weighs acceptance against the prior."""
    return None if dist.is_available() and dist.is_initialized() else time.perf_counter


def budget_policy(config: GenerationConfig, history: SpeculationHistory | None = None) -> AdaptiveBudget | FixedBudget:
    """The policy of a speculative request: adaptive unless `config.adaptive` is off, starting from what the
    engine's earlier requests at the same budget learnt (`history`)."""
    if config.adaptive:
        return AdaptiveBudget(config.budget, config.step_cost, history=history)
    return FixedBudget(config.budget)
