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

Output does not depend on the budget: every step, AR or speculative, commits the target's own tokens.
"""

from __future__ import annotations

from flashtree.engine.config import GenerationConfig, StepCost

WINDOW = 8  # steps at one budget averaged before a decision (the demo pair's acceptance swings from 1 to 16)
FIRST_BACKOFF = 16  # steps away from the configured budget before the first probe back
MAX_BACKOFF = 256  # the longest stretch between probes


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

    def record(self, committed: int) -> None:
        pass


class AdaptiveBudget:
    """`budget`: the budget of the next step (0: an AR step); `record(committed)` after each step."""

    def __init__(self, budget: int, cost: StepCost, window: int = WINDOW, first_backoff: int = FIRST_BACKOFF,
                 max_backoff: int = MAX_BACKOFF):
        self.ladder = budget_ladder(budget)
        self.cost = cost
        self.window = window
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.budget = budget
        self.backoff = first_backoff  # steps away from the configured budget before the next probe
        self.steps_away = 0  # steps since the configured budget was left
        self.probing = False  # back at the configured budget after a backoff, not yet shown to pay
        self.recent: list[int] = []  # tokens committed by the steps at `budget` since the last decision

    def record(self, committed: int) -> None:
        """After a step at `self.budget`: the tokens it committed (an AR step: 1)."""
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
        return committed / self.cost.of(budget)

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


def budget_policy(config: GenerationConfig) -> AdaptiveBudget | FixedBudget:
    """The policy of a speculative request: adaptive unless `config.adaptive` is off."""
    if config.adaptive:
        return AdaptiveBudget(config.budget, config.step_cost)
    return FixedBudget(config.budget)
