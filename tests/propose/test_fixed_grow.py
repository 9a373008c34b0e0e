"""Tree growth in fixed-width levels (TreeConfig.grow "ahead" / "captured", specexec/propose/fixed_grow.py and
captured.py).

The fixed-width growth must grow the same tree as the dynamic one (node for node; only draft slots may differ),
read the device once per level however deep the tree grows (the dynamic growth reads it several times a level),
and keep every exactness property through the engine: greedy == AR, sampled == AR for the same seed, n-gram merging
included."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from specexec.config import SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine
from specexec.errors import ConfigError
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.model import transformer
from specexec.propose import DraftModel, NGramConfig, StepContext, TreeDraft
from specexec.steps.record import Arm
from specexec.steps.sampling import logprobs as sample_logprobs
from tests.conftest import FAMILIES
from tests.decoding.test_specexec import _engine

CPU = torch.device("cpu")
PROMPTS = ([5, 6, 7, 8, 9, 10], [40, 41, 3, 90, 17], [33])
MODES = ("ahead", "captured")


def test_config_validates_grow():
    """``grow`` "auto" (the default): for a CUDA draft "captured" at a fixed budget, "ahead" with the automatic budget;
    "dynamic" on a CPU; the early stop by default on a CPU and for fixed-width growth on a GPU; explicit settings
    win."""
    gpu = torch.device("cuda")  # a device object only: nothing runs on it
    fixed = TreeConfig.fixed(64)
    assert TreeConfig().grow == "auto" and fixed.grow == "auto"
    assert fixed.grow_mode(CPU) == "dynamic" and fixed.grow_mode(gpu) == "captured"
    assert TreeConfig().grow_mode(gpu) == "ahead" and TreeConfig().grow_mode(CPU) == "dynamic"  # the auto budget
    # levels that cannot replay as graphs (wider than the draft's graphed passes): "ahead", whose host never waits
    assert fixed.grow_mode(gpu, graphs=False) == "ahead"
    assert TreeConfig(grow="captured").grow_mode(gpu, graphs=False) == "captured"  # an explicit choice stands
    assert TreeConfig(grow="ahead").grow_mode(gpu) == "ahead" and TreeConfig(grow="ahead").grow_mode(CPU) == "ahead"
    assert TreeConfig(grow="dynamic").grow_mode(gpu) == "dynamic"
    assert TreeConfig().stops_early(CPU) and TreeConfig().stops_early(gpu)
    assert not TreeConfig(grow="dynamic").stops_early(gpu) and TreeConfig(grow="ahead").stops_early(gpu)
    assert not TreeConfig(early_stop=False).stops_early(CPU) and TreeConfig(
        grow="dynamic", early_stop=True
    ).stops_early(gpu)
    for mode in MODES:
        assert TreeConfig(grow=mode).grow == mode
    for gone in ("fast", "static", "captured-ahead"):
        with pytest.raises(ConfigError, match="TreeConfig.grow"):
            TreeConfig(grow=gone)


@pytest.fixture(scope="module")
def drafts(noisy_pairs):
    return {f: load_model(noisy_pairs[f][1], CPU, torch.float32) for f in ("llama", "qwen2")}


def _grow(model, seq, cfg, capacity=512, seed=None, logprobs=None):
    td = TreeDraft(DraftModel(model, capacity), cfg)
    td.draft.prefill(seq)
    kw = {"logprobs": logprobs} if logprobs is not None else {}
    tree, passes, beams, _ = td.grow(seq, cfg, seed=seed, **kw)
    tree.check()
    return tree, passes, beams


def _same_tree(a, b, where):
    n = a.size
    assert b.size == n, where
    for name in ("tokens", "parents", "depth"):
        assert torch.equal(getattr(a, name)[:n], getattr(b, name)[:n]), (where, name)
    torch.testing.assert_close(a.logp[:n], b.logp[:n], rtol=1e-5, atol=1e-5, msg=str(where))  # span-dependent sums
    # the same nodes were expanded (their slots may differ)
    assert torch.equal(a.draft_slot[:n] >= 0, b.draft_slot[:n] >= 0), where


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fixed_levels_grow_the_same_tree(drafts, family):
    """Budgets below, at and far above what growth can reach; wide and narrow levels; greedy and seeded (coupled)
    scores; a draft cache so small that its room, not the open nodes, ends growth."""
    model = drafts[family]
    samp = SamplingConfig(temperature=0.8, top_p=0.9)
    for seq in PROMPTS:
        for budget, beams, branch, depth in ((4, 2, 4, 8), (24, 4, 8, 16), (64, 16, 32, 12), (300, 8, 6, 10)):
            base = TreeConfig.fixed(budget, max_beams=beams, max_branch=branch, max_depth=depth, early_stop=False)
            for seed, lp in ((None, None), (7, lambda x: sample_logprobs(x, samp))):
                for capacity in (512, len(seq) + 9):
                    ref, ref_passes, ref_beams = _grow(model, seq, base, capacity, seed, lp)
                    for mode in MODES:
                        where = (family, seq, budget, beams, seed, capacity, mode)
                        tree, passes, log = _grow(model, seq, replace(base, grow=mode), capacity, seed, lp)
                        _same_tree(ref, tree, where)
                        if mode == "captured" and seed is None:  # counts read before passes
                            assert (passes, log) == (ref_passes, ref_beams), where
                        else:  # one pass over padding rows when growth ran out of open nodes or room
                            assert passes in (ref_passes, ref_passes + 1), where
                            assert log[: len(ref_beams)] == ref_beams and sum(log) == sum(ref_beams), where


@contextmanager
def _count_device_reads():
    """Counts what would drain a GPU stream: tensor → Python scalar or list, nonzero / unique, boolean-mask
    indexing (its result's size is data), and tensors made from host data (a blocking host-to-device copy)."""
    n = [0]
    saved = {}

    def counted(f):
        def g(*a, **k):
            n[0] += 1
            return f(*a, **k)

        return g

    def bool_index(f):
        def g(self, idx, *rest):
            parts = idx if isinstance(idx, tuple) else (idx,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                n[0] += 1
            return f(self, idx, *rest)

        return g

    for name in ("__int__", "__float__", "__bool__", "__index__", "item", "tolist", "nonzero", "unique"):
        saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    for name in ("__getitem__", "__setitem__"):
        saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, bool_index(getattr(torch.Tensor, name)))
    for name in ("nonzero", "unique", "masked_select", "tensor", "as_tensor", "from_numpy"):
        saved[(torch, name)] = getattr(torch, name)
        setattr(torch, name, counted(getattr(torch, name)))
    try:
        yield n
    finally:
        for (owner, name), f in saved.items():
            setattr(owner, name, f)


def test_fixed_levels_read_the_device_once_per_level(drafts, monkeypatch):
    """A budget no growth can fill, so every level runs: the extra levels of a deeper tree cost exactly one device
    read each in both fixed-width modes, and several in the dynamic growth (which the counter must see, or it would
    prove nothing). The passes run SDPA, as on a GPU (a CPU's native attention lists each row's keys on the host,
    where that is no device read)."""
    monkeypatch.setattr(transformer, "native_ready", lambda device, dtype: False)
    model = drafts["llama"]
    seq = PROMPTS[0]
    per_level = {}
    for mode in ("dynamic", *MODES):
        reads = []
        for depth in (4, 10):
            cfg = TreeConfig.fixed(4000, max_beams=4, max_branch=4, max_depth=depth, early_stop=False, grow=mode)
            td = TreeDraft(DraftModel(model, 512), cfg)
            td.draft.prefill(seq)
            td.grow(seq, cfg)  # warm: the catch-up pass's cache state is the same for the counted run
            with _count_device_reads() as n:
                _, passes, _, _ = td.grow(seq, cfg)
            assert passes == depth  # every level ran
            reads.append(n[0])
        per_level[mode] = (reads[1] - reads[0]) / 6
    assert all(per_level[m] == 1.0 for m in MODES), per_level
    assert per_level["dynamic"] >= 3, per_level


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fixed_levels_stop_early_where_the_dynamic_growth_does(drafts, family):
    """The cost-based early stop: "captured" stops at the same level as the dynamic growth with the same costs (the
    same tree, passes and flag) with still one device read a level; "ahead" decides a level late, so it runs at
    most one pass more. Costs from cheap to dear passes, so some growths stop early and some do not."""
    from specexec.steps.rules import GrowCost

    model = drafts[family]
    stopped = []
    for seq in PROMPTS:
        for budget, beams in ((24, 4), (64, 8)):
            for pass_s in (0.0, 0.001, 0.01, 0.05):  # 0: never worth stopping
                cost = GrowCost(pass_s=pass_s, target_s=0.05)
                base = TreeConfig.fixed(budget, max_beams=beams, max_branch=8, max_depth=16, early_stop=True)
                td = TreeDraft(DraftModel(model, 512), base)
                td.draft.prefill(seq)
                ref, ref_passes, ref_log, ref_stop = td.grow(seq, base, cost=cost)
                stopped.append(ref_stop)
                for mode in MODES:
                    where = (family, seq, budget, beams, pass_s, mode)
                    cfg = replace(base, grow=mode)
                    td = TreeDraft(DraftModel(model, 512), cfg)
                    td.draft.prefill(seq)
                    td.grow(seq, cfg, cost=cost)  # warm (the counted run's cache state is the same)
                    with _count_device_reads() as n:
                        tree, passes, log, stop = td.grow(seq, cfg, cost=cost)
                    if mode == "captured":
                        _same_tree(ref, tree, where)
                        assert (passes, log, stop) == (ref_passes, ref_log, ref_stop), where
                        # E and U ride with each level's count: as many reads as the same levels without the
                        # stop, plus the read of the level it stopped at
                        plain = replace(cfg, early_stop=False, max_depth=passes)
                        td = TreeDraft(DraftModel(model, 512), plain)
                        td.draft.prefill(seq)
                        td.grow(seq, plain)
                        with _count_device_reads() as m:
                            assert td.grow(seq, plain)[1] == passes
                        assert n[0] <= m[0] + 1, where
                    else:
                        assert passes in (ref_passes, ref_passes + 1) and stop == ref_stop, where
                        assert log[: len(ref_log)] == ref_log, where
    assert any(stopped) and not all(stopped), stopped


# -- exactness through the engine --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(noisy_pairs):
    return {f: _engine(*noisy_pairs[f]) for f in FAMILIES}


def test_fixed_growth_greedy_equals_ar(engines):
    """Every family; budgets, n-gram merging and limits that cut a step."""
    for family in FAMILIES:
        e = engines[family]
        for ids in PROMPTS[:2]:
            e.reset()
            ref = e.generate(ids, 40, method="ar").tokens
            for mode in MODES:
                # early stop off: growth runs to max_depth; on (a CPU's default): the stop decided on the values
                # read with each level's count
                for budget, beams, early in ((4, 2, None), (16, 8, False), (64, 4, None)):
                    for ngram in (None, NGramConfig()):
                        n = 40 if ngram is None else 13
                        tree = TreeConfig.fixed(
                            budget, max_beams=beams, max_depth=16, max_branch=8, grow=mode, early_stop=early
                        )
                        e.reset()
                        r = e.generate(ids, n, method="specexec", tree=tree, ngram=ngram)
                        assert r.tokens == ref[:n], (family, ids, mode, budget, beams, ngram)


@pytest.mark.parametrize("early_stop", [False, True])
def test_fixed_growth_sampled_equals_ar_and_follows_the_target(tmp_path_factory, early_stop):
    """For the same seed the fixed-width growth emits AR's tokens (so its text follows the target's distribution,
    which tests/decoding/test_sampling.py checks for AR); and an engine-level chi-square of its own. With the early stop
    too (``ahead`` + early stop is the GPU default): trees cut by measured costs, some of them."""
    from tests.decoding import test_sampling as ts

    root = tmp_path_factory.mktemp("fixed_grow_sampling")
    target = ts.make_tiny(root / "target", "llama", vocab=ts.V, seed=3, std=0.3, layers=2, hidden=32)
    draft = ts.make_noisy_copy(target, root / "draft", 0.1)
    models = (load_model(target, CPU, torch.float32), load_model(draft, CPU, torch.float32))
    e = Engine(models[0], load_tokenizer(target), models[1], context=256)
    table = ts.Table(models[0], ts.PROMPT)
    samp = SamplingConfig(temperature=1.0, top_p=0.8)
    P = ts.truncate_at_eos(ts.joint(table, samp))
    tree = TreeConfig.fixed(8, max_beams=2, max_depth=16, max_branch=8, early_stop=early_stop, grow="ahead")
    out, mismatched, results = ts.engine_samples(e, samp, tree)
    assert mismatched == 0
    stops = sum(r.stats.early_stops for r in results)
    assert (stops > 0) == early_stop, stops
    name = "fixed-width growth" + (", early stop" if early_stop else "")
    assert ts.record("T1-p0.8", f"engine: specexec budget=8, {name}", out, P) > ts.ALPHA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fixed_levels_grow_the_same_tree_with_graphs(noisy_pairs):
    """On a GPU, with graphed draft passes (static shapes): the same tree as the dynamic growth, greedy and
    seeded."""
    dev = torch.device("cuda")
    model = load_model(noisy_pairs["llama"][1], dev, torch.float32)
    seq = PROMPTS[0]
    for seed in (None, 3):
        for budget, beams in ((24, 4), (300, 16)):
            cfg = TreeConfig.fixed(budget, max_beams=beams, max_branch=8, max_depth=12, early_stop=False)
            trees = {}
            for mode in ("dynamic", *MODES):
                c = replace(cfg, grow=mode)
                td = TreeDraft(DraftModel(model, 1024, static=True, static_rows=beams), c)
                td.draft.prefill(seq)
                trees[mode] = td.grow(seq, c, seed=seed)[0]
            for mode in MODES:
                _same_tree(trees["dynamic"], trees[mode], (seed, budget, mode))


def test_a_lazy_draft_reads_the_prompt_at_its_first_proposal(drafts):
    """A lazy tree proposer (the CPU policy's, which may never ask for a draft pass) leaves the prompt unread at
    ``begin``: it reports the lag a draft step would catch up on, and its first proposal reads the prompt in a pass
    timed apart, proposing the tree an eagerly prefilled draft proposes."""
    model = drafts["llama"]
    seq = [5, 9, 17, 33, 4, 60, 61, 62, 63, 12, 40, 7]
    cfg = TreeConfig.fixed(8, max_beams=4, max_branch=4, max_depth=4, early_stop=False)
    ctx = StepContext(samp=SamplingConfig(), gen=None, arm=Arm("tree", 8))
    eager, lazy = TreeDraft(DraftModel(model, 64), cfg), TreeDraft(DraftModel(model, 64), cfg, lazy=True)
    eager.begin(seq)
    lazy.begin(seq)
    assert eager.lag(seq) == 0 and lazy.lag(seq) == len(seq) - 1
    want, got = eager.propose(seq, ctx), lazy.propose(seq, ctx)
    assert want.catch_up_s == 0.0 and got.catch_up_s > 0.0
    assert lazy.lag(seq) == 0
    assert got.tree.n_tokens.tolist() == want.tree.n_tokens.tolist()
    assert got.tree.n_parents.tolist() == want.tree.n_parents.tolist()
    assert lazy.lag(seq[:5] + [99, 98]) == 1  # another sequence: the common prefix is kept, 99 is to read


def test_a_lagging_draft_catches_up_in_a_timed_pass_of_its_own(drafts):
    """Tokens committed while no draft pass ran (plain or head steps) are caught up in a pass of their own, timed
    apart (the CPU policy does not charge it to the arm that follows); the root's logits are those of a draft that
    never lagged, and a short lag stays in the root's pass."""
    model = drafts["llama"]
    seq = [5, 9, 17, 33, 4, 60, 61, 62, 63, 12, 40, 7]
    steady = DraftModel(model, 64)
    steady.prefill(seq)
    want = steady.catch_up(seq)
    assert steady.caught_up_s == 0.0
    d = DraftModel(model, 64)
    d.prefill(seq[:3])
    got = d.catch_up(seq)  # 8 tokens behind, plus the root
    assert d.caught_up_s > 0 and d.length == len(seq) - 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    d.commit([len(seq) - 1], seq + [3])
    d.catch_up(seq + [3, 8])  # one behind: in the root's pass
    assert d.caught_up_s == 0.0
