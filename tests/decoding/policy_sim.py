"""A simulation of the CPU's measured-rate policy on recorded cost profiles, and its ablation runner.

Each profile is what one CPU measured for one target/draft weight format: ms per target pass and per draft pass at
1/2/4/8/16/32/64 rows, at a ~300-token context (one, marked so, is constructed: a CPU where speculation barely
pays). A simulated answer feeds :class:`AdaptiveBudget` the step times those costs give and the tokens an acceptance
model of the text gives (code: a draft that agrees often; prose: less; a text the draft never predicts). The draft
reads the prompt only when a step first asks for it, and the tokens of steps it sat out before its next one (a pass
over the rows it lags, paid by that step). With ``--draft heads`` the arms are plain decoding and head trees (no
draft pass; a few ms of their own).

The families (:func:`run_profile`), each a list of answers with their policy/plain ratio:

- ``main``: {code, prose, hopeless} x {draft arms, heads arms} x {steady, jitter} x seeds, prompt 300, answer
  128; each configuration also against the best single arm in hindsight (mean over its seeds);
- ``prompts``: hopeless/prose x prompt {8, 32, 96, 600, 2000} x answer {32, 64} (first tries at their worst);
- ``seq``: one policy over 5 texts, ``new_text()`` between them;
- ``lookup``: prompt lookup on plain steps, priced as :mod:`specexec.propose.ngram` prices it and trimmed by the
  policy's ``trim_rule()``, over 5 texts whose matches repeat or miss.

``python -m tests.decoding.policy_sim --ablate`` runs every family on every profile with each of the policy's
tunables set neutral, and prints the change of the floors against the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from specexec.policy import DEFAULT, AdaptiveBudget, PolicyConfig, VerifyCosts, interp
from specexec.policy.cpu import DRAFT_KINDS
from specexec.propose.ngram import PRIOR_TRIALS, LookupRecord
from specexec.steps.record import PLAIN, Arm, StepInfo
from specexec.steps.rules import CATCH_UP_ROWS, catch_up_s

ROWS = (1, 2, 4, 8, 16, 32, 64)
CONSTRUCTED = "epyc-avx512 q4/int8 (constructed)"
PROFILES = {
    # a 2-core AMD EPYC with AVX512-BF16 (no AMX): the demo pair, bf16 target, int8 draft
    "epyc-avx512 bf16/int8": ((122, 117, 120, 133, 160, 201, 346), (15, 17, 18, 21, 29, 42, 73)),
    # a 2-core AMD EPYC with AVX2 only (this project's build machine): the demo pair, int8 target (bf16
    # activations, the int8pack kernel), int8 draft
    "epyc-avx2 int8/int8": ((159, 171, 258, 497, 911, 1685, 2966), (40, 40, 51, 44, 76, 152, 295)),
    # the same CPU and pair, fp32 target (shape-invariant passes in row tiles of 16), int8 draft
    "epyc-avx2 fp32/int8": ((807, 774, 757, 757, 742, 1136, 1950), (39, 34, 37, 46, 82, 143, 279)),
    # the same CPU and pair, 4-bit target (our kernel: a single row costs reading the weights, more rows cost
    # compute), int8 draft: a draft pass is some 70% of a plain step
    "epyc-avx2 q4/int8": ((49, 56, 82, 146, 282, 575, 1167), (34, 36, 37, 48, 79, 142, 281)),
    # a 2-core Intel Xeon with AMX, its host busy (memory reads at 14 GB/s, 24 when quiet): 4-bit target and
    # draft (AVX-512 VNNI up to 15 rows, AMX tiles from 16), a draft pass a third of a plain step
    "xeon-amx q4/q4": ((161, 143, 176, 221, 418, 588, 839), (52, 49, 60, 88, 156, 248, 414)),
    # the same Xeon with every layer of a pass in one native call and the weights on huge pages: a one-row pass of
    # the target got cheaper than the draft's gained, so a draft pass is some 45% of a plain step
    "xeon-amx q4/q4 native": ((54, 64, 85, 139, 274, 412, 604), (24.5, 28, 43, 74, 102, 154, 331)),
    # CONSTRUCTED, not recorded: a 2-core AMD EPYC with AVX-512 (no AMX), the demo pair with a 4-bit target (one
    # row reads ~4x fewer bytes than bf16's; extra rows cost compute, about half the AVX2 q4 profile's slope) and
    # the int8 draft of the recorded AVX-512 profile: a draft pass is ~0.68x a plain step, speculation barely pays
    CONSTRUCTED: ((22, 26, 38, 66, 125, 250, 500), (15, 17, 18, 21, 29, 42, 73)),
}
PROMPT = 300  # tokens the draft has yet to read when the answer starts
ANSWER = 128  # tokens the answer runs to
JITTER = 0.15  # a shared CPU's step times: each step's seconds times a factor drawn from 1 +- this
# per-token chance the draft's top guess is the target's; the second-best guess adds SECOND of the rest
TEXTS = {"code": 0.8, "prose": 0.55, "hopeless": 0.0}
# the same for the heads' top guess (the demo target's shipped heads, one-node head trees on the real pair: 1.33-1.49
# tokens a step on code prompts, 1.21-1.42 on prose)
HEAD_TEXTS = {"code": 0.45, "prose": 0.35, "hopeless": 0.0}
SECOND = 0.4
HOST_MS = 2.0  # per draft pass: tree building, masks, the policy itself
HEADS_MS = 4.0  # a head proposal: three small stages and output-layer slices, the tree
HEAD_ARM_SET = tuple(Arm("heads", b) if b else PLAIN for b in DEFAULT.head_trees)
DRAFT_ARM_SET = (PLAIN, *(Arm("chain", g) for g in DEFAULT.cpu_chains), *(Arm("tree", b) for b in DEFAULT.cpu_trees))
ARM_SETS = {"draft": DRAFT_ARM_SET, "heads": HEAD_ARM_SET}
LOOKUP_NODES, LOOKUP_MATCH = 8, 0.6  # trie nodes (one continuation), chance a plain step has a match
LOOKUP_HIT = {"repeat": 0.7, "miss": 0.05}  # the target's chance to take each trie node

Make = Callable[[tuple[Arm, ...], dict[int, float], dict[int, float]], AdaptiveBudget]


def curve(ms: Iterable[float]) -> dict[int, float]:
    return {r: m / 1e3 for r, m in zip(ROWS, ms)}


def curves(profile: str) -> tuple[dict[int, float], dict[int, float]]:
    """A profile's (target, draft) seconds by rows."""
    target, draft = PROFILES[profile]
    return curve(target), curve(draft)


