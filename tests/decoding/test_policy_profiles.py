"""The CPU's measured-rate policy against recorded cost profiles of other machines and weight widths.

Each profile is what one CPU measured for one target/draft weight format: ms per target pass and per draft pass at
1/2/4/8/16/32/64 rows, at a ~300-token context. A simulated decode of a 128-token answer to a 300-token prompt feeds
:class:`AdaptiveBudget` the step times those costs give and the tokens an acceptance model of the text gives (code:
a draft that agrees often; prose: less; a text the draft never predicts). The draft reads the prompt only when a
step first asks for it, and the tokens of steps it sat out before its next one (a pass over the rows it lags, paid
by that step). Whatever the costs and the text, the policy must never decode slower than plain decoding in the same
weights (>= 0.95x, the draft's catch-ups included) and must come close to the best single arm chosen in hindsight
(>= 0.7x over one answer, exploration and the draft's first catch-up on the prompt included), also when every
step's time jitters as on a shared machine. With ``--draft heads`` the arms are plain decoding and head trees (no
draft pass; a few ms of their own).
"""

from __future__ import annotations

import random

import pytest

from specexec.decoding.budget import (
    DRAFT_KINDS,
    HEADS_ARM,
    LOSS_SHARE,
    TIE_MARGIN,
    AdaptiveBudget,
    VerifyCosts,
    arm_kind,
    interp,
)
from specexec.decoding.costs import CATCH_UP_ROWS, catch_up_s
from specexec.decoding.engine import CPU_ARMS, CPU_CHAINS, HEAD_ARMS
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
    # the same Xeon with every layer of a pass in one native call and the weights on huge pages: a one-row pass of
    # the target got cheaper than the draft's gained, so a draft pass is some 45% of a plain step
    "xeon-amx q4/q4 native": ((54, 64, 85, 139, 274, 412, 604), (24.5, 28, 43, 74, 102, 154, 331)),
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
HEAD_ARM_SET = tuple(HEADS_ARM + b if b else 0 for b in HEAD_ARMS)  # --draft heads: plain decoding and head trees
HEADS_MS = 4.0  # a head proposal: three small stages and output-layer slices, the tree


def _curve(ms: tuple[int, ...]) -> dict[int, float]:
    return {r: m / 1e3 for r, m in zip(ROWS, ms)}


def _step(
    arm: int,
    alpha: float,
    target: dict[int, float],
    draft: dict[int, float],
    rng: random.Random,
    noise: float = 1.0,
    lag: int = 0,
    lookup: tuple[int, int] = (1, 1),
) -> StepInfo:
    """One simulated step of ``arm`` (0: plain decoding; -g: a chain of g; b: a best-first tree of b tokens,
    two children per node along its best path; HEADS_ARM + b: b head guesses, at most 3 deep); ``noise``: its
    seconds times this (a shared machine's jitter); ``lag``: tokens a draft step first catches up on; ``lookup``:
    the rows a plain step verifies and the tokens it emits (prompt lookup's matches: (1, 1) where none)."""
    if arm == 0:
        rows, emitted = lookup
        return StepInfo(0, (), emitted, 0.0, interp(target, rows) * noise, 0, size=rows)
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


def _expected_rate(arm: int, alpha: float, target: dict[int, float], draft: dict[int, float]) -> float:
    """``arm``'s tokens/s over one answer, the draft's catch-up on the prompt included."""
    rng = random.Random(1)
    steps = [_step(arm, alpha, target, draft, rng) for _ in range(4000)]
    rate = sum(s.emitted for s in steps) / sum(s.draft_s + s.target_s for s in steps)
    if arm_kind(arm) in DRAFT_KINDS:
        rate = ANSWER / (ANSWER / rate + catch_up_s(PROMPT, lambda r: interp(draft, r)))
    return rate


