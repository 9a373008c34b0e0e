"""A simulated GPU for the cost model (:class:`~specexec.policy.AutoBudget`): cost profiles (seconds of a target
pass by rows, of a draft pass by beams) × acceptance models (the draft's reported path probabilities against the
target's true acceptance) × seeds. A step grows a best-first tree pass by pass with the policy's early stop, draws
the emitted tokens from the true acceptance, and feeds the policy the step's record. The policy's tokens/s is
compared with the best fixed budget in hindsight (a :class:`~specexec.policy.FixedBudget` of each grid budget on the
same seeds). No timing: every second is given.

``python -m tests.decoding.gpu_sim --ablate`` prints each tunable's ablation: the policy with it removed or neutral
against the default, per cell (profile × acceptance), paired over seeds, with the seeds' noise band."""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from specexec.policy import DEFAULT, AutoBudget, FixedBudget, PolicyConfig, StepCosts, measure_costs
from specexec.steps.record import Arm, StepInfo

MAX_BEAMS, MAX_DEPTH, MAX_BUDGET = 128, 32, 2048


@dataclass(frozen=True)
class Profile:
    """True pass seconds, and how the start-up measurement saw them (a factor on each: a draft measured eagerly at
    ~3x what its graphed passes then take; a busy machine)."""

    name: str
    target: Callable[[int], float]  # seconds of a target pass of n rows
    draft: Callable[[int], float]  # seconds of a draft pass of k beams
    measured_target: float = 1.0
    measured_draft: float = 1.0


PROFILES = {
    # a 70B streamed over PCIe 4: every pass reads all weights, ~0.7 s for one row to ~1.5 s for 2048
    "pcie70b": Profile("pcie70b", lambda n: 0.7 + 0.8 * n / 2048, lambda k: 0.02 + 0.01 * k / 128),
    # a 70B streamed on an H200 (docs/BENCHMARKS.md): flatter, and a draft pass measured at 3x its graphed cost
    "h200": Profile("h200", lambda n: 0.62 + 0.06 * n / 2048, lambda k: 0.009, measured_draft=3.0),
    # a resident model on an H100: flat to 256 rows, then nearly linear
    "h100": Profile("h100", lambda n: 0.022 * max(1.0, n / 256) ** 0.9, lambda k: 0.005 + 0.003 * k / 128),
    # compute-bound: every row costs
    "compute": Profile("compute", lambda n: 0.1 + 0.0012 * n, lambda k: 0.01),
}


def _base(i: int) -> float:
    """The calibrated i-th best path probability (1-based): heavy-tailed, ~1 token per doubling of the tree."""
    return min(0.95, 1 / (i * math.log(2)))