def policy(arms: tuple[Arm, ...], target: dict[int, float], draft: dict[int, float], config: PolicyConfig = DEFAULT):
    """The policy as the engine builds it, on a profile's curves."""
    verify, draft_costs = VerifyCosts(dict(target), config=config), VerifyCosts(dict(draft), config=config)
    return AdaptiveBudget(arms, config=config, verify=verify, draft=draft_costs)


def step(
    arm: Arm,
    alpha: float,
    target: dict[int, float],
    draft: dict[int, float],
    rng: random.Random,
    noise: float = 1.0,
    lag: int = 0,
    lookup: tuple[int, int] = (1, 1),
) -> StepInfo:
    """One simulated step of ``arm`` (plain decoding; a chain of g; a best-first tree of b tokens, two children per
    node along its best path; a head tree of b: b head guesses, at most 3 deep); ``noise``: its seconds times this
    (a shared machine's jitter); ``lag``: tokens a draft step first catches up on; ``lookup``: the rows a plain step
    verifies and the tokens it emits (prompt lookup's matches: (1, 1) where none)."""
    if arm == PLAIN:
        rows, emitted = lookup
        return StepInfo(PLAIN, (), emitted, 0.0, interp(target, rows) * noise, 0, size=rows)
    if arm.kind == "heads":
        b = arm.size
        beta = next(HEAD_TEXTS[t] for t, a in TEXTS.items() if a == alpha)
        depth = min(b, 3)
        p = beta + (1 - beta) * beta * SECOND if b > depth else beta
        accepted = 0
        while accepted < depth and rng.random() < p:
            accepted += 1
        logp = [-0.5 * (i + 1) for i in range(b)]
        return StepInfo(arm, logp, accepted + 1, HEADS_MS / 1e3 * noise, interp(target, b + 1) * noise, 0, size=b + 1)
    if arm.kind == "chain":
        g = arm.size
        passes, rows, p = g, g + 1, alpha
        beams = [1] * g
    else:
        g = arm.size // 2  # depth of a two-children-per-level tree of b tokens
        passes, rows, p = g, arm.size + 1, alpha + (1 - alpha) * alpha * SECOND
        beams = [min(2**i, 8) for i in range(g)]
    accepted = 0
    while accepted < g and rng.random() < p:
        accepted += 1
    catch = catch_up_s(lag, lambda r: interp(draft, r)) * noise
    draft_s = sum(interp(draft, b) + HOST_MS / 1e3 for b in beams) * noise + catch
    logp = [-0.3 * (i + 1) for i in range(rows - 1)]
    return StepInfo(
        arm,
        logp,
        accepted + 1,
        draft_s,
        interp(target, rows) * noise,
        passes,
        catch_up_s=catch if lag >= CATCH_UP_ROWS else 0.0,
        size=rows,
    )