def _answer(
    policy: AdaptiveBudget,
    alpha: float,
    target: dict[int, float],
    draft: dict[int, float],
    rng: random.Random,
    noise: list[float],
    prompt: int = PROMPT,
    answer: int = ANSWER,
    lookup: tuple[int, int] = (1, 1),
) -> tuple[int, float]:
    """Simulate one answer under ``policy``: (tokens, seconds), catch-ups included."""
    tokens, seconds, lag = 0, 0.0, prompt
    for i in range(answer):
        if tokens >= answer:
            break
        arm = policy.choose(left=answer - tokens, lag=lag)
        step = _step(arm, alpha, target, draft, rng, noise[i], lag if arm_kind(arm) in DRAFT_KINDS else 0, lookup)
        policy.update(step)
        lag = 0 if arm_kind(arm) in DRAFT_KINDS else lag + step.emitted
        tokens += step.emitted
        seconds += step.draft_s + step.target_s
    return tokens, seconds


DRAFT_ARM_SET = (0, *(-g for g in CPU_CHAINS), *CPU_ARMS)  # the default: plain decoding, chains and trees
ARM_SETS = {"draft": DRAFT_ARM_SET, "heads": HEAD_ARM_SET}


@pytest.mark.parametrize("arm_set", list(ARM_SETS))
@pytest.mark.parametrize("jitter", [0.0, JITTER], ids=["steady", "jittery"])
@pytest.mark.parametrize("text", list(TEXTS))
@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_policy_never_loses_to_plain_decoding_and_finds_the_best_arm(profile, text, jitter, arm_set):
    target, draft = (_curve(c) for c in PROFILES[profile])
    alpha = TEXTS[text]
    arms = ARM_SETS[arm_set]
    # the best arm it may try: a draft whose catch-up on the prompt alone could cost more than the answer's share
    # a try may lose (the policy cannot know the draft's acceptance before trying it) is not a fair benchmark
    plain_s = ANSWER * target[1]
    affordable = [
        a
        for a in arms
        if arm_kind(a) not in DRAFT_KINDS or catch_up_s(PROMPT, lambda r: interp(draft, r)) <= LOSS_SHARE * plain_s
    ]
    best = max(_expected_rate(a, alpha, target, draft) for a in affordable)
    rates, ratios = [], []
    for seed in range(5):
        rng = random.Random(seed)
        # the machine's jitter by step: plain decoding, the baseline, runs under the same
        noise = [1.0 + random.Random(1000 + seed).uniform(-jitter, jitter) if jitter else 1.0 for _ in range(ANSWER)]
        policy = AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), draft=VerifyCosts(dict(draft)))
        tokens, seconds = _answer(policy, alpha, target, draft, rng, noise)
        ar_rate = tokens / sum(target[1] * n for n in noise[:tokens])
        rates.append(tokens / seconds)
        ratios.append(rates[-1] / ar_rate)
    mean = sum(rates) / len(rates)
    assert min(ratios) >= 0.95, (profile, text, [round(r, 2) for r in ratios])
    assert mean >= 0.7 * best, (profile, text, round(mean / best, 2))


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
        cheap.update(_step(cheap.choose(left=ANSWER), 0.0, target, {1: 0.005, 64: 0.005}, random.Random(0)))
    assert any(a < 0 for a in cheap.history), cheap.history


def test_untried_head_trees_are_rated_from_the_measured_heads():
    """One head arm's steps rate every other head tree (a model of their accepted depth and the verification
    curve), as one chain's steps rate every chain length: guesses that hit make deeper head trees look better,
    guesses that miss rule them all out."""
    target = _curve(PROFILES["epyc-avx2 q4/int8"][0])
    arms = HEAD_ARM_SET
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


@pytest.mark.parametrize("prompt, answer, tried", [(2000, 32, False), (30, 128, True)])
def test_a_draft_is_first_tried_only_when_its_catch_up_fits_the_answer(prompt, answer, tried):
    """The draft reads the prompt at its first step: behind a long prompt a short answer cannot repay that (the
    policy stays with plain decoding, no slower than it); behind a short one the draft is tried and pays."""
    target, draft = (_curve(c) for c in PROFILES["epyc-avx512 bf16/int8"])
    arms = (0, *(-g for g in CPU_CHAINS), *CPU_ARMS)
    policy = AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), draft=VerifyCosts(dict(draft)))
    tokens, seconds = _answer(policy, TEXTS["code"], target, draft, random.Random(0), [1.0] * answer, prompt, answer)
    assert any(arm_kind(a) in DRAFT_KINDS for a in policy.history) == tried, policy.history
    assert tokens / seconds >= (1.5 if tried else 0.95) / target[1]


