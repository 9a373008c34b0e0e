"""The budget policy protocol: what the decode loop asks of a policy each step."""

from __future__ import annotations

from typing import Protocol

from specexec.steps.record import Arm, StepInfo
from specexec.steps.rules import ChainStop, GrowCost, Trim


class BudgetPolicy(Protocol):
    def choose(self, left: int | None = None, lag: int = 0) -> Arm:
        """The next step's arm (its proposal's kind and size). ``left``: tokens the generation may still emit
        (None: unknown); ``lag``: committed tokens the draft has yet to read (what a draft step would first spend
        catching up on)."""
        ...

    def grow_cost(self, arm: Arm) -> GrowCost | ChainStop | None:
        """The early stop's costs for a proposal of ``arm`` (None: none known, grow it whole)."""
        ...

    def trim_rule(self) -> Trim | None:
        """Which of the next proposal's nodes are worth verifying (None: all of them)."""
        ...

    def update(self, step: StepInfo) -> None:
        """What the step the last :meth:`choose` sized did."""
        ...
