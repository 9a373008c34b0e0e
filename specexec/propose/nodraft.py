"""The empty proposal: the root alone, i.e. plain autoregressive decoding through the same loop."""

from __future__ import annotations

from specexec.steps.proposal import Proposal, StepContext
from specexec.steps.tree import Tree


class NoDraft:
    name = "ar"

    def __init__(self, device) -> None:
        self.device = device

    def begin(self, seq: list[int]) -> None:
        pass

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        return Proposal(Tree(seq[-1], 1, self.device), source=self.name)

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        pass
