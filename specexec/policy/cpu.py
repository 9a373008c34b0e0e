"""The CPU's measured-rate choice (``--budget auto`` on a CPU, and ``--draft heads``): each step's arm by measured
tokens/s (the behaviour is described in :mod:`specexec.policy`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from specexec.policy.config import DEFAULT, PolicyConfig
from specexec.policy.curves import ema, interp, monotone
from specexec.policy.fixed import StepCosts
from specexec.steps.record import PLAIN, Arm, StepInfo
from specexec.steps.rules import ChainStop, GrowCost, Trim, catch_up_s


@dataclass
class VerifyCosts:
    """The target's verification seconds by tree size (tokens in the pass, root included), for a compute-bound
    verifier. ``prior``: a short measurement at start (cached per machine); ``seconds``: EMAs of what steps measured
    at each size. A size measured online uses its EMA; any other size uses the prior's curve scaled by the median
    measured/prior ratio, so a prior taken while the machine was busy (or idle) is corrected everywhere by
    the steps, not only at the sizes the policy happens to verify. ``at(size)`` never decreases with size."""

    prior: dict[int, float] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    config: PolicyConfig = DEFAULT
    # the curve, kept until the next update: the policy reads it some hundred times a step (a profile of a CPU step
    # had 2-3 ms of a 50 ms step in redrawing it)
    _points: dict[int, float] | None = field(default=None, init=False, repr=False, compare=False)

    def update(self, size: int, sec: float) -> None:
        if size < 1 or sec <= 0:
            return
        old = self.seconds.get(size)
        self.seconds[size] = sec if old is None else ema(old, sec, self.config.alpha)
        self._points = None

    def scale(self) -> float:
        """Median measured / prior ratio over the sizes measured online (1.0 when none)."""
        if not self.prior:
            return 1.0
        pts = monotone(self.prior)
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
            self._points = monotone(pts)
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
class _ArmStats:
    seconds: float = 0.0  # EMA of a step's seconds (proposal + verification)
    tokens: float = 0.0  # EMA of tokens emitted per step
    n: int = 0  # steps observed on this text
    last: int = -1  # the step it was last chosen at
    wait: int = 0  # steps between its explorations: doubles each time one loses, back to 0 when one wins


@dataclass
class _Acceptance:
    """One kind's measured acceptance on this text: drafted tokens accepted and rejected, proposal seconds, steps."""

    hit: float = 0.0
    miss: float = 0.0
    prop_s: float = 0.0
    steps: int = 0

    def rate(self) -> float:
        # Laplace's rule; the cap is a guard (a = 1 would divide by zero in the tokens a step emits)
        return min((self.hit + 1) / (self.hit + self.miss + 2), 0.99)


DRAFT_KINDS = ("chain", "tree")  # the arms that run the draft model
LOOKUP_KINDS = ("plain", "heads")  # the arms whose steps may bet on prompt lookup's trie with no draft pass
MODEL_KINDS = ("chain", "heads")  # the kinds whose untried sizes the measured acceptance rates


def _own_nodes(arm: Arm) -> int:
    """The nodes a plain step or a head tree proposes of its own, prompt lookup's merged nodes aside."""
    return arm.size if arm.kind == "heads" else 0