def test_a_new_text_starts_at_plain_decoding_and_re_measures_it():
    """The policy outlives a generation, but what an arm yields depends on the text: after an answer the draft won,
    the next one starts with a plain step, and where plain steps now emit several tokens (an n-gram-rich text) it
    takes the lead at once instead of after the draft arms' explorations."""
    target, draft = (_curve(c) for c in PROFILES["epyc-avx512 bf16/int8"])
    arms = (0, *(-g for g in CPU_CHAINS), *CPU_ARMS)
    policy = AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), draft=VerifyCosts(dict(draft)))
    _answer(policy, TEXTS["code"], target, draft, random.Random(0), [1.0] * ANSWER, 30, ANSWER)
    assert arm_kind(policy.choose(left=ANSWER)) in DRAFT_KINDS  # the draft leads on that text
    policy.new_text()
    assert policy.choose(left=ANSWER) == 0
    policy.update(StepInfo(0, (-0.1, -0.2), 4, 0.0, interp(target, 3), 0, size=3))  # 4 tokens at 3 rows
    assert policy.choose(left=ANSWER - 4) == 0


def test_a_draft_first_try_is_weighed_against_this_answer_alone():
    """The policy outlives a generation, but what a first try of the draft may cost is a share of the answer it
    falls in: the time earlier answers took does not make a catch-up on a new prompt affordable."""
    target, draft = (_curve(c) for c in PROFILES["epyc-avx512 bf16/int8"])
    arms = (0, *(-g for g in CPU_CHAINS), *CPU_ARMS)
    policy = AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), draft=VerifyCosts(dict(draft)))
    _answer(policy, TEXTS["code"], target, draft, random.Random(0), [1.0] * 128, 5000, 128)
    assert set(policy.history) == {0}  # far too long a prompt to read for this answer
    policy.new_text()
    tokens, seconds = _answer(policy, TEXTS["code"], target, draft, random.Random(1), [1.0] * 32, 600, 32)
    assert set(policy.history) == {0}, policy.history
    assert tokens / seconds >= 0.95 / target[1]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_an_arm_rated_on_an_earlier_text_runs_on_a_new_one_only_within_its_loss_share(profile):
    """The policy outlives a generation: a draft arm that led on a code answer is rated on that text, and the next
    answer's text may be one the draft never predicts. Choosing it there is a try like any other: the answer it
    falls in still decodes no slower than plain decoding (>= 0.95x, its catch-up and its missed steps included)."""
    target, draft = (_curve(c) for c in PROFILES[profile])
    arms = (0, *(-g for g in CPU_CHAINS), *CPU_ARMS)
    ratios = []
    for seed in range(5):
        policy = AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), draft=VerifyCosts(dict(draft)))
        _answer(policy, TEXTS["code"], target, draft, random.Random(seed), [1.0] * 256, 20, 256)
        policy.new_text()
        tokens, seconds = _answer(policy, TEXTS["hopeless"], target, draft, random.Random(seed), [1.0] * 64, 41, 64)
        ratios.append(tokens * target[1] / seconds)
    assert min(ratios) >= 0.95, [round(r, 3) for r in ratios]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_first_try_of_the_draft_is_counted_at_its_worst_step(profile):
    """Before a draft arm has ever run, its worst step (its draft passes and verification from the cost curves,
    emitting one token) is counted beside its catch-up on the prompt: on a short answer to a text the draft never
    predicts, whatever the prompt's length, the answer decodes no slower than plain decoding."""
    target, draft = (_curve(c) for c in PROFILES[profile])
    arms = (0, *(-g for g in CPU_CHAINS), *CPU_ARMS)
    ratios = {}
    for prompt in (8, 16, 24, 32, 48, 64, 96):
        policy = AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), draft=VerifyCosts(dict(draft)))
        tokens, seconds = _answer(policy, TEXTS["hopeless"], target, draft, random.Random(0), [1.0] * 64, prompt, 64)
        ratios[prompt] = round(tokens * target[1] / seconds, 3)
    assert min(ratios.values()) >= 0.95, ratios