def expected_rate(arm: Arm, alpha: float, target: dict[int, float], draft: dict[int, float]) -> float:
    """``arm``'s tokens/s over one answer, the draft's catch-up on the prompt included."""
    rng = random.Random(1)
    steps = [step(arm, alpha, target, draft, rng) for _ in range(4000)]
    rate = sum(s.emitted for s in steps) / sum(s.draft_s + s.target_s for s in steps)
    if arm.kind in DRAFT_KINDS:
        rate = ANSWER / (ANSWER / rate + catch_up_s(PROMPT, lambda r: interp(draft, r)))
    return rate


def best_rate(profile: str, text: str, arms: tuple[Arm, ...]) -> float:
    """The best single arm's rate in hindsight, among the arms the policy may try: a draft whose catch-up on the
    prompt alone could cost more than the answer's loss share is not a fair benchmark (its acceptance is unknown
    before a try)."""
    target, draft = curves(profile)
    share = DEFAULT.loss_share * ANSWER * target[1]
    cu = catch_up_s(PROMPT, lambda r: interp(draft, r))
    ok = [a for a in arms if a.kind not in DRAFT_KINDS or cu <= share]
    return max(expected_rate(a, TEXTS[text], target, draft) for a in ok)


class Lookup:
    """Prompt lookup's pricing as :mod:`specexec.propose.ngram` does it: a node at depth d has logp d * log(acc),
    acc the text's counts beside a prior from the earlier texts' (LookupRecord), updated after every bet."""

    def __init__(self) -> None:
        self.record = LookupRecord()
        self.new_text()

    def new_text(self) -> None:
        self.prior = self.record.new_text()
        self.text = LookupRecord()

    def logp(self) -> torch.Tensor:
        acc = (self.text.hits + self.prior * PRIOR_TRIALS) / (self.text.trials + PRIOR_TRIALS)
        return torch.tensor([(i + 1) * math.log(max(acc, 1e-6)) for i in range(LOOKUP_NODES)])

    def add(self, accepted: int, kept: int) -> None:
        tried = min(kept, accepted + 1)
        self.text.add(accepted, tried)
        self.record.add(accepted, tried)


def noise_for(seed: int, jitter: float, n: int) -> list[float]:
    """The machine's jitter by step (plain decoding, the baseline, runs under the same)."""
    r = random.Random(1000 + seed)
    return [1.0 + r.uniform(-jitter, jitter) if jitter else 1.0 for _ in range(n)]


@dataclass
class Answer:
    tokens: int
    seconds: float
    plain_s: float  # plain decoding's seconds for the same tokens (one row a step, no lookup, the same jitter)
    arms: list[Arm] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.plain_s / self.seconds


