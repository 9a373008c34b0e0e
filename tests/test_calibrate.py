"""Calibrated tree scores (TreeConfig.calibrate, specexec/propose/calibrate.py): the draft's log-probs rescaled per
rank by exponents fitted online to what verification shows. Exactness: greedy output equals AR with it on, in every
growth mode; a sampled step is neither rescaled nor observed. The fit recovers a planted exponent, the walk turns a
verified path into the right observations, and on a pair whose draft is under-confident about its first choices the
calibration really engages (first-choice exponent below 1, trees reshaped)."""

from __future__ import annotations

import math

import pytest
import torch

from specexec.config import SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine
from specexec.errors import ConfigError
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.propose import calibrate
from specexec.propose.calibrate import ScoreCalibration, fit_exponent
from tests.test_fixed_grow import PROMPTS

CPU = torch.device("cpu")


def test_fit_recovers_a_planted_exponent():
    """Hits drawn with chance q^alpha: the maximum-likelihood exponent is within 0.1 of alpha (20k draws)."""
    g = torch.Generator().manual_seed(0)
    q = torch.rand(20000, generator=g, dtype=torch.float64).clamp(min=1e-4)
    for alpha in (0.5, 1.0, 1.6):
        y = (torch.rand(20000, generator=g, dtype=torch.float64) < q**alpha).double()
        assert abs(fit_exponent(q.log(), y) - alpha) < 0.1, alpha


def _snapshot(cal, rows):
    """A snapshot from (parent, token, score) rows; node 0 is the root (score 0)."""
    parents = torch.tensor([-1] + [r[0] for r in rows])
    tokens = torch.tensor([7] + [r[1] for r in rows])
    logp = torch.tensor([0.0] + [r[2] for r in rows])
    return cal.snapshot(parents, tokens, logp, len(rows) + 1)


def test_observe_walks_the_accepted_path():
    """Each node the target's path reaches contributes its children: the first (highest score) to the first-choice
    bucket, the rest to the other; the raw log q is the score step divided by the exponent used; the walk stops at
    the first node none of whose children the target took."""
    cal = ScoreCalibration(CPU)
    cal.alpha = (0.5, 1.0)
    lq = [math.log(0.6), math.log(0.3), math.log(0.5), math.log(0.2)]
    rows = [
        (0, 11, 0.5 * lq[0]),  # 1: root's first choice
        (0, 12, 1.0 * lq[1]),  # 2: root's second choice
        (1, 21, 0.5 * lq[0] + 0.5 * lq[2]),  # 3: first choice below 1
        (1, 22, 0.5 * lq[0] + 1.0 * lq[3]),  # 4: second choice below 1
        (3, 31, 0.5 * lq[0] + 0.5 * lq[2] - 0.1),  # 5: below 3
    ]
    snap = _snapshot(cal, rows)
    # the target took 11 (root's first), then 22 (node 1's second), then 99 (a leaf: nothing below 4)
    assert cal.observe(snap, [11, 22, 99]) == 2
    first, other = list(cal.obs[0]), list(cal.obs[1])
    assert [h for _, h in first] == [1, 0] and [h for _, h in other] == [0, 1]
    assert [round(v, 6) for v, _ in first] == [round(lq[0], 6), round(lq[2], 6)]
    assert [round(v, 6) for v, _ in other] == [round(lq[1], 6), round(lq[3], 6)]
    # a miss at the root: one node observed, nothing below
    assert cal.observe(snap, [55, 21]) == 1