@pytest.mark.parametrize("profile", list(PROFILES))
def test_plain_decoding_is_priced_by_what_its_steps_cost_on_this_text(profile):
    """A plain step costs what the text makes it: where prompt lookup matches, it verifies a trie of several rows
    and emits several tokens; on the next text, one row and one token. What plain steps cost on the earlier text
    must not price plain decoding on the new one (a dearer plain step, kept, lets a draft arm that loses to plain
    decoding lead), and plain decoding, which cannot lose, is explored even once an answer's tries have spent
    their loss share: the answer on the new text decodes no slower than plain decoding."""
    target, draft = (_curve(c) for c in PROFILES[profile])
    arms = (0, *(-g for g in CPU_CHAINS), *CPU_ARMS)
    ratios = []
    for seed in range(5):
        policy = AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), draft=VerifyCosts(dict(draft)))
        rng = random.Random(seed)
        _answer(policy, TEXTS["hopeless"], target, draft, rng, [1.0] * 64, 100, 64, lookup=(8, 3))
        policy.new_text()
        tokens, seconds = _answer(policy, TEXTS["prose"], target, draft, rng, [1.0] * 64, 90, 64)
        ratios.append(tokens * target[1] / seconds)
    assert min(ratios) >= 0.95, [round(r, 3) for r in ratios]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_missed_lookup_bet_does_not_make_plain_decoding_look_slow(profile):
    """A missed prompt-lookup bet (a plain step that verifies 8 rows and emits one token) among a text's first
    steps makes plain steps' measured rate lower than plain decoding's; a draft arm priced against that rate, or
    a first try priced against an answer that long, would run where it loses. The answer decodes no slower than
    plain decoding after such a step."""
    target, draft = (_curve(c) for c in PROFILES[profile])
    arms = (0, *(-g for g in CPU_CHAINS), *CPU_ARMS)
    ratios = []
    for seed in range(5):
        policy = AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), draft=VerifyCosts(dict(draft)))
        for rows in (1, 8):
            assert policy.choose(left=64) == 0
            policy.update(StepInfo(0, (), 1, 0.0, interp(target, rows), 0, size=rows))
        tokens, seconds = _answer(policy, TEXTS["prose"], target, draft, random.Random(seed), [1.0] * 62, 60, 62)
        ratios.append(tokens * target[1] / seconds)
    assert min(ratios) >= 0.95, [round(r, 3) for r in ratios]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_what_the_heads_measured_carries_into_the_next_text(profile):
    """The heads' acceptance is mostly their own: a new text's head trees are rated from the start by what the
    heads measured on the texts before (not left to the luck of a first guess), with a few steps' weight, so a
    text where they never hit, after texts where they led, still decodes no slower than plain decoding."""
    target, draft = (_curve(c) for c in PROFILES[profile])
    policy = AdaptiveBudget(HEAD_ARM_SET, verify=VerifyCosts(dict(target)), heads_depth=3)
    assert policy.rate(HEADS_ARM + 1) is None  # nothing measured yet
    ratios = []
    for i, text in enumerate(("code", "code", "hopeless", "code", "hopeless", "hopeless")):
        if i:
            policy.new_text()
            assert policy.rate(HEADS_ARM + 1) is not None
        tokens, seconds = _answer(policy, TEXTS[text], target, draft, random.Random(i), [1.0] * 64, 0, 64)
        ratios.append(round(tokens * target[1] / seconds, 3))
    assert min(ratios) >= 0.95, (profile, ratios)
