"""The CPU's measured-rate policy on recorded cost profiles (:mod:`tests.decoding.policy_sim`: six recorded, one
constructed where speculation barely pays). Whatever the costs and the text, over every simulated answer of every
family (main, prompts, seq, lookup) the policy decodes no slower than plain decoding in the same weights (>= 0.95x,
the draft's catch-ups, explorations and prompt-lookup bets included), and over an answer it comes close to the best
single arm chosen in hindsight (>= 0.7x, the mean over seeds), also when every step's time jitters as on a shared
machine. The study itself: ``python -m tests.decoding.policy_sim --ablate``.
"""

from __future__ import annotations

import random

import pytest

from specexec.policy import DEFAULT, AdaptiveBudget, VerifyCosts, interp
from specexec.policy.cpu import DRAFT_KINDS
from specexec.steps.record import PLAIN, Arm, StepInfo
from tests.decoding.policy_sim import (
    ANSWER,
    DRAFT_ARM_SET,
    HEAD_ARM_SET,
    PROFILES,
    TEXTS,
    answer,
    curves,
    policy,
    run_profile,
)
from tests.decoding.policy_sim import step as _step

SEEDS = range(3)  # the study runs 5 seeds and more; 3 hold the benchmarks' means steady enough for the floor


@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_policy_never_loses_to_plain_decoding_and_finds_the_best_arm(profile):
    rows = run_profile(profile, SEEDS)
    low = [(r.family, r.name, [round(x, 3) for x in r.ratios]) for r in rows if min(r.ratios) < 0.95]
    assert not low, (profile, low)
    far = [(r.name, round(r.vs_best, 3)) for r in rows if r.vs_best is not None and r.vs_best < 0.7]
    assert not far, (profile, far)


def _answer(pol, alpha, target, draft, rng, noise, prompt=300, n=ANSWER, lookup=(1, 1)) -> tuple[int, float]:
    a = answer(pol, alpha, target, draft, rng, noise, prompt, n, plain_lookup=lookup)
    return a.tokens, a.seconds


SMALL_ARMS = (PLAIN, Arm("chain", 2), Arm("chain", 4), Arm("tree", 4), Arm("tree", 8))


def test_draft_arms_that_could_not_win_are_never_tried():
    """Once a draft pass and the verification curve are measured, a chain or tree that would lose to plain
    decoding even if the target took every drafted token is not explored (its first try would only cost)."""
    target = {1: 0.05, 2: 0.056, 4: 0.082, 8: 0.146, 16: 0.282, 32: 0.575, 64: 1.167}
    pol = AdaptiveBudget(SMALL_ARMS, verify=VerifyCosts(dict(target)))
    pol.costs.pass_s = 0.040  # a draft pass costs 80% of a plain step
    for _ in range(40):
        arm = pol.choose()
        pol.update(_step(arm, 0.0, target, {1: 0.04, 64: 0.04}, random.Random(0)))
    assert set(pol.history) == {PLAIN}, pol.history
    cheap = AdaptiveBudget(SMALL_ARMS, verify=VerifyCosts(dict(target)))
    cheap.costs.pass_s = 0.005  # a cheap draft: chains could win, so they are tried
    for _ in range(12):
        cheap.update(_step(cheap.choose(left=ANSWER), 0.0, target, {1: 0.005, 64: 0.005}, random.Random(0)))
    assert any(a.kind == "chain" for a in cheap.history), cheap.history


def test_untried_head_trees_are_rated_from_the_measured_heads():
    """One head arm's steps rate every other head tree (a model of their accepted depth and the verification
    curve), as one chain's steps rate every chain length: guesses that hit make deeper head trees look better,
    guesses that miss rule them all out."""
    target = curves("epyc-avx2 q4/int8")[0]
    arms = HEAD_ARM_SET
    hit, miss = (AdaptiveBudget(arms, verify=VerifyCosts(dict(target)), heads_depth=3) for _ in range(2))
    for pol, emitted in ((hit, 2), (miss, 1)):
        pol.update(StepInfo(PLAIN, (), 1, 0.0, target[1], 0, size=1))
        for _ in range(6):
            pol.update(StepInfo(Arm("heads", 1), (-0.1,), emitted, 0.004, target[2], 0, size=2))
    for b in (2, 4):
        assert hit.rate(Arm("heads", b)) is not None and hit.rate(Arm("heads", b)) > (1 + DEFAULT.margin) * hit.rate(
            PLAIN
        )
    for b in (1, 2, 4, 8):
        assert miss.rate(Arm("heads", b)) is not None and miss.rate(Arm("heads", b)) < (1 + DEFAULT.margin) * miss.rate(
            PLAIN
        )
    assert miss.choose() == PLAIN


