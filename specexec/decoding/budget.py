"""The budget policy: how many tokens the next proposal may hold, and what a draft pass is worth.

One object per generation answers ``choose()`` (the next step's size), ``grow_cost(b)`` (the costs the proposal's
early stop weighs), ``trim_rule()`` (which proposal nodes are worth verifying; the proposer trims its own tree) and
``update(step)`` (what the step did). The rules themselves are in :mod:`specexec.decoding.costs`.
:class:`FixedBudget` keeps one size and measures its costs; :class:`AdaptiveBudget` (a CPU's ``--budget auto``)
picks among a few sizes by measured tokens/s; :class:`AutoBudget` (a GPU's) picks the size with the best expected
tokens/s:

    tokens/s(b) = E[emitted | b] / (draft_s(b) + target_s(b))

Costs come from a quick start-up measurement (:func:`measure_costs`: a few target passes at a few tree sizes, a few
draft passes at a few beam counts; cached per machine and model pair), corrected online by the times each step
actually took. Acceptance comes from the trees themselves: for a best-first tree, the chance that the target's path
runs through node i is estimated by the draft's probability of that path, exp(logp_i) (SpecExec, §3), so
E[emitted | b] ≈ 1 + sum of the b largest exp(logp_i). The tree of the current budget B gives that curve for every
b ≤ B; beyond B it is extrapolated from the curve's last doubling (damped). A correction factor, the running ratio
of actual to predicted accepted tokens, absorbs the draft's over- or under-confidence. The budget moves at most ×2
up per step, so exploration is cheap, and any budget is exact: only speed depends on the choice.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from specexec.decoding.costs import ChainStop, GrowCost, Trim, catch_up_s

if TYPE_CHECKING:
    from specexec.decoding.loop import StepInfo

log = logging.getLogger(__name__)

GRID = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# arms of the measured-rate policy from here up are head trees: HEADS_ARM + b proposes b nodes from the target's
# trained heads (:mod:`specexec.propose.heads`), no draft pass
HEADS_ARM = 1 << 20


def arm_kind(arm: int) -> str:
    """What a proposal size asks for: ``plain`` (0: no draft pass; the n-gram trie or plain decoding), ``chain``
    (-g: g draft tokens in a row), ``tree`` (b > 0: a draft tree of b nodes) or ``heads`` (HEADS_ARM + b)."""
    return "plain" if arm == 0 else "chain" if arm < 0 else "heads" if arm >= HEADS_ARM else "tree"


def arm_label(arm: int) -> str:
    """A proposal size as users read it: ``-3``, ``0``, ``8``, ``heads:4``."""
    return f"heads:{arm - HEADS_ARM}" if arm >= HEADS_ARM else str(arm)


def arm_json(arm: int | None) -> int | str | None:
    """A proposal size in JSON: the number, or ``"heads:b"`` for a head tree."""
    return arm_label(arm) if arm is not None and arm >= HEADS_ARM else arm


def interp(points: dict[int, float], x: float) -> float:
    """Piecewise-linear interpolation over measured (size → seconds), linear extrapolation at the ends."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if x <= xs[0]:
        i = 1
    elif x >= xs[-1]:
        i = len(xs) - 1
    else:
        i = bisect.bisect_left(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-6)


class BudgetPolicy(Protocol):
    def choose(self, left: int | None = None, lag: int = 0) -> int:
        """The next step's proposal size (0: no draft; b > 0: a tree of b tokens; -g: a chain of g tokens).
        ``left``: tokens the generation may still emit (None: unknown); ``lag``: committed tokens the draft has
        yet to read (what a draft step would first spend catching up on)."""
        ...

    def grow_cost(self, budget: int) -> GrowCost | ChainStop | None:
        """The early stop's costs for a proposal of ``budget`` (None: none known, grow it whole)."""
        ...

    def trim_rule(self) -> Trim | None:
        """Which of the next proposal's nodes are worth verifying (None: all of them)."""
        ...

    def update(self, step: StepInfo) -> None:
        """What the step the last :meth:`choose` sized did."""
        ...


@dataclass
class FixedBudget:
    """Always ``budget``; measures the step costs so the tree's early stop can weigh a draft pass."""

    budget: int
    costs: StepCosts = field(default_factory=lambda: StepCosts())
    max_depth: int = 32

    def choose(self, left: int | None = None, lag: int = 0) -> int:
        return self.budget

    def grow_cost(self, budget: int) -> GrowCost | None:
        return self.costs.grow_cost(budget)

    def trim_rule(self) -> None:
        return None  # a fixed budget is what the user asked for

    def update(self, step: StepInfo) -> None:
        predicted = min(1.0 + sum(math.exp(x) for x in step.tree_logp), self.max_depth + 1.0) if step.tree_logp else 0.0
        draft_s = step.draft_s - step.catch_up_s
        self.costs.update(step.budget, draft_s, step.passes, step.target_s, predicted, step.emitted)