def answer(
    pol: AdaptiveBudget,
    alpha: float,
    target: dict[int, float],
    draft: dict[int, float],
    rng: random.Random,
    noise: list[float],
    prompt: int = PROMPT,
    answer_len: int = ANSWER,
    lookup_hit: float | None = None,
    lookup: Lookup | None = None,
    plain_lookup: tuple[int, int] = (1, 1),
) -> Answer:
    """Simulate one answer under ``pol``; with ``lookup_hit``, plain steps bet on prompt lookup's trie."""
    tokens, seconds, lag, chosen = 0, 0.0, prompt, []
    for i in range(answer_len):
        if tokens >= answer_len:
            break
        arm = pol.choose(left=answer_len - tokens, lag=lag)
        chosen.append(arm)
        lk = plain_lookup
        if arm == PLAIN and lookup is not None and lookup_hit is not None and rng.random() < LOOKUP_MATCH:
            rule = pol.trim_rule()
            k = rule.keep(lookup.logp()) if rule is not None else LOOKUP_NODES
            acc = 0
            while acc < k and rng.random() < lookup_hit:
                acc += 1
            if k:
                lookup.add(acc, k)
            lk = (1 + k, 1 + acc)
        s = step(arm, alpha, target, draft, rng, noise[i], lag if arm.kind in DRAFT_KINDS else 0, lk)
        pol.update(s)
        lag = 0 if arm.kind in DRAFT_KINDS else lag + s.emitted
        tokens += s.emitted
        seconds += s.draft_s + s.target_s
    return Answer(tokens, seconds, sum(target[1] * n for n in noise[:tokens]), chosen)


@dataclass
class Row:
    """One configuration of a family: its answers' policy/plain ratios (and, for main, the mean rate over the
    best single arm's)."""

    family: str
    profile: str
    name: str
    ratios: list[float]
    vs_best: float | None = None


def run_profile(profile: str, seeds: Iterable[int], make: Make = policy, best: bool = True) -> list[Row]:
    """Every family on one profile under policies from ``make(arms, target, draft)``."""
    seeds = list(seeds)
    target, draft = curves(profile)
    rows = []
    for text, alpha in TEXTS.items():  # main
        for arm_set, arms in ARM_SETS.items():
            for jit in (0.0, JITTER):
                answers = [
                    answer(make(arms, target, draft), alpha, target, draft, random.Random(s), noise_for(s, jit, ANSWER))
                    for s in seeds
                ]
                vs = None
                if best:
                    vs = sum(a.tokens / a.seconds for a in answers) / len(answers) / best_rate(profile, text, arms)
                name = f"{text}/{arm_set}/{'jitter' if jit else 'steady'}"
                rows.append(Row("main", profile, name, [a.ratio for a in answers], vs))
    for text in ("hopeless", "prose"):  # first tries at their worst, behind prompts short and long
        for prompt in (8, 32, 96, 600, 2000):
            for n in (32, 64):
                ratios = [
                    answer(make(DRAFT_ARM_SET, target, draft), TEXTS[text], target, draft, random.Random(s), [1.0] * n,
                           prompt, n).ratio
                    for s in seeds
                ]  # fmt: skip
                rows.append(Row("prompts", profile, f"{text}/p{prompt}/a{n}", ratios))
    seq = (("code", 20), ("hopeless", 41), ("prose", 90), ("code", 60), ("hopeless", 30))
    lookup_texts = (("prose", "repeat"), ("prose", "miss"), ("code", "repeat"), ("hopeless", "miss"), ("prose", "miss"))
    for arm_set, arms in ARM_SETS.items():  # one policy kept across texts
        per: dict[str, list[float]] = {}
        for s in seeds:
            pol, rng = make(arms, target, draft), random.Random(s)
            for i, (text, prompt) in enumerate(seq):
                if i:
                    pol.new_text()
                a = answer(pol, TEXTS[text], target, draft, rng, [1.0] * 96, prompt, 96)
                per.setdefault(f"{arm_set}/{i}:{text}", []).append(a.ratio)
        rows += [Row("seq", profile, k, v) for k, v in per.items()]
    for arm_set, arms in ARM_SETS.items():  # prompt lookup on plain steps, across texts
        per = {}
        for s in seeds:
            pol, rng, lookup = make(arms, target, draft), random.Random(s), Lookup()
            for i, (text, hit) in enumerate(lookup_texts):
                if i:
                    pol.new_text()
                    lookup.new_text()
                a = answer(pol, TEXTS[text], target, draft, rng, [1.0] * 64, 60, 64, LOOKUP_HIT[hit], lookup)
                per.setdefault(f"{arm_set}/{i}:{text}-{hit}", []).append(a.ratio)
        rows += [Row("lookup", profile, k, v) for k, v in per.items()]
    return rows