@pytest.mark.parametrize("prompt, answer, tried", [(2000, 32, False), (30, 128, True)])
def test_a_draft_is_first_tried_only_when_its_catch_up_fits_the_answer(prompt, answer, tried):
    """The draft reads the prompt at its first step: behind a long prompt a short answer cannot repay that (the
    policy stays with plain decoding, no slower than it); behind a short one the draft is tried and pays."""
    target, draft = curves("epyc-avx512 bf16/int8")
    arms = DRAFT_ARM_SET
    pol = policy(arms, target, draft)
    tokens, seconds = _answer(pol, TEXTS["code"], target, draft, random.Random(0), [1.0] * answer, prompt, answer)
    assert any(a.kind in DRAFT_KINDS for a in pol.history) == tried, pol.history
    assert tokens / seconds >= (1.5 if tried else 0.95) / target[1]


def test_a_new_text_starts_at_plain_decoding_and_re_measures_it():
    """The policy outlives a generation, but what an arm yields depends on the text: after an answer the draft won,
    the next one starts with a plain step, and where plain steps now emit several tokens (an n-gram-rich text) it
    takes the lead at once instead of after the draft arms' explorations."""
    target, draft = curves("epyc-avx512 bf16/int8")
    arms = DRAFT_ARM_SET
    pol = policy(arms, target, draft)
    _answer(pol, TEXTS["code"], target, draft, random.Random(0), [1.0] * ANSWER, 30, ANSWER)
    assert pol.choose(left=ANSWER).kind in DRAFT_KINDS  # the draft leads on that text
    pol.new_text()
    assert pol.choose(left=ANSWER) == PLAIN
    pol.update(StepInfo(PLAIN, (-0.1, -0.2), 4, 0.0, interp(target, 3), 0, size=3))  # 4 tokens at 3 rows
    assert pol.choose(left=ANSWER - 4) == PLAIN


def test_a_draft_first_try_is_weighed_against_this_answer_alone():
    """The policy outlives a generation, but what a first try of the draft may cost is a share of the answer it
    falls in: the time earlier answers took does not make a catch-up on a new prompt affordable."""
    target, draft = curves("epyc-avx512 bf16/int8")
    arms = DRAFT_ARM_SET
    pol = policy(arms, target, draft)
    _answer(pol, TEXTS["code"], target, draft, random.Random(0), [1.0] * 128, 5000, 128)
    assert set(pol.history) == {PLAIN}  # far too long a prompt to read for this answer
    pol.new_text()
    tokens, seconds = _answer(pol, TEXTS["code"], target, draft, random.Random(1), [1.0] * 32, 600, 32)
    assert set(pol.history) == {PLAIN}, pol.history
    assert tokens / seconds >= 0.95 / target[1]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_plain_decoding_is_priced_by_what_its_steps_cost_on_this_text(profile):
    """A plain step costs what the text makes it: where prompt lookup matches, it verifies a trie of several rows
    and emits several tokens; on the next text, one row and one token. What plain steps cost on the earlier text
    must not price plain decoding on the new one (a dearer plain step, kept, lets a draft arm that loses to plain
    decoding lead), and plain decoding, which cannot lose, is explored even once an answer's tries have spent
    their loss share: the answer on the new text decodes no slower than plain decoding."""
    target, draft = curves(profile)
    arms = DRAFT_ARM_SET
    ratios = []
    for seed in range(5):
        pol = policy(arms, target, draft)
        rng = random.Random(seed)
        _answer(pol, TEXTS["hopeless"], target, draft, rng, [1.0] * 64, 100, 64, lookup=(8, 3))
        pol.new_text()
        tokens, seconds = _answer(pol, TEXTS["prose"], target, draft, rng, [1.0] * 64, 90, 64)
        ratios.append(tokens * target[1] / seconds)
    assert min(ratios) >= 0.95, [round(r, 3) for r in ratios]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_missed_lookup_bet_does_not_make_plain_decoding_look_slow(profile):
    """A missed prompt-lookup bet (a plain step that verifies 8 rows and emits one token) among a text's first
    steps makes plain steps' measured rate lower than plain decoding's; a draft arm priced against that rate, or
    a first try priced against an answer that long, would run where it loses. The answer decodes no slower than
    plain decoding after such a step."""
    target, draft = curves(profile)
    arms = DRAFT_ARM_SET
    ratios = []
    for seed in range(5):
        pol = policy(arms, target, draft)
        for rows in (1, 8):
            assert pol.choose(left=64) == PLAIN
            pol.update(StepInfo(PLAIN, (), 1, 0.0, interp(target, rows), 0, size=rows))
        tokens, seconds = _answer(pol, TEXTS["prose"], target, draft, random.Random(seed), [1.0] * 62, 60, 62)
        ratios.append(tokens * target[1] / seconds)
    assert min(ratios) >= 0.95, [round(r, 3) for r in ratios]
