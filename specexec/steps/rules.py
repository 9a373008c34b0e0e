"""What a draft pass and a verified token are worth: the rules a proposer weighs while it builds a step's proposal.

The budget policy (:mod:`specexec.policy`) measures the costs and hands these rules to the proposer through
:class:`~specexec.steps.proposal.StepContext`; the proposer applies them to its own tree. This module imports neither
side, so both can import it.

All three rules compare a step's expected tokens E with its seconds T: E = 1 + the sum of the proposal's path
probabilities (SpecExec §3), scaled by ``acc_scale``, the measured ratio of actual to predicted tokens (the draft's
over- or under-confidence). Any proposal is verified exactly, so the rules only move speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# a draft this many committed tokens behind reads them in a pass of its own before its proposal (timed apart, so a
# CPU's policy can tell a catch-up from the proposal); fewer ride in the root's pass
CATCH_UP_ROWS = 4


def catch_up_s(lag: int, draft_s: Callable[[int], float]) -> float:
    """Seconds a draft ``lag`` tokens behind spends reading them before its proposal, from its pass seconds by rows
    (``draft_s``): a pass of its own from :data:`CATCH_UP_ROWS` tokens, else the root pass's extra rows."""
    if lag <= 0:
        return 0.0
    if lag >= CATCH_UP_ROWS:
        return draft_s(lag)
    return max(draft_s(lag + 1) - draft_s(1), 0.0)


@dataclass
class GrowCost:
    """A tree's early stop: with a step costing T = passes * pass_s + target_s, one more draft pass that adds g
    expected tokens is worth it iff (E + g) / (T + pass_s) >= E / T, i.e. g * T >= E * pass_s. g is bounded by the
    path-probability mass of the nodes the pass would expand (their children's mass can never exceed it); growth
    stops only when even that bound is not worth a pass."""

    pass_s: float  # seconds per draft pass
    target_s: float  # seconds of the target's verification of a tree of this budget
    acc_scale: float = 1.0  # actual / predicted tokens per step

    def more(self, expected: float, gain: float, passes: int) -> bool:
        """Run one more draft pass? ``expected``: E[emitted] of the tree now; ``gain``: the pass's predicted
        gain in E; ``passes``: passes run so far."""
        e = 1.0 + self.acc_scale * (expected - 1.0)
        return self.acc_scale * gain * (passes * self.pass_s + self.target_s) >= e * self.pass_s


@dataclass
class ChainStop:
    """A chain's per-token stop, :class:`GrowCost`'s rule applied to a chain. After n tokens with path probability p
    and last conditional probability q, one more pass costs ``pass_s`` plus the verification of one more token
    (``verify_s`` is seconds by verified size) and is expected to add ``acc_scale * p * q`` tokens (q, the draft's
    confidence in its last token, predicts its next: confident stretches of code run long, an uncertain word ends
    the chain). Continue iff gain * T >= E * cost, with E the expected emitted tokens now and T the step's seconds
    now."""

    pass_s: float  # seconds per draft pass
    verify_s: list[float]  # verify_s[k] = seconds to verify k + 1 tokens
    acc_scale: float = 1.0  # actual / predicted tokens

    def more(self, logps: list[float], passes: int, covered: float = 0.0) -> bool:
        """One more draft pass after the chain's tokens so far (``logps``: their cumulative log-probabilities)?
        ``covered``: the chance that the token this pass would add is proposed anyway (an n-gram continuation of
        the chain, merged in after it): only the rest of the pass's expected token is its gain."""
        n = len(logps)
        if n + 1 >= len(self.verify_s):  # no cost known for a longer chain
            return False
        p = math.exp(logps[-1])
        q = math.exp(logps[-1] - (logps[-2] if n > 1 else 0.0))
        expected = 1.0 + self.acc_scale * sum(math.exp(x) for x in logps)
        seconds = passes * self.pass_s + self.verify_s[n]
        cost = self.pass_s + self.verify_s[n + 1] - self.verify_s[n]
        return self.acc_scale * p * q * (1.0 - covered) * seconds >= expected * cost


@dataclass(frozen=True)
class Trim:
    """Which of a proposal's nodes are worth their verification time on a compute-bound verifier (a CPU): the k most
    probable, with k maximising the step's net value  sum_{i<k} p_i - rate * verify_s(k + 1), p_i a node's chance of
    being accepted (its path probability, scaled by ``acc_scale``). A long tail of unlikely nodes (e.g. weak n-gram
    matches) costs more than it returns there; k = 0 is a plain AR step."""

    rate: float  # measured tokens/s: what a second of verification is worth elsewhere
    verify_s: Callable[[int], list[float]]  # n -> seconds to verify 1..n tokens
    acc_scale: float = 1.0  # actual / predicted tokens per step
    # the most seconds the kept nodes may add to a one-row step's verification: what the step may lose if the
    # target takes none of them (an estimate of their chances, however measured, can be wrong for a new text)
    max_extra_s: float = math.inf

    def keep(self, logp: Tensor) -> int:
        """How many of the nodes with path log-probs ``logp`` (N,) to verify (N: keep them all), within
        ``max_extra_s``."""
        n = logp.shape[0]
        if n == 0:
            return 0
        probs = torch.sort(logp, descending=True).values.exp().mul_(self.acc_scale)
        gains = [0.0, *torch.cumsum(probs, 0).tolist()]
        cost = self.verify_s(n + 1)  # cost[k] = seconds to verify k + 1 tokens
        best_k, best_v = n, -math.inf
        for k in range(n + 1):
            if k and cost[k] - cost[0] > self.max_extra_s:
                break
            v = gains[k] - self.rate * cost[k]
            if v > best_v + 1e-12:
                best_k, best_v = k, v
        return best_k