@dataclass(frozen=True)
class Acceptance:
    """The draft reports ``belief * base`` path probabilities; the target accepts as if they were
    ``truth * base``. ``phase``: every this many steps the text changes and the truth alternates ×1.6 / ×0.5."""

    name: str
    belief: float = 1.0
    truth: float = 1.0
    phase: int = 0

    def factor(self, step: int) -> float:
        if not self.phase:
            return 1.0
        return 1.6 if (step // self.phase) % 2 == 0 else 0.5


ACCEPTANCE = {
    "calibrated": Acceptance("calibrated"),
    "over3": Acceptance("over3", truth=1 / 3),  # the draft is 3x over-confident
    "under3": Acceptance("under3", belief=1 / 3),  # 3x under-confident
    "over10": Acceptance("over10", truth=1 / 10),
    "under10": Acceptance("under10", belief=1 / 10),
    "phases": Acceptance("phases", phase=15),  # calibrated on average, the text changing every 15 steps
}


def nodes_after(b: int, j: int) -> int:
    """Nodes a best-first tree of budget ``b`` holds after ``j`` draft passes: each pass adds a level of about one
    token of path probability (the tree doubles, as far as ``MAX_BEAMS`` expansions a pass allow)."""
    return min(b, 2**j - 1, MAX_BEAMS * j)


def full_passes(b: int) -> int:
    """Draft passes a tree of ``b`` nodes takes without an early stop (not the policy's prior)."""
    j = 1
    while nodes_after(b, j) < b and j < MAX_DEPTH:
        j += 1
    return j


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def measure(profile: Profile, measure_all: bool = False) -> tuple[dict[int, float], dict[int, float]]:
    """The start-up measurement as the engine takes it (:func:`measure_costs`), of what the profile's start-up saw.
    ``measure_all``: every size measured, without measure_costs' early stop (an ablation)."""
    t = lambda n: profile.target(n) * profile.measured_target  # noqa: E731
    d = lambda k: profile.draft(k) * profile.measured_draft  # noqa: E731
    if measure_all:
        return {n: t(n) for n in (1, 64, 256, 1024, 2048)}, {k: d(k) for k in (1, 16, 64, 128)}
    return measure_costs(t, d, MAX_BUDGET, MAX_BEAMS)


def step(policy, profile: Profile, acc: Acceptance, i: int, rng: random.Random) -> tuple[int, float]:  # noqa: ANN001
    """One simulated step of ``policy``: its tokens and seconds."""
    arm = policy.choose()
    b = arm.size
    cost = policy.grow_cost(arm)
    full = full_passes(b)
    belief = [acc.belief * _base(j) for j in range(1, b + 1)]
    passes = full
    for j in range(1, full):  # the early stop, after each pass but the last
        n, nxt = nodes_after(b, j), nodes_after(b, j + 1)
        if cost is not None and not cost.more(1 + sum(belief[:n]), sum(belief[n:nxt]), j):
            passes = j
            break
    nodes = nodes_after(b, passes)
    truth = acc.truth * acc.factor(i) * sum(_base(j) for j in range(1, nodes + 1))
    emitted = 1 + min(_poisson(rng, min(truth, passes)), passes)
    jitter = lambda: math.exp(rng.gauss(0.0, 0.03))  # noqa: E731
    draft_s = passes * profile.draft(min(b, MAX_BEAMS)) * jitter()
    target_s = profile.target(nodes + 1) * jitter()
    tree_logp = [math.log(p) for p in belief[:nodes]]
    policy.update(
        StepInfo(arm=arm, tree_logp=tree_logp, emitted=emitted, draft_s=draft_s, target_s=target_s, passes=passes)
    )
    return emitted, draft_s + target_s


def run(policy, profile: Profile, acc: Acceptance, seed: int, steps: int = 60) -> float:  # noqa: ANN001
    """Tokens/s of ``policy`` over ``steps`` simulated steps."""
    rng = random.Random(seed)
    tokens, seconds = 0, 0.0
    for i in range(steps):
        t, s = step(policy, profile, acc, i, rng)
        tokens, seconds = tokens + t, seconds + s
    return tokens / seconds


def auto(profile: Profile, config: PolicyConfig = DEFAULT, measure_all: bool = False, **kw) -> AutoBudget:  # noqa: ANN003
    target_s, draft_s = measure(profile, measure_all)
    return AutoBudget(target_s, draft_s, MAX_BEAMS, MAX_DEPTH, MAX_BUDGET, budget=64, config=config, **kw)


def best_fixed(profile: Profile, acc: Acceptance, seed: int, steps: int = 60) -> tuple[int, float]:
    """The best fixed grid budget in hindsight on this seed, and its tokens/s."""
    rates = {
        b: run(FixedBudget(Arm.nodes(b), StepCosts(), MAX_DEPTH), profile, acc, seed, steps)
        for b in DEFAULT.gpu_grid
        if b <= MAX_BUDGET
    }
    b = max(rates, key=rates.__getitem__)
    return b, rates[b]


def ratios(
    make: Callable[[Profile], AutoBudget], profile: Profile, acc: Acceptance, seeds: range, steps: int = 60
) -> list[float]:
    """The policy's tokens/s over the best fixed budget's in hindsight, per seed."""
    return [run(make(profile), profile, acc, s, steps) / best_fixed(profile, acc, s, steps)[1] for s in seeds]


# -- ablations: each tunable removed or neutral ------------------------------------------------------------------
def _cfg(**kw) -> Callable[[Profile], AutoBudget]:  # noqa: ANN003
    return lambda p: auto(p, replace(DEFAULT, **kw))


class _PassesPrior(AutoBudget):
    """The passes prior of unmeasured budgets replaced by ``prior(b)``."""

    prior: Callable[[int], float] = staticmethod(lambda b: MAX_DEPTH)  # type: ignore[assignment]

    def step_seconds(self, b: int) -> float:
        if b not in self._passes:
            self._passes[b] = self.prior(b)
            try:
                return super().step_seconds(b)
            finally:
                del self._passes[b]
        return super().step_seconds(b)


def _passes_prior(prior: Callable[[int], float]) -> Callable[[Profile], AutoBudget]:
    def make(p: Profile) -> AutoBudget:
        target_s, draft_s = measure(p)
        pol = _PassesPrior(target_s, draft_s, MAX_BEAMS, MAX_DEPTH, MAX_BUDGET, budget=64)
        pol.prior = prior  # type: ignore[method-assign]
        return pol

    return make


class _Damped(AutoBudget):
    """The deleted ``extrapolation_damping``: beyond the last tree, each doubling adds this share of the last one's
    gain (0: no extrapolation; 1 is the shipped rule)."""

    damping: float = 0.7

    def expected_emitted(self, b: int) -> float:
        B = len(self._curve)
        if not self._curve or b <= B:
            return super().expected_emitted(b)
        g = self._curve[B - 1] - self._curve[max(B // 2, 1) - 1]
        raw, size = self._curve[B - 1], B
        while size < b:
            g *= self.damping
            raw += g * min(1.0, math.log2(b / size))
            size *= 2
        return min(1.0 + self._acc_scale * (raw - 1.0), self.max_depth + 1.0)


class _Clamped(AutoBudget):
    """The deleted acc_scale clamps [0.2, 5]."""

    def update(self, step: StepInfo) -> None:
        super().update(step)
        self._acc_scale = min(max(self._acc_scale, 0.2), 5.0)


def _sub(cls: type[AutoBudget], **attrs: object) -> Callable[[Profile], AutoBudget]:
    def make(p: Profile) -> AutoBudget:
        target_s, draft_s = measure(p)
        pol = cls(target_s, draft_s, MAX_BEAMS, MAX_DEPTH, MAX_BUDGET, budget=64)
        for k, v in attrs.items():
            setattr(pol, k, v)
        return pol

    return make


class _NoPrior(AutoBudget):
    """No E[emitted] prior: the start budget until a tree is measured."""

    def choose(self, left: int | None = None, lag: int = 0) -> Arm:
        if self._curve:
            return super().choose(left, lag)
        self.history.append(self.budget)
        return Arm.nodes(self.budget)


ABLATIONS: dict[str, tuple[str, str, Callable[[Profile], AutoBudget]]] = {
    # name: (value, neutral or alternative, the policy with it)
    "explore_every": ("8", "never", _cfg(explore_every=10**9)),
    "explore_every=4": ("8", "4", _cfg(explore_every=4)),
    "alpha": ("0.3", "0 (no online correction)", _cfg(alpha=0.0)),
    "alpha=1": ("0.3", "1 (last step only)", _cfg(alpha=1.0)),
    "alpha=0.2 (old acc_alpha)": ("0.3", "0.2", _cfg(alpha=0.2)),
    "prior_slope": ("1.2", "0 (no gain before a tree)", _cfg(prior_slope=0.0)),
    "prior_slope=3": ("1.2", "3", _cfg(prior_slope=3.0)),
    "no E prior": ("1.2", "start budget until a tree", _sub(_NoPrior)),
    "extrapolation (deleted)": ("undamped", "0.7 damping (old)", _sub(_Damped, damping=0.7)),
    "no extrapolation": ("undamped", "0 (flat beyond the tree)", _sub(_Damped, damping=0.0)),
    "acc_scale clamp (deleted)": ("none", "[0.2, 5] (old)", _sub(_Clamped)),
    "passes prior": ("log2+beams", "max_depth", _passes_prior(lambda b: MAX_DEPTH)),
    "passes prior, no beams": (
        "log2+beams",
        "1+ceil(log2(1+b))",
        _passes_prior(lambda b: 1 + math.ceil(math.log2(1 + b))),
    ),
    "measure_costs 3x stop": ("3x", "measure all sizes", lambda p: auto(p, measure_all=True)),
}
# the drift rule's ablations, on two generations whose start-up was measured 3x slow (:func:`run_drift`)
DRIFT_ABLATIONS: dict[str, tuple[str, str, PolicyConfig]] = {
    "drift": ("1.5", "inf (never measure again)", replace(DEFAULT, drift=math.inf)),
}


def ablate(seeds: range = range(5), steps: int = 60, only: str | None = None) -> None:
    """Print, per ablation, the paired ratio ablated / default over every cell and seed (min and mean), against the
    noise band: the spread of the default's ratio to the best fixed budget over seeds (mean per-cell stdev)."""
    base: dict[tuple[str, str], list[float]] = {}
    rates: dict[tuple[str, str], list[float]] = {}
    for p in PROFILES.values():
        for a in ACCEPTANCE.values():
            rates[p.name, a.name] = [run(auto(p), p, a, s, steps) for s in seeds]
            base[p.name, a.name] = [r / best_fixed(p, a, s, steps)[1] for r, s in zip(rates[p.name, a.name], seeds)]
    noise = statistics.mean(statistics.stdev(v) for v in base.values())
    print(f"default vs best fixed in hindsight (min / mean over seeds), noise band ±{noise:.3f}")
    for (pn, an), v in base.items():
        print(f"  {pn:8s} {an:10s} {min(v):.3f} {statistics.mean(v):.3f}")
    print(f"{'tunable':26s} {'value':13s} {'neutral':26s} {'dmin':>7s} {'dmean':>7s}  worst cell")
    for name, (value, neutral, make) in ABLATIONS.items():
        if only and only not in name:
            continue
        d: list[tuple[float, str]] = []
        for p in PROFILES.values():
            for a in ACCEPTANCE.values():
                for s, r in zip(seeds, rates[p.name, a.name]):
                    d.append((run(make(p), p, a, s, steps) / r - 1, f"{p.name}/{a.name}"))
        _row(name, value, neutral, d, noise)
    for name, (value, neutral, cfg) in DRIFT_ABLATIONS.items():
        if only and only not in name:
            continue
        d = [
            (run_drift(p, a, s, cfg) / run_drift(p, a, s) - 1, f"{p.name}/{a.name}")
            for p in PROFILES.values()
            for a in ACCEPTANCE.values()
            for s in seeds
        ]
        _row(name, value, neutral, d, noise)


def _row(name: str, value: str, neutral: str, d: list[tuple[float, str]], noise: float) -> None:
    worst = min(d)
    mean = statistics.mean(x for x, _ in d)
    verdict = "matters" if worst[0] < -noise or mean < -noise / 3 else "within noise"
    print(f"{name:26s} {value:13s} {neutral:26s} {worst[0]:+7.3f} {mean:+7.3f}  {worst[1]} ({verdict})")


# -- drift: a start-up measured on a busy machine, measured again between generations ----------------------------
def busy(profile: Profile, factor: float = 3.0) -> Profile:
    """``profile`` as a busy start-up measured it: every pass ``factor`` times slower."""
    return replace(profile, measured_target=factor, measured_draft=factor)


def run_drift(
    profile: Profile,
    acc: Acceptance,
    seed: int,
    config: PolicyConfig = DEFAULT,
    factor: float = 3.0,
    first: int = 20,
    steps: int = 60,
) -> float:
    """Tokens/s over two generations (``first`` steps, then the rest) whose start-up was measured busy; between
    them the engine's drift rule (:func:`~specexec.policy.drifted`) may measure again (quietly)."""
    from specexec.policy import drifted

    rng = random.Random(seed)
    pol = auto(busy(profile, factor), config)
    tokens, seconds = 0, 0.0
    for i in range(steps):
        if i == first and drifted(pol):
            pol = auto(profile, config)
        t, s = step(pol, profile, acc, i, rng)
        tokens, seconds = tokens + t, seconds + s
    return tokens / seconds


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ablate", action="store_true", help="print the ablation table")
    ap.add_argument("--only", default=None)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    if args.ablate:
        ablate(range(args.seeds), only=args.only)
    else:
        for p in PROFILES.values():
            for a in ACCEPTANCE.values():
                r = ratios(auto, p, a, range(args.seeds))
                print(f"{p.name:8s} {a.name:10s} min {min(r):.3f} mean {statistics.mean(r):.3f}")
