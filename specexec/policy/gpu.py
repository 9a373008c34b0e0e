"""The GPU's cost model (``--budget auto`` on a GPU): the tree budget with the best expected tokens/s."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specexec.policy.config import DEFAULT, PolicyConfig
from specexec.policy.curves import ema, interp
from specexec.steps.record import Arm, StepInfo
from specexec.steps.rules import GrowCost


@dataclass
class AutoBudget:
    """Chooses the next step's tree budget from the cost model; ``update`` feeds back what the step did."""

    target_s: dict[int, float]  # measured target pass seconds by tokens in the pass
    draft_pass_s: dict[int, float]  # measured draft pass seconds by tokens (beams) in the pass
    max_beams: int
    max_depth: int
    max_budget: int = 2048
    budget: int = 64  # current choice (a tree's nodes)
    config: PolicyConfig = DEFAULT
    grid: tuple[int, ...] = ()  # the budgets chosen among (default: the config's gpu_grid)
    _curve: list[float] = field(default_factory=list)  # E[emitted | b] for b = 1..B of the last tree
    _passes: dict[int, float] = field(default_factory=dict)  # EMA of draft passes per tree, by budget
    _target_scale: float = 1.0  # EMA of actual / measured (at start-up) target time
    _draft_scale: float = 1.0
    _acc_scale: float = 1.0  # EMA of actual / predicted emitted tokens
    history: list[int] = field(default_factory=list)  # the budgets chosen

    def __post_init__(self) -> None:
        grid = self.grid or self.config.gpu_grid
        self.grid = tuple(b for b in grid if b <= self.max_budget) or (self.max_budget,)
        self.budget = min(self.budget, self.grid[-1])

    # -- model ----------------------------------------------------------------------------------------------
    def expected_emitted(self, b: int) -> float:
        """E[tokens emitted per step | budget b] under the current curve and correction."""
        if not self._curve:
            raw = 1.0 + self.config.prior_slope * math.log2(1 + b)  # prior before any tree: a typical curve
        else:
            B = len(self._curve)
            if b <= B:
                raw = self._curve[b - 1]
            else:  # extrapolate: each further doubling adds the last doubling's gain
                last_gain = self._curve[B - 1] - self._curve[max(B // 2, 1) - 1]
                raw = self._curve[B - 1] + last_gain * math.log2(b / B)
        est = 1.0 + self._acc_scale * (raw - 1.0)
        return min(est, self.max_depth + 1.0)

    def step_seconds(self, b: int) -> float:
        passes = self._passes.get(b)
        if passes is None:
            passes = min(self.max_depth, 1 + math.ceil(math.log2(1 + b)) + b // self.max_beams)
        beams = min(b, self.max_beams)
        draft = passes * interp(self.draft_pass_s, beams) * self._draft_scale
        target = interp(self.target_s, b + 1) * self._target_scale
        return draft + target

    def grow_cost(self, arm: Arm) -> GrowCost:
        """Costs of a step of ``arm`` (a tree) for the draft's early stop (measured at start-up, corrected
        online)."""
        b = arm.size
        return GrowCost(
            pass_s=interp(self.draft_pass_s, min(b, self.max_beams)) * self._draft_scale,
            target_s=interp(self.target_s, b + 1) * self._target_scale,
            acc_scale=self._acc_scale,
        )

    def rate(self, b: int) -> float:
        return self.expected_emitted(b) / self.step_seconds(b)

    def trim_rule(self) -> None:
        return None  # a streamed verifier costs the same for any tree up to the budget

    # -- decisions ------------------------------------------------------------------------------------------
    def choose(self, left: int | None = None, lag: int = 0) -> Arm:
        """The best grid budget, moving up at most one doubling from the current budget; every
        ``explore_every`` steps the one above it instead, while no step has measured that one."""
        every = self.config.explore_every
        cap = self.budget * 2
        options = [b for b in self.grid if b <= cap] or [self.grid[0]]
        best = max(options, key=self.rate)
        up = next((b for b in self.grid if b > best), None)
        if up is not None and up not in self._passes and len(self.history) % every == every - 1:
            best = up
        self.budget = best
        self.history.append(best)
        return Arm.nodes(best)

    def update(self, step: StepInfo) -> None:
        """Feed back one step: the tree's cumulative draft log-probs (non-root), tokens emitted, times."""
        c = self.config
        budget, tree_logp, emitted = step.arm.size, step.tree_logp, step.emitted
        draft_s, target_s, passes = step.draft_s - step.catch_up_s, step.target_s, step.passes
        probs = sorted((math.exp(x) for x in tree_logp), reverse=True)
        curve, acc = [], 1.0
        for p in probs:
            acc += p
            curve.append(acc)
        if curve:
            # a bigger tree's curve is more informative; a smaller one replaces it only at the head
            self._curve = curve + self._curve[len(curve) :] if len(curve) < len(self._curve) else curve
            predicted = min(curve[-1], self.max_depth + 1.0)
            # no clamp: a step's ratio lies within the tree's own bounds (1 to depth + 1 tokens against a
            # prediction of 1 to depth + 1), and so does its EMA
            self._acc_scale = ema(self._acc_scale, emitted / max(predicted, 1.0), c.alpha)
        self._passes[budget] = ema(self._passes.get(budget, passes), passes, c.alpha)
        prior_t = interp(self.target_s, budget + 1)
        self._target_scale = ema(self._target_scale, target_s / prior_t, c.alpha)
        prior_d = self._passes[budget] * interp(self.draft_pass_s, min(budget, self.max_beams))
        if prior_d > 0 and draft_s > 0:
            self._draft_scale = ema(self._draft_scale, draft_s / prior_d, c.alpha)
