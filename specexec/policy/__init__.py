"""The step-size policies: which arm (:class:`~specexec.steps.record.Arm`: plain decoding, a draft chain, a draft
tree, a head tree, with its size) the next step proposes, and what a draft pass is worth.

A policy answers four calls each step (:class:`BudgetPolicy`): ``choose()`` the arm, ``grow_cost(arm)`` the costs
the proposer's early stop weighs, ``trim_rule()`` which proposal nodes are worth verifying (the proposer trims its
own tree; the rules are in :mod:`specexec.steps.rules`), and ``update(step)`` what the step did. Any arm is
verified exactly: a policy moves speed only, never the output. Every number a policy decides by is a field of
:class:`PolicyConfig` (:data:`DEFAULT`); an engine keeps its policies' measurements in one :class:`PolicyState`.

**Fixed** (:class:`FixedBudget`): the same arm every step; it measures the step costs so the tree's early stop can
weigh a draft pass.

**The GPU's cost model** (:class:`AutoBudget`, ``--budget auto`` on a GPU): the tree budget of the grid with the
best expected rate, tokens/s(b) = E[emitted | b] / (draft_s(b) + target_s(b)). The costs come from a start-up
measurement (:func:`measure_costs`: target passes at a few tree sizes, draft passes at a few beam counts; cached
per machine, code and model pair, measured again when the steps' costs drift from it by more than ``drift``),
corrected online by the times the steps took. E[emitted | b] ≈ 1 + the sum of the b largest path probabilities
exp(logp_i) of the last tree (SpecExec §3; before any tree, 1 + ``prior_slope`` · log2(1 + b)), extrapolated beyond
its size by the last doubling's gain per doubling, and scaled by the running ratio of actual to predicted tokens (the
draft's over- or under-confidence; unclamped: the tree's own bounds hold it). The budget moves up at most one
doubling a step, and every ``explore_every`` steps the budget above the best is tried once while no step has measured
it. Every running measurement is an EMA of rate ``alpha``. Each of these numbers is ablated in a simulation
(``python -m tests.decoding.gpu_sim --ablate``).

**The CPU's measured-rate choice** (:class:`AdaptiveBudget`, ``--budget auto`` on a CPU, ``--draft heads``, the
n-gram method's auto tries). On a compute-bound verifier a bigger tree costs more to verify and a draft pass costs
a good share of a target pass, so the best arm depends on the machine and the text. Its rules:

- **Plain decoding leads** unless another arm's rate beats it by ``margin``, a draft's catch-up on the tokens it
  has not read spread over the rest of the answer. Plain decoding's rate is never taken below a one-row
  verification's (a missed prompt-lookup bet must not make plain decoding look slow).
- **Rates are measured** per arm on the current text: EMAs (rate ``alpha``) of its step seconds and tokens. An
  untried chain or head tree is rated by its kind's acceptance on this text (Laplace's rule over its drafted
  tokens), its proposal seconds and the verification curve, so one measured chain ranks every chain length.
- **Every bet is paid from one loss budget**: first tries, explorations and prompt-lookup bets. What they lose
  (seconds beyond what the best other arm, or one-row plain steps, would have taken for their tokens; an explored
  draft's catch-up) stays within ``loss_share`` of the answer's expected time at plain decoding's rate; a lookup
  hit's gain credits it. A lookup bet may add no more rows' seconds than the budget has left.
- **An arm is tried or explored** only if it could lead with every drafted token accepted and its worst step
  (one token, its catch-up first) fits the budget. The first untried arm of each kind is tried once the best arm
  has two steps; every ``explore_every`` steps the arm explored longest ago runs once, and an exploration that
  loses doubles that arm's wait before the next.
- **A new text forgets** what the arms yielded, their waits and the acceptance models; the cost curves stay.

The verification curve (:class:`VerifyCosts`) is the start-up measurement, scaled by the median ratio of what the
steps measured to it, and the EMAs (rate ``alpha``) of the sizes steps verified.

Proposals are trimmed by value (:class:`~specexec.steps.rules.Trim`): a second of verification is worth the
measured tokens/s.
"""

from specexec.policy.base import BudgetPolicy
from specexec.policy.cache import code_version, costs_key, drifted, load_costs, save_costs
from specexec.policy.config import DEFAULT, PolicyConfig
from specexec.policy.cpu import AdaptiveBudget, VerifyCosts
from specexec.policy.curves import VERIFY_SIZES, interp, measure_costs
from specexec.policy.fixed import FixedBudget, StepCosts
from specexec.policy.gpu import AutoBudget
from specexec.policy.state import PolicyState

__all__ = [
    "DEFAULT",
    "VERIFY_SIZES",
    "AdaptiveBudget",
    "AutoBudget",
    "BudgetPolicy",
    "FixedBudget",
    "PolicyConfig",
    "PolicyState",
    "StepCosts",
    "VerifyCosts",
    "code_version",
    "costs_key",
    "drifted",
    "interp",
    "load_costs",
    "measure_costs",
    "save_costs",
]
