"""The CPU's measured-rate policy against recorded cost profiles of other machines and weight widths.

Each profile is what one CPU measured for one target/draft weight format: ms per target pass and per draft pass at
1/2/4/8/16/32/64 rows, at a ~300-token context. A simulated decode feeds :class:`AdaptiveBudget` the step times
those costs give and the tokens an acceptance model of the text gives (code: a draft that agrees often; prose:
less; a text the draft never predicts). Whatever the costs and the text, the policy must never decode slower
than plain decoding in the same weights (>= 0.95x) and must come close to the best single arm chosen in
hindsight (>= 0.75x over a 60-step answer, exploration included), also when every step's time jitters as on a
shared machine. With the target's heads loaded, head trees are arms too (no draft pass; a few ms of their own).
"""

from __future__ import annotations

import random

import pytest

from specexec.decoding.budget import HEADS_ARM, TIE_MARGIN, AdaptiveBudget, VerifyCosts, interp
from specexec.decoding.engine import CPU_ARMS, CPU_CHAINS, CPU_HEAD_ARMS
from specexec.decoding.loop import StepInfo

ROWS = (1, 2, 4, 8, 16, 32, 64)
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
}
JITTER = 0.15  # a shared CPU's step times: each step's seconds times a factor drawn from 1 +- this
# per-token chance the draft's top guess is the target's; the second-best guess adds SECOND of the rest
TEXTS = {"code": 0.8, "prose": 0.55, "hopeless": 0.0}
# the same for the heads' top guess (the demo target's shipped heads, one-node head trees on the real pair: 1.33-1.49
# tokens a step on code prompts, 1.21-1.42 on prose)
HEAD_TEXTS = {"code": 0.45, "prose": 0.35, "hopeless": 0.0}
SECOND = 0.4
HOST_MS = 2.0  # per draft pass: tree building, masks, the policy itself
HEADS_MS = 4.0  # a head proposal: three small stages and output-layer slices, the tree


def _curve(ms: tuple[int, ...]) -> dict[int, float]:
    return {r: m / 1e3 for r, m in zip(ROWS, ms)}


def _step(
    arm: int, alpha: float, target: dict[int, float], draft: dict[int, float], rng: random.Random, noise: float = 1.0
) -> StepInfo:
    """One simulated step of ``arm`` (0: plain decoding; -g: a chain of g; b: a best-first tree of b tokens,
    two children per node along its best path; HEADS_ARM + b: b head guesses, at most 3 deep); ``noise``: its
    seconds times this (a shared machine's jitter)."""
    if arm == 0:
        return StepInfo(0, (), 1, 0.0, interp(target, 1) * noise, 0, size=1)
    if arm >= HEADS_ARM:
        b = arm - HEADS_ARM
        beta = next(HEAD_TEXTS[t] for t, a in TEXTS.items() if a == alpha)
        depth = min(b, 3)
        p = beta + (1 - beta) * beta * SECOND if b > depth else beta
        accepted = 0
        while accepted < depth and rng.random() < p:
            accepted += 1
        logp = [-0.5 * (i + 1) for i in range(b)]
        return StepInfo(arm, logp, accepted + 1, HEADS_MS / 1e3 * noise, interp(target, b + 1) * noise, 0, size=b + 1)
    if arm < 0:
        g = -arm
        passes, rows, p = g, g + 1, alpha
        beams = [1] * g
    else:
        g = arm // 2  # depth of a two-children-per-level tree of b tokens
        passes, rows, p = g, arm + 1, alpha + (1 - alpha) * alpha * SECOND
        beams = [min(2**i, 8) for i in range(g)]
    accepted = 0
    while accepted < g and rng.random() < p:
        accepted += 1
    draft_s = sum(interp(draft, b) + HOST_MS / 1e3 for b in beams)
    logp = [-0.3 * (i + 1) for i in range(rows - 1)]
    return StepInfo(arm, logp, accepted + 1, draft_s * noise, interp(target, rows) * noise, passes, size=rows)


def _expected_rate(arm: int, alpha: float, target: dict[int, float], draft: dict[int, float]) -> float:
    rng = random.Random(1)
    steps = [_step(arm, alpha, target, draft, rng) for _ in range(4000)]
    return sum(s.emitted for s in steps) / sum(s.draft_s + s.target_s for s in steps)