def test_refit_blends_with_the_draft_and_keeps_sibling_order(monkeypatch):
    """Few observations barely move the exponents; many move them to the fit; the first-choice exponent never
    exceeds the others' (the siblings' order, by which ranks are read back, stays the draft's)."""
    cal = ScoreCalibration(CPU)
    g = torch.Generator().manual_seed(1)

    def feed(n, a0, a1):
        for _ in range(n):
            q0 = float(torch.rand((), generator=g)) * 0.9 + 0.05
            cal.obs[0].append((math.log(q0), int(float(torch.rand((), generator=g)) < q0**a0)))
            q1 = float(torch.rand((), generator=g)) * q0
            cal.obs[1].append((math.log(q1), int(float(torch.rand((), generator=g)) < q1**a1)))

    feed(10, 0.5, 1.0)
    cal.refit()
    assert 0.8 < cal.alpha[0] <= 1.0
    feed(2000, 0.5, 1.0)
    cal.refit()
    assert 0.45 < cal.alpha[0] < 0.7 and 0.8 < cal.alpha[1] < 1.25
    assert cal.scale[0] == pytest.approx(cal.alpha[0]) and cal.scale[5] == pytest.approx(cal.alpha[1])
    cal.obs[0].clear(), cal.obs[1].clear()
    feed(4000, 1.8, 0.6)  # a first choice over-confident, the others under: no reordering of siblings
    cal.refit()
    assert cal.alpha[0] == cal.alpha[1]


def test_scales_grow_keeping_the_exponents():
    cal = ScoreCalibration(CPU)
    cal.alpha = (0.6, 1.1)
    cal.scale.fill_(1.1)
    cal.scale[0] = 0.6
    s = cal.scales(100)
    assert s.shape == (100,) and float(s[0]) == pytest.approx(0.6) and float(s[99]) == pytest.approx(1.1)
    vals = torch.log(torch.tensor([[0.5, 0.2, 0.1]]))
    assert torch.allclose(cal.apply(vals), vals * torch.tensor([0.6, 1.1, 1.1]))


def test_config_validates_calibrate():
    with pytest.raises(ConfigError):
        TreeConfig(calibrate="yes")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(noisy_pairs):
    target, draft = noisy_pairs["llama"]
    return Engine(
        load_model(target, CPU, torch.float32),
        load_tokenizer(target),
        load_model(draft, CPU, torch.float32),
        context=512,
    )


GROWTHS = (
    TreeConfig(budget=16, max_beams=4, max_branch=8, max_depth=8, calibrate=True),
    TreeConfig(budget=24, max_beams=8, max_branch=4, max_depth=10, grow="static", early_stop=True, calibrate=True),
    TreeConfig(budget=16, max_beams=4, max_branch=8, max_depth=8, grow="ahead", calibrate=True),
)


def test_calibrated_trees_keep_greedy_exact_and_learn(engine, monkeypatch):
    """Greedy text equals AR in each growth mode with calibration on; the draft observes every step's path and,
    once enough is seen, its exponents leave 1 and the trees differ from uncalibrated ones."""
    monkeypatch.setattr(calibrate, "PRIOR_OBS", 10)  # learn within a few short generations
    engine.draft_model.calibration = None
    for tree in GROWTHS:
        for ids in PROMPTS:
            engine.reset()
            want = engine.generate(ids, 40, method="ar").tokens
            engine.reset()
            assert engine.generate(ids, 40, method="specexec", tree=tree).tokens == want, (tree, ids)
    cal = engine.draft_model.calibration
    assert cal is not None and cal.observed > 50
    assert cal.alpha != (1.0, 1.0), cal.alpha
    shapes = {}
    for on in (True, False):
        engine.reset()
        r = engine.generate(PROMPTS[0], 40, method="specexec", tree=TreeConfig(budget=16, max_beams=4, calibrate=on))
        shapes[on] = r.stats.tree_shapes
    assert shapes[True] != shapes[False]


def test_sampled_steps_are_not_calibrated(engine):
    """A sampled generation (coupled draws in the tree) neither rescales nor observes, and stays AR's draw."""
    engine.draft_model.calibration = None
    samp = SamplingConfig(temperature=0.8, seed=3)
    engine.reset()
    want = engine.generate(PROMPTS[1], 24, method="ar", sampling_cfg=samp).tokens
    engine.reset()
    got = engine.generate(PROMPTS[1], 24, method="specexec", sampling_cfg=samp, tree=GROWTHS[0]).tokens
    assert got == want
    cal = engine.draft_model.calibration
    assert cal is None or cal.observed == 0