@dataclass
class AutoBudget:
    """Chooses the next step's budget; ``update`` feeds back what the step did."""

    target_s: dict[int, float]  # measured target pass seconds by tokens in the pass
    draft_pass_s: dict[int, float]  # measured draft pass seconds by tokens (beams) in the pass
    max_beams: int
    max_depth: int
    max_budget: int = 2048
    budget: int = 64  # current choice
    grid: tuple[int, ...] = field(default=GRID)
    # every this many steps, the grid budget above the best one is tried once if no step has measured it yet:
    # beyond the largest tree grown, the acceptance curve is a damped extrapolation and the draft passes a prior,
    # and both can keep a bigger budget from ever being chosen (simulated with a streamed verifier's flat costs:
    # stuck at 512 of a best 2048, tests/test_budget.py); one step at twice the budget measures both
    explore_every: int = 8
    _curve: list[float] = field(default_factory=list)  # E[emitted | b] for b = 1..B of the last tree
    _passes: dict[int, float] = field(default_factory=dict)  # EMA of draft passes per tree, by budget
    _target_scale: float = 1.0  # EMA of actual / measured (at start-up) target time
    _draft_scale: float = 1.0
    _acc_scale: float = 1.0  # EMA of actual / predicted emitted tokens
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.grid = tuple(b for b in self.grid if b <= self.max_budget) or (self.max_budget,)
        self.budget = min(self.budget, self.grid[-1])

    # -- model ----------------------------------------------------------------------------------------------
    def expected_emitted(self, b: int) -> float:
        """E[tokens emitted per step | budget b] under the current curve and correction."""
        if not self._curve:
            raw = 1.0 + 1.2 * math.log2(1 + b)  # prior before any tree: a typical acceptance curve
        else:
            B = len(self._curve)
            if b <= B:
                raw = self._curve[b - 1]
            else:  # extrapolate: each further doubling adds a damped share of the last doubling's gain
                last_gain = self._curve[B - 1] - self._curve[max(B // 2, 1) - 1]
                raw, g = self._curve[B - 1], last_gain
                size = B
                while size < b:
                    g *= 0.7
                    raw += g * min(1.0, math.log2(b / size))
                    size *= 2
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

    def grow_cost(self, b: int) -> GrowCost:
        """Costs of a budget-b step for the draft's early stop (measured at start-up, corrected online)."""
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
    def choose(self, left: int | None = None, lag: int = 0) -> int:
        """The best grid budget, moving up at most one doubling from the current budget; every
        ``explore_every`` steps the one above it instead, while no step has measured that one."""
        cap = self.budget * 2
        options = [b for b in self.grid if b <= cap] or [self.grid[0]]
        best = max(options, key=self.rate)
        up = next((b for b in self.grid if b > best), None)
        if (
            up is not None
            and up not in self._passes
            and len(self.history) % self.explore_every == self.explore_every - 1
        ):
            best = up
        self.budget = best
        self.history.append(best)
        return best

    def update(self, step: StepInfo) -> None:
        """Feed back one step: the tree's cumulative draft log-probs (non-root), tokens emitted, times."""
        budget, tree_logp, emitted = step.budget, step.tree_logp, step.emitted
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
            self._acc_scale = _ema(self._acc_scale, emitted / max(predicted, 1.0), 0.2)
            # keep the correction within reason: one lucky step should not explode the budget
            self._acc_scale = min(max(self._acc_scale, 0.2), 5.0)
        self._passes[budget] = _ema(self._passes.get(budget, passes), passes, 0.3)
        prior_t = interp(self.target_s, budget + 1)
        self._target_scale = _ema(self._target_scale, target_s / prior_t, 0.3)
        prior_d = self._passes[budget] * interp(self.draft_pass_s, min(budget, self.max_beams))
        if prior_d > 0 and draft_s > 0:
            self._draft_scale = _ema(self._draft_scale, draft_s / prior_d, 0.3)


@dataclass
class StepCosts:
    """Running costs of fixed-budget steps for the draft's early stop: seconds per draft pass, and the target's
    verification seconds by budget (EMAs of what the steps took). No estimate before a budget's first step."""

    pass_s: float | None = None
    target_s: dict[int, float] = field(default_factory=dict)
    acc_scale: float = 1.0  # EMA of emitted / predicted (1 + sum of the tree's path probabilities) tokens

    def grow_cost(self, budget: int) -> GrowCost | None:
        t = self.target_s.get(budget)
        return None if self.pass_s is None or t is None else GrowCost(self.pass_s, t, self.acc_scale)

    def update(
        self, budget: int, draft_s: float, passes: int, target_s: float, predicted: float = 0.0, emitted: int = 0
    ) -> None:
        if predicted > 0:
            self.acc_scale = min(max(_ema(self.acc_scale, emitted / max(predicted, 1.0), 0.2), 0.2), 5.0)
        if passes > 0 and draft_s > 0:
            per = draft_s / passes
            self.pass_s = per if self.pass_s is None else _ema(self.pass_s, per, 0.3)
        old = self.target_s.get(budget)
        self.target_s[budget] = target_s if old is None else _ema(old, target_s, 0.3)


def _ema(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new


def measure_costs(
    time_target: Callable[[int], float], time_draft: Callable[[int], float], max_budget: int, max_beams: int
) -> tuple[dict[int, float], dict[int, float]]:
    """Measure target pass seconds at a few sizes and draft pass seconds at a few beam counts.

    Sizes grow geometrically; once a pass costs more than 3x the smallest (compute-bound, e.g. on a CPU) the
    rest is extrapolated linearly instead of measured, so the measurement stays short on slow machines.
    """
    target: dict[int, float] = {}
    for size in (1, 64, 256, 1024, 2048):
        if size > max_budget + 1 and size != 1:
            break
        target[size] = time_target(size)
        if target[size] > 3 * target[1] and size >= 64:
            break
    draft: dict[int, float] = {}
    for beams in (1, 16, 64, 128):
        if beams > max_beams and beams != 1:
            break
        draft[beams] = time_draft(beams)
    log.info("auto budget pass costs: target %s, draft %s", target, draft)
    return _monotone(target), _monotone(draft)


def _monotone(points: dict[int, float]) -> dict[int, float]:
    """Timing noise must not make a bigger pass look cheaper: running maximum over increasing sizes."""
    out, top = {}, 0.0
    for k in sorted(points):
        top = max(top, points[k])
        out[k] = top
    return out


@dataclass
class VerifyCosts:
    """The target's verification seconds by tree size (tokens in the pass, root included), for a compute-bound
    verifier. ``prior``: a short measurement at start (cached per machine); ``seconds``: EMAs of what steps measured
    at each size. A size measured online uses its EMA; any other size uses the prior's curve scaled by the median
    measured/prior ratio, so a prior taken while the machine was busy (or idle) is corrected everywhere by
    the steps, not only at the sizes the policy happens to verify. ``at(size)`` never decreases with size."""

    prior: dict[int, float] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    alpha: float = 0.2
    # the curve, kept until the next update: the policy reads it some hundred times a step (a profile of a CPU step
    # had 2-3 ms of a 50 ms step in redrawing it)
    _points: dict[int, float] | None = field(default=None, init=False, repr=False, compare=False)

    def update(self, size: int, sec: float) -> None:
        if size < 1 or sec <= 0:
            return
        old = self.seconds.get(size)
        self.seconds[size] = sec if old is None else _ema(old, sec, self.alpha)
        self._points = None

    def scale(self) -> float:
        """Median measured / prior ratio over the sizes measured online (1.0 when none)."""
        if not self.prior:
            return 1.0
        pts = _monotone(self.prior)
        ratios = sorted(v / interp(pts, k) for k, v in self.seconds.items())
        return ratios[len(ratios) // 2] if ratios else 1.0

    def known(self) -> bool:
        """Enough to draw a curve: a prior, or online measurements at two sizes or more."""
        return bool(self.prior) or len(self.seconds) >= 2

    def points(self) -> dict[int, float]:
        if self._points is None:
            scale = self.scale()
            pts = {k: v * scale for k, v in self.prior.items()}
            pts.update(self.seconds)
            self._points = _monotone(pts)
        return self._points

    def at(self, size: int) -> float | None:
        if not self.prior and not self.seconds:
            return None
        return interp(self.points(), size)

    def curve(self, sizes: int) -> list[float]:
        """Seconds at sizes 1..``sizes`` (requires a prior or a measurement)."""
        pts = self.points()
        return [interp(pts, k) for k in range(1, sizes + 1)]


@dataclass
class _Arm:
    seconds: float = 0.0  # EMA of a step's seconds (proposal + verification)
    tokens: float = 0.0  # EMA of tokens emitted per step
    n: int = 0  # steps observed
    last: int = -1  # the step it was last chosen at
    wait: int = 0  # steps between explorations of it (0: the policy's explore_every); doubles while it loses


MAX_WAIT = 128  # the most steps between two explorations of an arm that keeps losing
CHAIN_MODEL_WEIGHT = 3.0  # a chain arm's rate: its own measurement weighs n / (n + this) against the chain model
CHAIN_DECAY = 0.95  # per chain step, the weight the chain model's older counts keep
HEADS_CARRY = 4.0  # what the heads measured on earlier texts weighs in a new text's, in head steps
SHRINK_STEPS = 2.0  # a drafting arm's rate is pulled toward plain decoding's as if by this many steps of it
# a drafting arm leads only when its measured rate beats plain decoding's by this share: step times on a shared
# CPU jitter by some percent, and a tie lost to that noise costs every step after it (the draft's passes, the
# bigger verification), while a tie kept at plain decoding costs nothing
TIE_MARGIN = 0.1
# the same for a head tree: its lead costs no draft pass and no catch-up, only a step's extra rows until its next
# measurement corrects the rate, so a smaller margin keeps the heads' smaller gains (one guess accepted four
# times in ten: some 10% over plain steps where a second row costs a quarter of a first)
HEADS_TIE_MARGIN = 0.03
# what the tries and explorations of an answer may lose against the best measured arm (a draft's catch-up on the
# prompt and the steps it sat out included), as a share of the answer's expected time at plain decoding's rate:
# the most the policy may lose to plain decoding on an answer (>= 0.95x)
LOSS_SHARE = 0.05
# untried arms are tried in this order: a chain first (its draft pass's cost then bounds what every chain and tree
# could give), heads last (the draft's first try catches up on every token of the steps it sat out, so it comes
# before head runs; and where the draft is cheap its trees beat head trees: simulated, heads first lost there)
TRY_ORDER = ("plain", "chain", "tree", "heads")
DRAFT_KINDS = ("chain", "tree")  # the arms that run the draft model
# the arms whose steps bet on prompt lookup's trie with no draft pass (a plain step verifies it alone, a head tree
# has it merged in): a text's first such bet is capped (:meth:`AdaptiveBudget._lookup_cap`)
LOOKUP_KINDS = ("plain", "heads")


def _own_nodes(arm: int) -> int:
    """The nodes a plain step (0) or a head tree proposes of its own, prompt lookup's merged nodes aside."""
    return arm - HEADS_ARM if arm_kind(arm) == "heads" else 0


def _margin(arm: int) -> float:
    """By how much an arm's rate must beat plain decoding's for it to lead (:data:`TIE_MARGIN`)."""
    return HEADS_TIE_MARGIN if arm_kind(arm) == "heads" else TIE_MARGIN


@dataclass
class AdaptiveBudget:
    """Chooses each step's size among ``arms`` by MEASURED tokens per second.

    Built for a compute-bound verifier (a CPU), where a bigger tree costs more to verify and a draft pass costs a
    good fraction of a target pass, so the best choice -- no draft at all (size 0: the n-gram trie, or plain
    AR when nothing matches), a small tree, a bigger one -- depends on the machine and on the text being written.
    Each arm keeps EMAs of its step seconds and emitted tokens; the best rate wins; an arm not tried for
    ``explore_every`` steps next to the current best is tried once (so a change of text -- a repeated passage, a
    switch from code to prose -- is noticed). Arms never tried are rated by ``prior`` (the measured cost model,
    when there is one), else treated as slightly worse than the best measured arm. Any choice is exact: only
    speed depends on it. An arm is a proposal size: 0 no draft, b > 0 a tree of budget b, -g a chain of g draft
    tokens (with a proposer that offers chains, :class:`~specexec.propose.best_first.TreeDraft` with a ChainDraft).

    So that it never decodes much slower than plain decoding, whatever the machine's costs and the text:

    - it starts at arm 0 (no draft), the one that cannot lose, and keeps it unless a drafting arm measures clearly
      faster (:data:`TIE_MARGIN`; a head tree by :data:`HEADS_TIE_MARGIN`);
    - chain arms not yet tried are rated by a model of the chains tried so far: the acceptance rate per drafted
      token they measured, the draft pass's measured seconds and the verification cost curve give every chain
      length's expected tokens/s, so one measured chain ranks all the others (and a text the draft cannot predict
      rules them all out at once);
    - an exploration that loses doubles the wait before that arm is explored again (up to :data:`MAX_WAIT`), so a
      losing neighbour costs a vanishing share of the steps, while one that wins is explored at the base rate;
    - what an answer's tries and explorations lost (their seconds beyond what the best arm would have taken for
      their tokens, and a draft's catch-up before them) is kept under :data:`LOSS_SHARE` of the answer's expected
      time at plain decoding's rate, each counted at its worst before it runs;
    - a new text (:meth:`new_text`) forgets what the arms yielded on the texts before; an arm's first step on it
      sets its step seconds (a plain step's depend on the text, through prompt lookup's trie), and plain
      decoding is rated no lower than a one-row verification;
    - a draft that lags (the prompt it has not read: its prefill waits for its first proposal; the tokens of steps
      without it) catches up before its proposal, at the cost its pass seconds by rows give (``draft``: measured
      once at start, corrected by every catch-up): a draft arm that leads is chosen only if it still leads with that
      cost spread over the rest of the answer, and is tried or explored only while that catch-up fits the
      answer's :data:`LOSS_SHARE` beside what tries lost so far.
    """

    arms: tuple[int, ...]
    prior: Callable[[int], float] | None = None  # expected tokens/s of an untried arm
    explore_every: int = 8
    alpha: float = 0.3
    costs: StepCosts = field(default_factory=StepCosts)  # for the tree's early stop
    max_depth: int = 32
    verify: VerifyCosts = field(default_factory=VerifyCosts)  # for trimming proposals by value
    draft: VerifyCosts | None = None  # the draft's pass seconds by rows: what its catch-ups cost (None: unknown)
    _lag: int = 0  # the draft's lag when the current step was chosen
    _answer_s: float = 0.0  # this generation's seconds so far (catch-ups included)
    _answer_lost_s: float = 0.0  # what this generation's explorations and first tries lost
    _lookup_bets: int = 0  # this generation's plain steps and head trees that verified prompt lookup's nodes
    _left: int | None = None  # the tokens the current step's answer has left
    _rate: float | None = None  # EMA of measured tokens/s over all steps: the value of a second
    _exploring: bool = False  # this step tries an arm other than the best measured one
    _stats: dict[int, _Arm] = field(default_factory=dict)
    _step: int = 0
    _current: int | None = None
    history: list[int] = field(default_factory=list)
    # what chain steps measured: drafted tokens accepted / rejected, draft passes and their seconds
    _chain_accepted: float = 0.0
    _chain_rejected: float = 0.0
    _chain_passes: float = 0.0
    _chain_draft_s: float = 0.0
    heads_depth: int = 3  # how many heads the head arms' proposals have (their trees' most depth)
    _heads_accepted: float = 0.0
    _heads_rejected: float = 0.0
    _heads_steps: float = 0.0
    _heads_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("AdaptiveBudget needs at least one arm")
        self.arms = tuple(sorted(set(self.arms)))
        self._stats = {a: _Arm() for a in self.arms}

    def rate(self, arm: int) -> float | None:
        if arm == 0:
            return self._plain_rate()
        s = self._stats[arm]
        kind = arm_kind(arm)
        model = None
        if self.prior is None and kind == "chain":
            model = self._chain_model(-arm)
        elif self.prior is None and kind == "heads":
            model = self._heads_model(arm - HEADS_ARM)
        if s.n == 0:
            return self.prior(arm) if self.prior is not None else model
        measured = s.tokens / max(s.seconds, 1e-9)
        if model is not None:
            w = s.n / (s.n + CHAIN_MODEL_WEIGHT)  # a chain's few own steps lean on what every chain measured
            measured = w * measured + (1 - w) * model
        base = self._stats.get(0)
        plain = self._plain_rate() if base is not None and base.n else None
        if plain is not None:  # few steps are weak evidence against plain decoding
            measured = (s.n * measured + SHRINK_STEPS * plain) / (s.n + SHRINK_STEPS)
        return measured

    def _plain_rate(self) -> float | None:
        """Plain steps' measured tokens/s, and never less than a one-row verification's: a plain step that bets
        on prompt lookup's trie and misses costs more than a plain token, but plain decoding stays at hand at that
        rate, so a drafting arm must beat it (a missed 8-row bet among a text's first plain steps made plain
        decoding look 30% slower than it is, and a draft chain that lost to it took the lead)."""
        s = self._stats[0]
        measured = s.tokens / max(s.seconds, 1e-9) if s.n else self.prior(0) if self.prior is not None else None
        one_row = self.verify.at(1)
        if one_row is None:
            return measured
        return max(measured or 0.0, 1 / one_row)

    def _chain_model(self, g: int) -> float | None:
        """Expected tokens/s of a chain of ``g`` from the chains measured so far (None before any): each drafted
        token accepted with the measured rate a, so a step emits (1 - a^(g+1)) / (1 - a) tokens in g draft passes
        plus one verification of g + 1 tokens."""
        verify = self.verify.at(g + 1)
        if self._chain_passes == 0 or verify is None:
            return None
        a = (self._chain_accepted + 1) / (self._chain_accepted + self._chain_rejected + 2)  # Laplace's rule
        a = min(a, 0.99)
        tokens = (1 - a ** (g + 1)) / (1 - a)
        return tokens / (g * self._chain_draft_s / self._chain_passes + verify)

    def _heads_model(self, b: int) -> float | None:
        """Expected tokens/s of a head tree of ``b`` from the head steps measured so far (None before any): its
        best path ``min(b, heads_depth)`` deep, each guess accepted with the measured rate (siblings ignored), the
        heads' measured seconds and the verification of b + 1 rows."""
        verify = self.verify.at(b + 1)
        if self._heads_steps == 0 or verify is None:
            return None
        a = min((self._heads_accepted + 1) / (self._heads_accepted + self._heads_rejected + 2), 0.99)
        tokens = (1 - a ** (min(b, self.heads_depth) + 1)) / (1 - a)
        return tokens / (self._heads_s / self._heads_steps + verify)

    def catch_up(self, lag: int) -> float:
        """Seconds a draft step would first spend reading ``lag`` committed tokens (0 when the cost is unknown)."""
        if lag <= 0 or self.draft is None or not self.draft.known():
            return 0.0
        draft = self.draft
        return catch_up_s(lag, lambda rows: draft.at(rows) or 0.0)

    def new_text(self) -> None:
        """A new generation (another prompt, the next chat turn) starts. The pass and verification curves stay, and
        an arm's step seconds price its worst step until its first step here replaces them (a plain step costs what
        the text's lookup trie makes it); what it yields depends on the text, so every arm's tokens per step and
        the chains' acceptance are forgotten, and the heads' acceptance weighs no more than :data:`HEADS_CARRY`
        steps: the text starts at plain decoding and each other arm is tried again within this answer's
        :data:`LOSS_SHARE` (an arm that led on a code answer may never hit on the next prompt, and a text that
        repeats its context gives plain steps many n-gram tokens where the last text gave none)."""
        self._answer_s = self._answer_lost_s = 0.0
        self._lookup_bets = 0
        for s in self._stats.values():
            s.tokens, s.n, s.wait = 0.0, 0, 0
        self._chain_accepted = self._chain_rejected = self._chain_passes = self._chain_draft_s = 0.0
        # the heads' acceptance is mostly their own (how well they learnt this target), the text's only in part:
        # the earlier texts' counts carry over, worth at most HEADS_CARRY steps, so a new text's first head step
        # is chosen by what the heads measured (one lucky or unlucky first guess decided it otherwise)
        scale = min(1.0, HEADS_CARRY / self._heads_steps) if self._heads_steps else 0.0
        self._heads_accepted *= scale
        self._heads_rejected *= scale
        self._heads_steps *= scale
        self._heads_s *= scale

    def choose(self, left: int | None = None, lag: int = 0) -> int:
        self._step += 1
        self._lag, self._left = lag, left
        switch = self.catch_up(lag)
        rated = {a: self.rate(a) for a in self.arms}
        if switch > 0 and left:  # a draft arm pays the catch-up once, then runs for the rest of the answer
            for a, r in rated.items():
                if r is not None and arm_kind(a) in DRAFT_KINDS:
                    rated[a] = left / (left / r + switch)
        known = {a: r for a, r in rated.items() if r is not None}
        if not known:
            best = 0 if 0 in self.arms else self.arms[0]
        else:
            plain = known.get(0)
            lead = {a: r for a, r in known.items() if a == 0 or plain is None or r >= (1 + _margin(a)) * plain}
            best = max(lead, key=lambda a: lead[a])
        if self._stats[best].n == 0 and not self._affords(best, switch, left, rated.get(0)):
            # rated by the model alone, and its worst step would overdraw this answer's share: the best arm measured
            ran = {a: r for a, r in known.items() if self._stats[a].n}
            best = max(ran, key=lambda a: ran[a]) if ran else (0 if 0 in self.arms else best)
        choice = best
        near = self._near(best, left, switch)
        if self._stats[best].n == 0:  # rated by the model alone: measure it
            pass
        elif self._step > 1 and self._step % self.explore_every == 0:
            due = [
                a
                for a in near
                if self._step - self._stats[a].last >= (self._stats[a].wait or 0)
                and self._affords(a, switch, left, rated.get(0))
            ]
            if due:  # the one tried longest ago
                choice = min(due, key=lambda a: self._stats[a].last)
        elif len(known) < len(self.arms) and self._stats[best].n >= 2:
            untried = sorted(
                (a for a in near if rated[a] is None and self._affords(a, switch, left, rated.get(0))),
                key=lambda a: TRY_ORDER.index(arm_kind(a)),
            )
            if untried:
                choice = untried[0]
        self._stats[choice].last = self._step
        self._exploring = choice != best or self._stats[choice].n == 0
        self._current = choice
        self.history.append(choice)
        return choice

    def _affords(self, arm: int, switch: float, left: int | None, plain: float | None) -> bool:
        """Whether a step of ``arm`` at its worst keeps what this answer's tries lost within :data:`LOSS_SHARE` of
        the answer's expected time (its seconds so far and ``left`` tokens at plain decoding's rate ``plain``). Its
        worst: a draft arm's catch-up (``switch``), and a step (its measured seconds, else the cost curves'
        estimate) that emits one token where plain decoding would have taken that token's seconds."""
        horizon = self._horizon(left, plain)
        cost = switch if arm_kind(arm) in DRAFT_KINDS else 0.0
        step = self._stats[arm].seconds or self._step_estimate(arm)  # measured on this text or an earlier one
        if arm != 0 and step and plain:
            cost += max(step - 1 / plain, 0.0)
        return self._answer_lost_s + cost <= LOSS_SHARE * horizon

    def _step_estimate(self, arm: int) -> float:
        """An arm's step seconds before it has run, at its dearest, from the cost curves (0 when they are not
        measured): a chain of g, g draft passes and the verification of g + 1 rows; a tree of b, a draft pass per
        level, as deep as b nodes can go, and b + 1 rows; a head tree of b, b + 1 rows."""
        kind, pass_s = arm_kind(arm), self._pass_s()
        if kind == "chain":
            verify = self.verify.at(-arm + 1)
            return -arm * pass_s + verify if verify is not None and pass_s is not None else 0.0
        size = arm - HEADS_ARM if kind == "heads" else arm
        verify = self.verify.at(size + 1)
        if verify is None or (kind == "tree" and pass_s is None):
            return 0.0
        return verify + (min(size, self.max_depth) * pass_s if kind == "tree" and pass_s is not None else 0.0)

    def _near(self, best: int, left: int | None = None, switch: float = 0.0) -> list[int]:
        """The arms explored next to ``best``: its neighbours by size among its kind, and each kind's best-rated arm
        (before any is rated: no draft, the shortest chain, the smallest tree, the smallest head tree), so that each
        kind gets tried whichever leads, and a kind that lost the lead to a run of bad steps is tried where it was
        best. Draft trees (dearer to verify than a chain of their depth) are left out while chains
        are rated and none beats plain decoding: the draft is not predicting this text."""
        kind = arm_kind(best)
        same = [a for a in self.arms if arm_kind(a) == kind or {kind, arm_kind(a)} == {"plain", "tree"}]
        i = same.index(best)
        out = [same[j] for j in (i - 1, i + 1) if 0 <= j < len(same)]
        chains = [a for a in self.arms if arm_kind(a) == "chain"]
        trees = [a for a in self.arms if arm_kind(a) == "tree"]
        heads = [a for a in self.arms if arm_kind(a) == "heads"]
        entries = [0] if 0 in self.arms else []
        for group, first in ((chains, max), (trees, min), (heads, min)):
            if group:  # each kind's best-rated arm (its first one before any is rated)
                by_rate = {a: r for a in group if (r := self.rate(a)) is not None}
                entries.append(max(by_rate, key=lambda a: by_rate[a]) if by_rate else first(group))
        out += [a for a in entries if a != best and a not in out]
        plain = self.rate(0) if 0 in self.arms else None
        rated = [r for a in chains if (r := self.rate(a)) is not None]
        if plain is not None and rated and max(rated) < plain and arm_kind(best) != "tree":
            out = [a for a in out if arm_kind(a) != "tree"]
        if plain is not None:  # arms that could not win even if the target took every drafted token
            spread = switch / left if left else 0.0  # the catch-up, spread over the rest of the answer
            floor = (1 + TIE_MARGIN) * plain
            out = [a for a in out if (c := self._ceiling(a)) is None or 1 / (1 / c + spread) >= floor]
        return out

    def _pass_s(self) -> float | None:
        """A draft pass's seconds: as the draft steps measured it, else the draft's cost curve at one row."""
        if self.costs.pass_s is None and self.draft is not None and self.draft.known():
            return self.draft.at(1)
        return self.costs.pass_s

    def _ceiling(self, arm: int) -> float | None:
        """The most tokens/s a draft tree or chain could give, every drafted token accepted: g + 1 tokens for g
        draft passes and the verification of its rows (a tree of b grown d deep: d + 1 tokens for d passes and
        b + 1 rows). None before a draft pass and the verification costs are measured, and for other arms."""
        kind, pass_s = arm_kind(arm), self._pass_s()
        if kind not in DRAFT_KINDS or pass_s is None or not self.verify.known():
            return None
        if kind == "chain":
            verify = self.verify.at(-arm + 1)
            return None if verify is None else (-arm + 1) / (-arm * pass_s + verify)
        verify = self.verify.at(arm + 1)
        if verify is None:
            return None
        return max((d + 1) / (d * pass_s + verify) for d in range(1, min(arm, self.max_depth) + 1))

    def grow_cost(self, budget: int) -> GrowCost | ChainStop | None:
        """A tree's early-stop costs; for a chain arm (budget -g), its per-token stop (once a draft pass and the
        verification curve have been measured)."""
        if budget < 0:
            if self.costs.pass_s is None or not self.verify.known():
                return None
            return ChainStop(self.costs.pass_s, self.verify.curve(-budget + 2), self.costs.acc_scale)
        if budget >= HEADS_ARM:  # heads grow no draft tree
            return None
        return self.costs.grow_cost(budget)

    def trim_rule(self) -> Trim | None:
        """Trim proposals by value (:class:`~specexec.decoding.costs.Trim`): a second of verification is worth the
        measured tokens/s, at the measured cost by size. None without a cost curve. Exploration steps are trimmed
        too: an arm is measured as it would run (untrimmed merged n-gram nodes made a chain's exploration verify
        several times the rows, and the arm then lost to plain decoding for good where rows are dear)."""
        if self._rate is None or not self.verify.known():
            return None
        return Trim(self._rate, self.verify.curve, self.costs.acc_scale, self._lookup_cap())

    def _lookup_cap(self) -> float:
        """The most seconds a text's first prompt-lookup bet may add to a plain step's one-row verification (to a
        head tree's own rows, where it is merged in): this answer's :data:`LOSS_SHARE`, less what its tries lost.
        That bet is priced by the acceptance lookup measured on earlier texts, which a new text may not share (a
        deep trie that misses costs several plain steps); the bets after it are priced by what the text's own
        bets measured, and are not capped. Unbounded for the steps of other arms (their tries have a share of
        their own)."""
        if self._current is None or arm_kind(self._current) not in LOOKUP_KINDS or self._lookup_bets:
            return math.inf
        own = 0.0
        if _own_nodes(self._current):
            rows, one = self.verify.at(_own_nodes(self._current) + 1), self.verify.at(1)
            own = max(rows - one, 0.0) if rows is not None and one is not None else 0.0
        return own + max(LOSS_SHARE * self._horizon(self._left, self._plain_rate()) - self._answer_lost_s, 0.0)

    def _horizon(self, left: int | None, plain: float | None) -> float:
        """This answer's expected seconds: its seconds so far and ``left`` tokens at plain decoding's rate."""
        return self._answer_s + (left / plain if left and plain else 0.0)

    def update(self, step: StepInfo) -> None:
        # a lagging draft's catch-up is a cost of the steps before (and of the prompt): not of this arm's step, but
        # of the decision to run the draft again, which :meth:`choose` weighs; an exploration's counts as lost
        draft_s = step.draft_s - step.catch_up_s
        if step.catch_up_s > 0:
            if self.draft is not None and self._lag > 0:
                self.draft.update(self._lag, step.catch_up_s)
            self._answer_s += step.catch_up_s
            if self._exploring and step.budget == self._current:
                self._answer_lost_s += step.catch_up_s
        if arm_kind(step.budget) == "heads":  # the same for the heads' guesses along their best path
            depth = min(step.budget - HEADS_ARM, self.heads_depth)
            accepted = min(step.emitted - 1, depth)
            d = CHAIN_DECAY
            self._heads_accepted = d * self._heads_accepted + accepted
            self._heads_rejected = d * self._heads_rejected + (accepted < depth)
            self._heads_steps = d * self._heads_steps + 1
            self._heads_s = d * self._heads_s + draft_s
        if step.budget < 0 and step.passes > 0:  # decayed counts: the model follows the text as it changes
            accepted = min(step.emitted - 1, step.passes)
            d = CHAIN_DECAY
            self._chain_accepted = d * self._chain_accepted + accepted
            self._chain_rejected = d * self._chain_rejected + (accepted < step.passes)
            self._chain_passes = d * self._chain_passes + step.passes
            self._chain_draft_s = d * self._chain_draft_s + draft_s
        explored = self._exploring and step.budget == self._current
        sec_all = draft_s + step.target_s
        if arm_kind(step.budget) in LOOKUP_KINDS and step.size > 1 + _own_nodes(step.budget):  # lookup's nodes too
            self._lookup_bets += 1
        self._answer_s += sec_all
        if explored:
            best = max((r for a in self.arms if a != step.budget and (r := self.rate(a)) is not None), default=None)
            if best:
                self._answer_lost_s += max(sec_all - step.emitted / best, 0.0)
        if sec_all > 0:
            r = step.emitted / sec_all
            self._rate = r if self._rate is None else _ema(self._rate, r, 0.1)
        if step.size:
            self.verify.update(step.size, step.target_s)
        s = self._stats.get(step.budget)
        if s is None:
            return
        sec = draft_s + step.target_s
        if s.n == 0:  # the first step on this text: its own tokens and seconds (a step costs what the text makes
            # it: a plain step that verifies prompt lookup's trie of 8 rows costs twice one of a single row)
            s.seconds = sec
            s.tokens = float(step.emitted)
        else:
            s.seconds = _ema(s.seconds, sec, self.alpha)
            s.tokens = _ema(s.tokens, float(step.emitted), self.alpha)
        s.n += 1
        if explored:  # a losing exploration waits twice as long before the next; a winning one resets the wait
            others = [r for a in self.arms if a != step.budget and (r := self.rate(a)) is not None]
            lost = bool(others) and s.tokens / max(s.seconds, 1e-9) < max(others)
            s.wait = min(max(s.wait, self.explore_every) * 2, MAX_WAIT) if lost else 0
        if step.budget != 0 and step.passes > 0:  # draft trees and chains: the draft's pass cost and confidence
            predicted = min(1.0 + sum(math.exp(x) for x in step.tree_logp), self.max_depth + 1.0)
            self.costs.update(step.budget, draft_s, step.passes, step.target_s, predicted, step.emitted)

    def summary(self) -> dict[int, dict[str, float]]:
        """Per arm: steps, measured tokens/step and seconds/step (EMAs)."""
        return {a: {"steps": s.n, "tokens": s.tokens, "seconds": s.seconds} for a, s in self._stats.items() if s.n}


# ---------------------------------------------------------------------------------------------- the costs cache

DRIFT = 1.5  # step costs beyond this factor of the start-up measurement (either way) trigger a new measurement


def costs_key(*parts: object) -> str:
    """A stable key for measured pass costs: machine, versions, the package's code, model shapes and dtypes, tree
    limits. Costs measured by other code (an upgrade, a new kernel: a pass may cost half as much, and differently
    by size) are measured again, not read."""
    import hashlib
    import json
    import platform

    import torch

    blob = json.dumps(
        [
            platform.machine(),
            platform.processor(),
            torch.__version__,
            torch.get_num_threads(),
            code_version(),
            *[repr(p) for p in parts],
        ],
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@functools.cache
def code_version() -> str:
    """A digest of the package's Python and C sources (what a pass runs)."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c") and p.is_file()):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def load_costs(path) -> tuple[dict[int, float], dict[int, float]] | None:
    """A cached (target seconds by size, draft seconds by beams), or None when absent or unreadable."""
    import json

    try:
        d = json.loads(path.read_text())
        return (
            {int(k): float(v) for k, v in d["target_s"].items()},
            {int(k): float(v) for k, v in d["draft_pass_s"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_costs(path, target_s: dict[int, float], draft_pass_s: dict[int, float]) -> None:
    """Write measured pass costs (best effort: an unwritable cache only costs a measurement next time)."""
    import json

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"target_s": target_s, "draft_pass_s": draft_pass_s}))
    except OSError as e:
        log.info("pass costs not cached (%s)", e)


def drifted(policy: AutoBudget, min_steps: int = 8) -> bool:
    """Whether the steps measured since the start-up measurement disagree with it by more than :data:`DRIFT` (e.g.
    the machine was busy while measuring): then the costs are measured again before the next generation."""
    if len(policy.history) < min_steps:
        return False
    lim = math.log(DRIFT)
    return abs(math.log(policy._target_scale)) > lim or abs(math.log(policy._draft_scale)) > lim