@dataclass
class AdaptiveBudget:
    """Chooses each step's arm among ``arms`` by measured tokens per second, never far below plain decoding (the
    rules are in :mod:`specexec.policy`). ``verify``: the target's verification seconds by size; ``draft``: the
    draft's pass seconds by rows (what its catch-ups cost; None: unknown); ``prior``: expected tokens/s of an
    untried arm (tests)."""

    arms: tuple[Arm, ...]
    prior: Callable[[Arm], float] | None = None
    config: PolicyConfig = DEFAULT
    costs: StepCosts = field(default_factory=StepCosts)  # the draft's pass seconds and confidence (early stop)
    max_depth: int = 32
    verify: VerifyCosts = field(default_factory=VerifyCosts)
    draft: VerifyCosts | None = None
    heads_depth: int = 3  # how deep a head tree's best path goes
    history: list[Arm] = field(default_factory=list)
    _stats: dict[Arm, _ArmStats] = field(default_factory=dict)
    _acc: dict[str, _Acceptance] = field(default_factory=dict)
    _step: int = 0
    _current: Arm | None = None
    _exploring: bool = False
    _lag: int = 0
    _left: int | None = None
    _answer_s: float = 0.0  # this answer's seconds so far
    _lost_s: float = 0.0  # what this answer's bets lost (net of what lookup hits won)
    _rate: float | None = None  # EMA of tokens/s over all steps: what a second of verification is worth

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("AdaptiveBudget needs at least one arm")
        self.arms = tuple(sorted(set(self.arms)))
        self._stats = {a: _ArmStats() for a in self.arms}
        self._acc = {k: _Acceptance() for k in MODEL_KINDS}

    # -- rates ------------------------------------------------------------------------------------------------
    def _plain_rate(self) -> float | None:
        """Plain steps' measured tokens/s, and never less than a one-row verification's: a plain step whose
        prompt-lookup bet missed costs more than a plain token, but plain decoding stays at hand at that rate."""
        s = self._stats.get(PLAIN)
        measured = s.tokens / max(s.seconds, 1e-9) if s is not None and s.n else None
        if measured is None and self.prior is not None and PLAIN in self.arms:
            measured = self.prior(PLAIN)
        one = self.verify.at(1)
        return measured if one is None else max(measured or 0.0, 1 / one)

    def rate(self, arm: Arm) -> float | None:
        """An arm's expected tokens/s: measured on this text, else its kind's acceptance model, else None."""
        if arm == PLAIN:
            return self._plain_rate()
        s = self._stats[arm]
        if s.n == 0:
            return self.prior(arm) if self.prior is not None else self._model(arm)
        return s.tokens / max(s.seconds, 1e-9)

    def _model(self, arm: Arm) -> float | None:
        """An untried chain or head tree from its kind's acceptance on this text: a best path d deep, each guess
        accepted with a, emits (1 - a^(d+1)) / (1 - a) tokens for the kind's proposal seconds (per draft pass for a
        chain) and the verification of size + 1 rows."""
        acc = self._acc.get(arm.kind)
        if acc is None or acc.steps == 0:
            return None
        verify = self.verify.at(arm.size + 1)
        if verify is None:
            return None
        chain = arm.kind == "chain"
        depth = arm.size if chain else min(arm.size, self.heads_depth)
        a = acc.rate()
        prop = acc.prop_s / acc.steps * (arm.size if chain else 1)
        return (1 - a ** (depth + 1)) / (1 - a) / (prop + verify)

    def _pass_s(self) -> float | None:
        """A draft pass's seconds: as the draft steps measured it, else the draft's cost curve at one row."""
        if self.costs.pass_s is None and self.draft is not None and self.draft.known():
            return self.draft.at(1)
        return self.costs.pass_s

    def _ceiling(self, arm: Arm) -> float | None:
        """The most tokens/s a draft tree or chain could give, every drafted token accepted: g + 1 tokens for g
        draft passes and g + 1 rows (a tree of b grown d deep: d + 1 tokens for d passes and b + 1 rows). None
        before a draft pass and the verification costs are known, and for other arms."""
        pass_s = self._pass_s()
        if arm.kind not in DRAFT_KINDS or pass_s is None or not self.verify.known():
            return None
        verify = self.verify.at(arm.size + 1)
        if verify is None:
            return None
        if arm.kind == "chain":
            return (arm.size + 1) / (arm.size * pass_s + verify)
        return max((d + 1) / (d * pass_s + verify) for d in range(1, min(arm.size, self.max_depth) + 1))

    def catch_up(self, lag: int) -> float:
        """Seconds a draft step would first spend reading ``lag`` committed tokens (0 when the cost is unknown)."""
        if lag <= 0 or self.draft is None or not self.draft.known():
            return 0.0
        draft = self.draft
        return catch_up_s(lag, lambda rows: draft.at(rows) or 0.0)

    # -- the loss budget ----------------------------------------------------------------------------------------
    def _horizon(self, left: int | None, plain: float | None) -> float:
        """This answer's expected seconds: its seconds so far and ``left`` tokens at plain decoding's rate."""
        return self._answer_s + (left / plain if left and plain else 0.0)

    def _worst(self, arm: Arm) -> float:
        """An arm's step seconds at its dearest: measured (on this text or an earlier one), else from the cost
        curves (a chain of g: g draft passes and g + 1 rows; a tree of b: a pass per level, as deep as b nodes
        go, and b + 1 rows; a head tree of b: b + 1 rows); 0 when unknown."""
        s = self._stats[arm]
        if s.seconds:
            return s.seconds
        pass_s = self._pass_s()
        verify = self.verify.at(arm.size + 1)
        if verify is None or (arm.kind in DRAFT_KINDS and pass_s is None):
            return 0.0
        passes = {"chain": arm.size, "tree": min(arm.size, self.max_depth)}.get(arm.kind, 0)
        return verify + passes * (pass_s or 0.0)

    def _affords(self, arm: Arm, switch: float, left: int | None, plain: float | None) -> bool:
        """Whether a step of ``arm`` at its worst (one token; a draft arm's catch-up ``switch`` first) keeps what
        this answer's bets lost within ``loss_share`` of the answer's expected time."""
        cost = switch if arm.kind in DRAFT_KINDS else 0.0
        if arm != PLAIN and plain:
            cost += max(self._worst(arm) - 1 / plain, 0.0)
        return self._lost_s + cost <= self.config.loss_share * self._horizon(left, plain)

    def _could_win(self, arm: Arm, plain: float | None, switch: float, left: int | None) -> bool:
        """Whether ``arm`` could lead at full acceptance, its catch-up spread over the rest of the answer."""
        c = self._ceiling(arm)
        if c is None or plain is None:
            return True
        spread = switch / left if left else 0.0
        return 1 / (1 / c + spread) >= (1 + self.config.margin) * plain

    # -- decisions ----------------------------------------------------------------------------------------------
    def new_text(self) -> None:
        """A new generation starts: what the arms yielded, their waits and the acceptance models are forgotten
        (they depend on the text); the cost curves and an arm's step seconds (its worst step's price until it
        runs again) stay."""
        self._answer_s = self._lost_s = 0.0
        for s in self._stats.values():
            s.tokens, s.n, s.wait = 0.0, 0, 0
        self._acc = {k: _Acceptance() for k in MODEL_KINDS}

    def choose(self, left: int | None = None, lag: int = 0) -> Arm:
        self._step += 1
        self._lag, self._left = lag, left
        switch = self.catch_up(lag)
        rated = {a: self.rate(a) for a in self.arms}
        plain = rated.get(PLAIN)
        # a draft arm pays the catch-up once, then runs for the rest of the answer
        eff = {
            a: (left / (left / r + switch) if switch and left and a.kind in DRAFT_KINDS else r)
            for a, r in rated.items()
            if r is not None
        }
        margin = 1 + self.config.margin
        lead = {a: r for a, r in eff.items() if a == PLAIN or plain is None or r >= margin * plain}
        fallback = PLAIN if PLAIN in self.arms else self.arms[0]
        best = max(lead, key=lambda a: lead[a]) if lead else fallback
        if self._stats[best].n == 0 and not self._affords(best, switch, left, plain):
            # rated by the model alone, and its worst step would overdraw the budget: the best arm measured
            ran = {a: r for a, r in eff.items() if self._stats[a].n}
            best = max(ran, key=lambda a: ran[a]) if ran else fallback
        choice = best
        if self._stats[best].n:  # best is measured: maybe a try or an exploration instead
            ok = [
                a
                for a in self.arms
                if a != best and self._could_win(a, plain, switch, left) and self._affords(a, switch, left, plain)
            ]
            # untried arms no model rates: the first of each kind (shortest chain, smallest tree and head tree)
            untried = [a for a in ok if rated[a] is None and a == self._first(a.kind)]
            if untried and self._stats[best].n >= 2:
                choice = untried[0]
            elif self._step % self.config.explore_every == 0:
                due = [a for a in ok if self._step - self._stats[a].last >= self._stats[a].wait]
                if due:  # the one explored longest ago
                    choice = min(due, key=lambda a: self._stats[a].last)
        self._stats[choice].last = self._step
        self._exploring = choice != best or self._stats[choice].n == 0
        self._current = choice
        self.history.append(choice)
        return choice

    def _first(self, kind: str) -> Arm:
        return min((a for a in self.arms if a.kind == kind), key=lambda a: a.size)

    # -- what the proposer weighs ------------------------------------------------------------------------------
    def grow_cost(self, arm: Arm) -> GrowCost | ChainStop | None:
        """A tree's early-stop costs; for a chain arm, its per-token stop (once a draft pass and the
        verification curve have been measured)."""
        if arm.kind == "chain":
            if self.costs.pass_s is None or not self.verify.known():
                return None
            return ChainStop(self.costs.pass_s, self.verify.curve(arm.size + 2), self.costs.acc_scale)
        if arm.kind == "heads":  # heads grow no draft tree
            return None
        return self.costs.grow_cost(arm)

    def trim_rule(self) -> Trim | None:
        """Trim proposals by value (:class:`~specexec.steps.rules.Trim`): a second of verification is worth the
        measured tokens/s, at the measured cost by size; a prompt-lookup bet is capped by what is left of the
        loss budget. None without a cost curve. Exploration steps are trimmed too: an arm is measured as it runs."""
        if self._rate is None or not self.verify.known():
            return None
        return Trim(self._rate, self.verify.curve, self.costs.acc_scale, self._lookup_cap())

    def _lookup_cap(self) -> float:
        """The most seconds a prompt-lookup bet (a plain step's trie, or the one merged into a head tree) may add to
        the step's own rows: what is left of this answer's loss budget. Unbounded for draft arms' steps."""
        if self._current is None or self._current.kind not in LOOKUP_KINDS:
            return math.inf
        own = 0.0
        if _own_nodes(self._current):
            rows, one = self.verify.at(_own_nodes(self._current) + 1), self.verify.at(1)
            own = max(rows - one, 0.0) if rows is not None and one is not None else 0.0
        share = self.config.loss_share * self._horizon(self._left, self._plain_rate())
        return own + max(share - self._lost_s, 0.0)

    # -- feedback ------------------------------------------------------------------------------------------------
    def update(self, step: StepInfo) -> None:
        # a lagging draft's catch-up is a cost of the steps before (and of the prompt): not of this arm's step, but
        # of the decision to run the draft again, which :meth:`choose` weighs; an exploration's counts as lost
        draft_s = step.draft_s - step.catch_up_s
        arm = step.arm
        explored = self._exploring and arm == self._current
        if step.catch_up_s > 0:
            if self.draft is not None and self._lag > 0:
                self.draft.update(self._lag, step.catch_up_s)
            self._answer_s += step.catch_up_s
            if explored:
                self._lost_s += step.catch_up_s
        acc = self._acc.get(arm.kind)
        if acc is not None:  # the kind's acceptance along its best path
            depth = min(arm.size, step.passes) if arm.kind == "chain" else min(arm.size, self.heads_depth)
            if depth > 0:
                accepted = min(step.emitted - 1, depth)
                acc.hit += accepted
                acc.miss += accepted < depth
                acc.prop_s += draft_s / (depth if arm.kind == "chain" else 1)
                acc.steps += 1
        own = _own_nodes(arm)
        sec = draft_s + step.target_s
        self._answer_s += sec
        others = [r for a in self.arms if a != arm and (r := self.rate(a)) is not None]
        if explored and others:
            self._lost_s += max(sec - step.emitted / max(others), 0.0)
        one = self.verify.at(1 + own)
        if arm.kind in LOOKUP_KINDS and step.size > 1 + own and one is not None:
            # a prompt-lookup bet: what it lost against one-row plain steps for its tokens (a head tree's: against
            # its own rows), or, negative, what a hit won
            self._lost_s += step.target_s - step.emitted * one if arm == PLAIN else step.target_s - one
        alpha = self.config.alpha
        if sec > 0:
            r = step.emitted / sec
            self._rate = r if self._rate is None else ema(self._rate, r, alpha)
        if step.size:
            self.verify.update(step.size, step.target_s)
        s = self._stats.get(arm)
        if s is None:
            return
        if s.n == 0:  # the first step on this text: its own tokens and seconds
            s.seconds, s.tokens = sec, float(step.emitted)
        else:
            s.seconds, s.tokens = ema(s.seconds, sec, alpha), ema(s.tokens, float(step.emitted), alpha)
        s.n += 1
        if explored:  # a losing exploration waits twice as long before the next; a winning one resets the wait
            lost = bool(others) and s.tokens / max(s.seconds, 1e-9) < max(others)
            s.wait = max(s.wait, self.config.explore_every) * 2 if lost else 0
        if arm != PLAIN and step.passes > 0:  # draft trees and chains: the draft's pass cost and confidence
            predicted = min(1.0 + sum(math.exp(x) for x in step.tree_logp), self.max_depth + 1.0)
            self.costs.update(arm, draft_s, step.passes, step.target_s, predicted, step.emitted)

    def summary(self) -> dict[Arm, dict[str, float]]:
        """Per arm: steps, measured tokens/step and seconds/step (EMAs)."""
        return {a: {"steps": s.n, "tokens": s.tokens, "seconds": s.seconds} for a, s in self._stats.items() if s.n}