@pytest.mark.parametrize("heads", [False, True], ids=["draft", "draft+heads"])
@pytest.mark.parametrize("jitter", [0.0, JITTER], ids=["steady", "jittery"])
@pytest.mark.parametrize("text", list(TEXTS))
@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_policy_never_loses_to_plain_decoding_and_finds_the_best_arm(profile, text, jitter, heads):
    target, draft = (_curve(c) for c in PROFILES[profile])
    alpha = TEXTS[text]
    arms = (0, *(-g for g in CPU_CHAINS), *CPU_ARMS, *((HEADS_ARM + b for b in CPU_HEAD_ARMS) if heads else ()))
    best = max(_expected_rate(a, alpha, target, draft) for a in arms)
    rates, ratios = [], []
    for seed in range(5):
        rng = random.Random(seed)
        # the machine's jitter by step: plain decoding, the baseline, runs under the same
        noise = [1.0 + random.Random(1000 + seed).uniform(-jitter, jitter) if jitter else 1.0 for _ in range(60)]
        ar_rate = len(noise) / sum(target[1] * n for n in noise)
        policy = AdaptiveBudget(arms, verify=VerifyCosts(dict(target)))
        tokens = seconds = 0.0
        for i in range(60):  # a 64-token answer is some 20-60 steps: judge the first ones too
            step = _step(policy.choose(), alpha, target, draft, rng, noise[i])
            policy.update(step)
            tokens += step.emitted
            seconds += step.draft_s + step.target_s
        rates.append(tokens / seconds)
        ratios.append(rates[-1] / ar_rate)
    mean = sum(rates) / len(rates)
    assert min(ratios) >= 0.95, (profile, text, [round(r, 2) for r in ratios])
    assert mean >= 0.75 * best, (profile, text, round(mean / best, 2))


def test_draft_arms_that_could_not_win_are_never_tried():
    """Once a draft pass and the verification curve are measured, a chain or tree that would lose to plain
    decoding even if the target took every drafted token is not explored (its first try would only cost)."""
    target = _curve((50, 56, 82, 146, 282, 575, 1167))
    policy = AdaptiveBudget((0, -2, -4, 4, 8), verify=VerifyCosts(dict(target)))
    policy.costs.pass_s = 0.040  # a draft pass costs 80% of a plain step
    for _ in range(40):
        arm = policy.choose()
        policy.update(_step(arm, 0.0, target, {1: 0.04, 64: 0.04}, random.Random(0)))
    assert set(policy.history) == {0}, policy.history
    cheap = AdaptiveBudget((0, -2, -4, 4, 8), verify=VerifyCosts(dict(target)))
    cheap.costs.pass_s = 0.005  # a cheap draft: chains could win, so they are tried
    for _ in range(12):
        cheap.update(_step(cheap.choose(), 0.0, target, {1: 0.005, 64: 0.005}, random.Random(0)))
    assert any(a < 0 for a in cheap.history), cheap.history


def test_untried_head_trees_are_rated_from_the_measured_heads():
    """One head arm's steps rate every other head tree (a model of their accepted depth and the verification
    curve), as one chain's steps rate every chain length: guesses that hit make deeper head trees look better,
    guesses that miss rule them all out."""
    target = _curve(PROFILES["epyc-avx2 q4/int8"][0])
    arms = (0, *(HEADS_ARM + b for b in CPU_HEAD_ARMS))
    hit, miss = (AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), heads_depth=3) for _ in range(2))
    for policy, emitted in ((hit, 2), (miss, 1)):
        policy.update(StepInfo(0, (), 1, 0.0, target[1], 0, size=1))
        for _ in range(6):
            policy.update(StepInfo(HEADS_ARM + 1, (-0.1,), emitted, 0.004, target[2], 0, size=2))
    for b in (2, 4):
        assert hit.rate(HEADS_ARM + b) is not None and hit.rate(HEADS_ARM + b) > (1 + TIE_MARGIN) * hit.rate(0)
    for b in (1, 2, 4, 8):
        assert miss.rate(HEADS_ARM + b) is not None and miss.rate(HEADS_ARM + b) < (1 + TIE_MARGIN) * miss.rate(0)
    assert miss.choose() == 0