def summarize(rows: list[Row]) -> dict[str, float]:
    """floor_min (the lowest policy/plain over every answer), below (answers under 0.95), main_mean, best_min and
    best_mean (main's configurations against the best single arm)."""
    ratios = [r for row in rows for r in row.ratios]
    main = [r for row in rows if row.family == "main" for r in row.ratios]
    best = [row.vs_best for row in rows if row.vs_best is not None]
    out = {"floor_min": min(ratios), "below": float(sum(r < 0.95 for r in ratios)), "main_mean": sum(main) / len(main)}
    if best:
        out |= {"best_min": min(best), "best_mean": sum(best) / len(best)}
    return out


# the policy's tunables, each set neutral: no margin, no loss budget, no periodic exploration, no smoothing (each
# quantity is its last measurement)
NEUTRAL: dict[str, Any] = {
    "margin": 0.0,
    "loss_share": math.inf,
    "explore_every": 10**9,
    "alpha": 1.0,
}


def _run(args: tuple[dict[str, Any], list[int]]) -> list[Row]:
    changes, seeds = args
    config = dataclasses.replace(DEFAULT, **changes)

    def make(arms: tuple[Arm, ...], target: dict[int, float], draft: dict[int, float]) -> AdaptiveBudget:
        return policy(arms, target, draft, config)

    return [row for p in PROFILES for row in run_profile(p, seeds, make)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ablate", action="store_true", help="each tunable neutral against the default")
    ap.add_argument("--seeds", default="0-4", help="a range of seeds, e.g. 0-4")
    ap.add_argument("-j", type=int, default=1, help="processes")
    a = ap.parse_args()
    lo, hi = a.seeds.split("-")
    seeds = list(range(int(lo), int(hi) + 1))
    variants: dict[str, dict[str, Any]] = {"default": {}}
    if a.ablate:
        variants |= {f"{k}={v:g}": {k: v} for k, v in NEUTRAL.items()}
    import multiprocessing

    with multiprocessing.Pool(a.j) as pool:
        results = dict(zip(variants, pool.map(_run, [(v, seeds) for v in variants.values()])))
    base = results["default"]
    print(f"{len(base)} configurations, {sum(len(r.ratios) for r in base)} answers, seeds {a.seeds}\n")
    print("| profile | floor_min (policy/plain) | best_min (policy/best arm) | main_mean |")
    print("|---|---|---|---|")
    for p in PROFILES:
        s = summarize([r for r in base if r.profile == p])
        print(f"| {p} | {s['floor_min']:.3f} | {s['best_min']:.3f} | {s['main_mean']:.3f} |")
    b = summarize(base)
    print(f"| all | {b['floor_min']:.3f} | {b['best_min']:.3f} | {b['main_mean']:.3f} |  below 0.95: {b['below']:.0f}")
    if not a.ablate:
        return
    print("\n| tunable | default -> neutral | Δfloor_min | Δbelow 0.95 | Δmain_mean | Δbest_min | Δbest_mean |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        if name == "default":
            continue
        s = summarize(rows)
        (k,) = variants[name]
        d = {m: s[m] - b[m] for m in s}
        print(
            f"| {k} | {getattr(DEFAULT, k)} -> {variants[name][k]:g} | {d['floor_min']:+.3f} | {d['below']:+.0f} | "
            f"{d['main_mean']:+.3f} | {d['best_min']:+.3f} | {d['best_mean']:+.3f} |"
        )


if __name__ == "__main__":
    main()
