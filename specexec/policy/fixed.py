"""The fixed budget: one arm every step, and the step costs the tree's early stop weighs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specexec.policy.config import DEFAULT, PolicyConfig
from specexec.policy.curves import ema
from specexec.steps.record import Arm, StepInfo
from specexec.steps.rules import GrowCost


@dataclass
class StepCosts:
    """Running costs of fixed-budget steps for the draft's early stop: seconds per draft pass, and the target's
    verification seconds by arm (EMAs of what the steps took). No estimate before an arm's first step."""

    pass_s: float | None = None
    target_s: dict[Arm, float] = field(default_factory=dict)
    acc_scale: float = 1.0  # EMA of emitted / predicted (1 + sum of the tree's path probabilities) tokens
    config: PolicyConfig = DEFAULT

    def grow_cost(self, arm: Arm) -> GrowCost | None:
        t = self.target_s.get(arm)
        return None if self.pass_s is None or t is None else GrowCost(self.pass_s, t, self.acc_scale)

    def update(
        self, arm: Arm, draft_s: float, passes: int, target_s: float, predicted: float = 0.0, emitted: int = 0
    ) -> None:
        c = self.config
        if predicted > 0:
            # unclamped: the ratio lies within the tree's bounds (1 to depth + 1 against 1 to depth + 1)
            self.acc_scale = ema(self.acc_scale, emitted / max(predicted, 1.0), c.alpha)
        if passes > 0 and draft_s > 0:
            per = draft_s / passes
            self.pass_s = per if self.pass_s is None else ema(self.pass_s, per, c.alpha)
        old = self.target_s.get(arm)
        self.target_s[arm] = target_s if old is None else ema(old, target_s, c.alpha)


@dataclass
class FixedBudget:
    """Always ``arm``; measures the step costs so the tree's early stop can weigh a draft pass."""

    arm: Arm
    costs: StepCosts = field(default_factory=lambda: StepCosts())
    max_depth: int = 32

    def choose(self, left: int | None = None, lag: int = 0) -> Arm:
        return self.arm

    def grow_cost(self, arm: Arm) -> GrowCost | None:
        return self.costs.grow_cost(arm)

    def trim_rule(self) -> None:
        return None  # a fixed budget is what the user asked for

    def update(self, step: StepInfo) -> None:
        predicted = min(1.0 + sum(math.exp(x) for x in step.tree_logp), self.max_depth + 1.0) if step.tree_logp else 0.0
        draft_s = step.draft_s - step.catch_up_s
        self.costs.update(step.arm, draft_s, step.passes, step.target_s, predicted, step.emitted)
