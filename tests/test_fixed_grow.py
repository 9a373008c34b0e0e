"""Tree growth in fixed-width levels (TreeConfig.grow "static" / "ahead" / "captured", specexec/propose/fixed_grow.py
and captured.py).

The fixed-width growth must grow the same tree as the dynamic one (node for node; only draft slots may differ),
read the device once per level however deep the tree grows (the dynamic growth reads it several times a level),
and keep every exactness property through the engine: greedy == AR, sampled == AR for the same seed, n-gram merging
and subtree reuse included."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from specexec.config import OVERLAP_AUTO, OVERLAP_AUTO_MAX, SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine
from specexec.decoding.sampling import logprobs as sample_logprobs
from specexec.errors import ConfigError
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.propose import DraftModel, NGramConfig, TreeDraft
from tests.conftest import FAMILIES
from tests.test_specexec import _engine

CPU = torch.device("cpu")
PROMPTS = ([5, 6, 7, 8, 9, 10], [40, 41, 3, 90, 17], [33])
MODES = ("static", "ahead", "captured", "captured-ahead")


def test_config_validates_grow():
    """``grow`` "auto" (the default): for a CUDA draft "captured" at a fixed budget, "ahead" with the automatic budget
    or with overlap; "ahead" with overlap on a CPU, else "dynamic"; the early stop by
    default on a CPU and for fixed-width growth on a GPU; explicit settings win."""
    gpu = torch.device("cuda")  # a device object only: nothing runs on it
    assert TreeConfig().grow == "auto"
    assert TreeConfig().grow_mode(CPU) == "dynamic" and TreeConfig().grow_mode(gpu) == "captured"
    assert TreeConfig(overlap=4, reuse=True).grow_mode(CPU) == "ahead"
    assert TreeConfig(overlap=4, reuse=True).grow_mode(gpu) == "ahead"
    assert TreeConfig(auto=True).grow_mode(gpu) == "ahead" and TreeConfig(auto=True).grow_mode(CPU) == "dynamic"
    # levels that cannot replay as graphs (wider than the draft's graphed passes): "ahead", whose host never waits
    assert TreeConfig().grow_mode(gpu, graphs=False) == "ahead"
    assert TreeConfig(grow="captured").grow_mode(gpu, graphs=False) == "captured"  # an explicit choice stands
    assert TreeConfig(grow="ahead").grow_mode(gpu) == "ahead"
    assert (
        TreeConfig(grow="static").grow_mode(gpu) == "static" and TreeConfig(grow="dynamic").grow_mode(gpu) == "dynamic"
    )
    assert TreeConfig().stops_early(CPU) and TreeConfig().stops_early(gpu)
    assert not TreeConfig(grow="dynamic").stops_early(gpu) and TreeConfig(grow="static").stops_early(gpu)
    assert not TreeConfig(early_stop=False).stops_early(CPU) and TreeConfig(
        grow="dynamic", early_stop=True
    ).stops_early(gpu)
    for mode in MODES:
        assert TreeConfig(grow=mode).grow == mode
    with pytest.raises(ConfigError, match="TreeConfig.grow"):
        TreeConfig(grow="fast")


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
            base = TreeConfig(budget=budget, max_beams=beams, max_branch=branch, max_depth=depth, early_stop=False)
            for seed, lp in ((None, None), (7, lambda x: sample_logprobs(x, samp))):
                for capacity in (512, len(seq) + 9):
                    ref, ref_passes, ref_beams = _grow(model, seq, base, capacity, seed, lp)
                    for mode in MODES:
                        where = (family, seq, budget, beams, seed, capacity, mode)
                        tree, passes, log = _grow(model, seq, replace(base, grow=mode), capacity, seed, lp)
                        _same_tree(ref, tree, where)
                        if mode == "static" or (mode == "captured" and seed is None):  # counts read before passes
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


def test_fixed_levels_read_the_device_once_per_level(drafts):
    """A budget no growth can fill, so every level runs: the extra levels of a deeper tree cost exactly one device
    read each in both fixed modes, and several in the dynamic growth (which the counter must see, or it would prove
    nothing)."""
    model = drafts["llama"]
    seq = PROMPTS[0]
    per_level = {}
    for mode in ("dynamic", *MODES):
        reads = []
        for depth in (4, 10):
            cfg = TreeConfig(budget=4000, max_beams=4, max_branch=4, max_depth=depth, early_stop=False, grow=mode)
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
    """The cost-based early stop: "static" stops at the same level as the dynamic growth with the same costs (the
    same tree, passes and flag) with still one device read a level; "ahead" decides a level late, so it runs at
    most one pass more. Costs from cheap to dear passes, so some growths stop early and some do not."""
    from specexec.propose import GrowCost

    model = drafts[family]
    stopped = []
    for seq in PROMPTS:
        for budget, beams in ((24, 4), (64, 8)):
            for pass_s in (0.0, 0.001, 0.01, 0.05):  # 0: never worth stopping
                cost = GrowCost(pass_s=pass_s, target_s=0.05)
                base = TreeConfig(budget=budget, max_beams=beams, max_branch=8, max_depth=16, early_stop=True)
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
                    if mode in ("static", "captured"):
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
    """Every family; budgets, n-gram merging, subtree reuse and limits that cut a step."""
    reused = {mode: 0 for mode in MODES}
    for family in FAMILIES:
        e = engines[family]
        for ids in PROMPTS[:2]:
            e.reset()
            ref = e.generate(ids, 40, method="ar").tokens
            for mode in MODES:
                # early stop off: growth runs deep enough to leave carried subtrees; on (a CPU's default): the
                # stop decided on the values read with each level's count
                for budget, beams, reuse, early in ((4, 2, False, None), (16, 8, True, False), (64, 4, True, None)):
                    for ngram in (None, NGramConfig()):
                        n = 40 if ngram is None else 13
                        tree = TreeConfig(
                            budget=budget, max_beams=beams, max_depth=16, max_branch=8, reuse=reuse, grow=mode,
                            early_stop=early,
                        )  # fmt: skip
                        e.reset()
                        r = e.generate(ids, n, method="specexec", tree=tree, ngram=ngram)
                        assert r.tokens == ref[:n], (family, ids, mode, budget, beams, reuse, ngram)
                        reused[mode] += r.stats.reused_nodes
    # deterministic models and prompts: the counts only check that the test exercises reuse in both modes
    assert all(reused.values()), reused


@pytest.mark.parametrize("early_stop", [False, True])
def test_fixed_growth_sampled_equals_ar_and_follows_the_target(tmp_path_factory, early_stop):
    """For the same seed the fixed-width growth emits AR's tokens (so its text follows the target's distribution,
    which tests/test_sampling.py checks for AR); and an engine-level chi-square of its own. With the early stop
    too (``ahead`` + early stop is the GPU default): trees cut by measured costs, some of them."""
    from tests import test_sampling as ts

    root = tmp_path_factory.mktemp("fixed_grow_sampling")
    target = ts.make_tiny(root / "target", "llama", vocab=ts.V, seed=3, std=0.3, layers=2, hidden=32)
    draft = ts.make_noisy_copy(target, root / "draft", 0.1)
    models = (load_model(target, CPU, torch.float32), load_model(draft, CPU, torch.float32))
    e = Engine(models[0], load_tokenizer(target), models[1], context=256)
    table = ts.Table(models[0], ts.PROMPT)
    samp = SamplingConfig(temperature=1.0, top_p=0.8)
    P = ts.truncate_at_eos(ts.joint(table, samp))
    tree = TreeConfig(budget=8, max_beams=2, max_depth=16, max_branch=8, early_stop=early_stop, grow="ahead")
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
            cfg = TreeConfig(budget=budget, max_beams=beams, max_branch=8, max_depth=12, early_stop=False)
            trees = {}
            for mode in ("dynamic", *MODES):
                c = replace(cfg, grow=mode)
                td = TreeDraft(DraftModel(model, 1024, static=True, static_rows=beams), c)
                td.draft.prefill(seq)
                trees[mode] = td.grow(seq, c, seed=seed)[0]
            for mode in MODES:
                _same_tree(trees["dynamic"].resized(trees["dynamic"].size), trees[mode], (seed, budget, mode))


# -- overlapped growth (TreeConfig.overlap) ---------------------------------------------------------------------
def test_config_validates_overlap():
    assert TreeConfig().overlap == 0
    TreeConfig(overlap=4, reuse=True, grow="ahead")
    TreeConfig(overlap=4, reuse=True)  # grow "auto": fixed-width levels with overlap
    assert TreeConfig().overlap_aim == "carried"
    with pytest.raises(ConfigError, match="TreeConfig.overlap_aim"):
        TreeConfig(overlap_aim="deep")
    auto = TreeConfig(overlap=OVERLAP_AUTO, reuse=True, grow="static")
    assert auto.max_overlap == OVERLAP_AUTO_MAX and TreeConfig(overlap=5, reuse=True, grow="static").max_overlap == 5
    for bad in (
        dict(overlap=4, reuse=True, grow="dynamic"),
        dict(overlap=4, grow="static"),
        dict(overlap=-2),
        dict(overlap=65),
    ):
        with pytest.raises(ConfigError, match="TreeConfig.overlap"):
            TreeConfig(**bad)


def test_background_growth_leaves_the_proposal_alone(drafts):
    """The background levels grow the proposer's own store (more expanded nodes for the next step), never the tree
    being verified."""
    from specexec.config import SamplingConfig as S
    from specexec.propose import StepContext

    model = drafts["qwen2"]
    cfg = TreeConfig(budget=12, max_beams=4, max_branch=8, max_depth=6, reuse=True, grow="static", overlap=5)
    td = TreeDraft(DraftModel(model, 512), cfg)
    seq = PROMPTS[0]
    td.begin(seq)
    prop = td.propose(seq, StepContext(samp=S(), gen=None, budget=12))
    before = {k: getattr(prop.tree, k)[: prop.tree.size].clone() for k in ("tokens", "parents", "logp", "draft_slot")}
    expanded = int((td._grown[2].draft_slot >= 0).sum())
    td.background(prop)
    assert td.background_passes == 5
    for k, v in before.items():
        assert torch.equal(getattr(prop.tree, k)[: prop.tree.size], v), k
    td._join()
    full = td._grown[2]
    assert int((full.draft_slot[: full.size] >= 0).sum()) > expanded  # the background levels expanded nodes
    # the proposal's nodes map to the same tokens in the regrown full tree
    index = td._grown[3]
    assert torch.equal(full.tokens[index], prop.tree.tokens[: index.shape[0]])


def _aim_reference(store, verified):
    """Per node: the log-prob of its root (the first node outside the verified tree on its path, whose parent is
    verified; a verified node is its own), by walking parents on the host."""
    ver = set(verified)
    out = []
    for v in range(store.size):
        path = [v]
        while path[-1] != 0:
            path.append(int(store.parents[path[-1]]))
        path.reverse()  # root first
        r = next((u for u in path if u not in ver), v)
        out.append(float(store.logp[r]))
    return out


@pytest.mark.parametrize("seed_tokens", PROMPTS[:2])
def test_carried_aim_ranks_by_the_likeliest_root(drafts, seed_tokens):
    """The "carried" aim of overlapped growth (TreeConfig.overlap_aim): every node's root log-prob matches a host
    walk of its ancestors, and one aimed level expands exactly the open nodes (relative log-prob above the verified
    tree's budget-th best) with the best root log-prob + AIM_REL x relative log-prob; its children inherit their
    root (or are roots, below a verified parent)."""
    from specexec.config import SamplingConfig as S
    from specexec.propose import StepContext
    from specexec.propose.fixed_grow import AIM_REL, NEG

    cfg = TreeConfig(budget=12, max_beams=4, max_branch=8, max_depth=4, reuse=True, grow="static", overlap=3)
    td = TreeDraft(DraftModel(drafts["qwen2"], 512), cfg)
    seq = list(seed_tokens)
    td.begin(seq)
    td.propose(seq, StepContext(samp=S(), gen=None, budget=12))
    g, chosen, _, _ = td._growth
    store = g.tree
    g.aim(chosen)
    ver, root, thr = g._aim
    assert root[: store.size].tolist() == pytest.approx(_aim_reference(store, chosen.tolist()))
    assert float(thr) == pytest.approx(float(store.logp[chosen].min()))
    # the level's beams, by the rule on the host
    size = store.size
    key = {}
    for v in range(size):
        lp, r = float(store.logp[v]), float(root[v])
        if int(store.draft_slot[v]) < 0 and lp > NEG and lp - r > float(thr):
            key[v] = r + AIM_REL * (lp - r)
    want = sorted(sorted(key, key=lambda v: -key[v])[: cfg.max_beams])
    before = store.draft_slot[:size].clone()
    g.extend(0, 1)
    got = ((store.draft_slot[:size] >= 0) & (before < 0)).nonzero().squeeze(1).tolist()
    assert got == want and got
    ref = _aim_reference(store, chosen.tolist())
    assert root[: store.size].tolist() == pytest.approx(ref)  # the new children's roots too


def test_both_aims_keep_ar_text_and_carry(engines):
    """Overlapped growth aimed either way keeps AR's greedy text, and the next trees start from carried subtrees
    (which aim carries more is a question of the real pair's acceptance: scripts/bench_overlap.py)."""
    carried = {"carried": 0, "frontier": 0}
    for family in ("llama", "qwen2"):
        e = engines[family]
        for ids in PROMPTS[:2]:
            e.reset()
            ref = e.generate(ids, 32, method="ar").tokens
            for aim in carried:
                tree = TreeConfig(
                    budget=16,
                    max_beams=4,
                    max_branch=8,
                    max_depth=8,
                    reuse=True,
                    grow="static",
                    overlap=4,
                    overlap_aim=aim,
                )
                e.reset()
                r = e.generate(ids, 32, method="specexec", tree=tree)
                assert r.tokens == ref, (family, ids, aim)
                carried[aim] += r.stats.reused_passes
    assert min(carried.values()) > 0, carried


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_overlap_carries_below_a_verified_leaf_it_expanded(noisy_pairs, family):
    """The walk accepts a whole branch down to a verified leaf, which only the background levels expanded (the
    verified copy of the tree does not know its draft slot), and the bonus token is one of its expanded children:
    that child's subtree is carried (before the fix, the leaf's missing slot in the verified copy dropped every
    carry after a fully accepted branch), and its log-probs and draft keys/values equal a fresh draft's."""
    from specexec.config import SamplingConfig as S
    from specexec.propose import StepContext
    from tests.test_reuse import assert_carried_equals_fresh

    model = load_model(noisy_pairs[family][1], CPU, torch.float32)
    # two levels: the deepest verified nodes are never expanded while proposing
    cfg = TreeConfig(budget=12, max_beams=64, max_branch=8, max_depth=2, reuse=True, grow="static", overlap=3)
    td = TreeDraft(DraftModel(model, 512), cfg)
    seq = [5, 6, 7, 8]
    td.begin(seq)
    ctx = StepContext(samp=S(), gen=None, budget=12)
    p1 = td.propose(seq, ctx)
    td.background(p1)
    td._join()
    tree = p1.tree
    _, k, full, index = td._grown
    pairs = []
    for a in range(1, k):
        fa = int(index[a])
        if int(tree.draft_slot[a]) >= 0 or int(full.draft_slot[fa]) < 0:
            continue  # expanded while proposing, or not by the background levels either
        kids = [c for c in range(full.size) if int(full.parents[c]) == fa and int(full.draft_slot[c]) >= 0]
        pairs += [(float(full.logp[c]), a, c) for c in kids]
    assert pairs, "with 64 beams the first background level expands every verified leaf, the second their children"
    _, a, c = max(pairs)
    path = tree.path_to(a)
    seq2 = seq + [int(tree.tokens[i]) for i in path[1:]] + [int(full.tokens[c])]
    td.commit(p1, path, seq2)
    assert td._next is not None and int(td._next.tokens[0]) == seq2[-1]
    p2 = td.propose(seq2, ctx)
    assert p2.reused > 0 and p2.reused_passes >= 1
    t2 = p2.tree
    t2.check()
    assert_carried_equals_fresh(model, td.draft, seq2, t2)


def test_overlap_greedy_equals_ar_and_carries_more(engines):
    """Greedy output is AR's with overlapped growth on, and more of each next tree comes from the last step."""
    reused = {0: 0, 6: 0}
    for family in ("llama", "qwen2", "llama_tied"):
        e = engines[family]
        for ids in PROMPTS[:2]:
            e.reset()
            ref = e.generate(ids, 40, method="ar").tokens
            for mode in MODES:
                for overlap in (0, 6):
                    tree = TreeConfig(
                        budget=16, max_beams=4, max_branch=8, max_depth=8, reuse=True, grow=mode, overlap=overlap
                    )
                    e.reset()
                    r = e.generate(ids, 40, method="specexec", tree=tree)
                    assert r.tokens == ref, (family, ids, mode, overlap)
                    reused[overlap] += r.stats.reused_nodes
    assert reused[6] > reused[0], reused


def test_threaded_overlap_equals_inline(engines, monkeypatch):
    """Queued from a host thread (the default on a GPU; forced here on a CPU, where the thread's levels run beside
    the target's pass): the same text as AR, and the same carried subtrees as the levels grown inline, greedy and
    sampled; the thread is joined before the step's commit reads the tree."""
    from specexec.propose.fixed_grow import FixedGrowth

    names: list[str] = []
    real = FixedGrowth.extend

    def extend(self, budget, levels):  # where the background levels ran
        names.append(threading.current_thread().name)
        return real(self, budget, levels)

    monkeypatch.setattr(FixedGrowth, "extend", extend)
    e = engines["qwen2"]
    for mode in MODES:
        tree = TreeConfig(  # no cost-based early stop: it reads the clock, and the trees must not depend on it
            budget=16, max_beams=4, max_branch=8, max_depth=8, reuse=True, grow=mode, overlap=6, early_stop=False
        )
        for ids in PROMPTS[:2]:
            for seed in (None, 3):
                samp = SamplingConfig() if seed is None else SamplingConfig(temperature=1.0, seed=seed)
                e.reset()
                want = e.generate(ids, 32, method="ar", sampling_cfg=samp).tokens
                got = {}
                for threaded in (False, True):
                    monkeypatch.setattr(TreeDraft, "threaded", threaded)
                    names.clear()
                    e.reset()
                    g = e.stream(ids, 32, method="specexec", sampling_cfg=samp, tree=tree)
                    for _ in g:
                        assert g.proposer._bg_thread is None  # joined by the step's commit, before it yields
                    assert g.result is not None
                    assert set(names) == ({"specexec-overlap"} if threaded else {threading.current_thread().name})
                    s = g.result.stats
                    assert s.background_passes == g.proposer.background_passes  # what bench_gpu reports
                    got[threaded] = (g.result.tokens, s.reused_nodes, s.draft_passes, g.proposer.background_passes)
                assert got[True][0] == want, (mode, ids, seed)
                assert got[True] == got[False], (mode, ids, seed)
                assert got[True][3] > 0


def test_a_failing_background_thread_raises_on_the_decode_thread(engines, monkeypatch):
    """An error in the overlap thread is not lost (nor a hang): the step's commit re-raises it, and the engine
    generates again afterwards."""
    from specexec.propose.fixed_grow import FixedGrowth

    e = engines["qwen2"]
    tree = TreeConfig(budget=16, max_beams=4, max_branch=8, max_depth=8, reuse=True, grow="ahead", overlap=6)
    e.reset()
    ref = e.generate(PROMPTS[0], 16, method="ar").tokens
    monkeypatch.setattr(TreeDraft, "threaded", True)
    real = FixedGrowth.extend

    def boom(self, budget, levels):
        raise RuntimeError("planted failure in a background level")

    monkeypatch.setattr(FixedGrowth, "extend", boom)
    e.reset()
    with pytest.raises(RuntimeError, match="planted failure"):
        e.generate(PROMPTS[0], 16, method="specexec", tree=tree)
    monkeypatch.setattr(FixedGrowth, "extend", real)
    e.reset()
    assert e.generate(PROMPTS[0], 16, method="specexec", tree=tree).tokens == ref


def test_static_passes_defer_captures_while_a_thread_queues_levels(noisy_pairs):
    """With ``capture_ok`` off (the overlap thread), a pass whose graph is missing runs eagerly and its bucket
    is captured at the next pass allowed to capture; the results equal the eager passes'."""
    from specexec.model.graphs import StaticPasses

    model = load_model(noisy_pairs["llama"][1], CPU, torch.float32)
    cache = model.new_cache(64)
    sp = StaticPasses(model, cache, 8, use_graphs=True)
    captured = []

    class FakeGraph:  # replays the pass eagerly into the bucket's static output (a CPU stands in for CUDA)
        def __init__(self, b, span):
            self.b, self.span, self.out = b, span, None

        def replay(self):
            self.out.copy_(sp._run(self.b, self.span))

    def capture(b, span):
        g = FakeGraph(b, span)
        g.out = sp._run(b, span).clone()
        captured.append((b, span))
        return g, g.out

    sp._capture = capture
    toks = torch.tensor([3, 4, 5])
    pos = torch.tensor([0, 1, 2])
    mask = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    eager = sp.model.forward(toks, pos, pos, mask, cache).clone()
    sp.capture_ok = False
    out = sp.forward(toks, pos, pos, mask)
    assert captured == [] and sp.pending == {(4, 63)} and sp.captures == 0  # 3 rows -> bucket 4; span: 63 usable
    torch.testing.assert_close(out, eager)
    sp.capture_ok = True
    out2 = sp.forward(toks[:1], pos[:1], pos[:1], mask[:1, :1])  # another bucket: the pending one first
    assert captured == [(4, 63), (1, 63)] and sp.pending == set() and sp.captures == 2
    torch.testing.assert_close(out2, sp.model.forward(toks[:1], pos[:1], pos[:1], mask[:1, :1], cache))
    torch.testing.assert_close(sp.forward(toks, pos, pos, mask), eager)  # the deferred bucket, now "captured"
    assert len(captured) == 2


def test_overlap_sampled_equals_ar(engines):
    """Sampling with overlapped growth: AR's tokens for the same seed."""
    e = engines["qwen2"]
    tree = TreeConfig(budget=8, max_beams=4, max_branch=8, max_depth=8, reuse=True, grow="ahead", overlap=4)
    for s in range(40):
        cfg = SamplingConfig(temperature=1.0, top_p=0.9, seed=s)
        e.reset()
        want = e.generate(PROMPTS[0], 16, method="ar", sampling_cfg=cfg).tokens
        e.reset()
        assert e.generate(PROMPTS[0], 16, method="specexec", sampling_cfg=cfg, tree=tree).tokens == want, s


def test_overlap_auto_adapts_and_grows_nothing_on_a_cpu(engines, drafts):
    """``--overlap auto``: on a CPU no background level runs (they would run in turn and only cost) and the text is
    AR's; the level count grows by two a step while the levels finish beside the target's pass, shrinks to three
    quarters when they do not, and stays within 1..OVERLAP_AUTO_MAX."""
    from specexec.propose.best_first import OVERLAP_AUTO_START

    e = engines["qwen2"]
    tree = TreeConfig(budget=16, max_beams=4, max_branch=8, max_depth=8, reuse=True, grow="static", overlap=-1)
    e.reset()
    ref = e.generate(PROMPTS[0], 24, method="ar").tokens
    e.reset()
    g = e.stream(PROMPTS[0], 24, method="specexec", tree=tree)
    for _ in g:
        pass
    assert g.result is not None and g.result.tokens == ref
    assert g.proposer.background_passes == 0
    td = TreeDraft(DraftModel(drafts["qwen2"], 64), tree)
    assert td.auto_levels == OVERLAP_AUTO_START and td.overlap_levels(tree) == 0  # a CPU draft
    assert td.overlap_levels(replace(tree, overlap=6)) == 6
    seen = []
    for finished in [True] * 20 + [False] * 3 + [True] + [False] * 20:
        td.adapt(finished)
        seen.append(td.auto_levels)
    assert seen[:3] == [6, 8, 10] and max(seen) == OVERLAP_AUTO_MAX
    assert seen[20:24] == [24, 18, 13, 15] and seen[-1] == 1 and min(seen) == 1
    # learnt per draft model: the next generation's proposer (a chat turn) starts from them
    assert TreeDraft(td.draft, tree).auto_levels == 1


class _Event:
    """A CUDA event stand-in on a CPU: the work before it completes once it has been asked ``lag`` times."""

    made: list[_Event] = []

    def __init__(self, lag: int = 1) -> None:
        self.lag, self.asked = lag, 0
        _Event.made.append(self)

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        self.asked += 1
        return self.asked >= self.lag


def test_bounded_background_levels_stop_once_the_target_pass_has_ended(noisy_pairs, monkeypatch):
    """A GPU's overlap thread (tree.AHEAD_LEVELS; its events stood in for on a CPU): a level is queued only while
    fewer than AHEAD_LEVELS are in flight on the side stream, and none once the target's pass has ended, so the
    step's commit waits for at most that many; what was grown is carried as usual, and the text equals AR."""
    from specexec.config import SamplingConfig as S
    from specexec.propose import StepContext
    from specexec.propose import best_first as tree_mod

    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(lag=2))  # in flight until asked twice
    monkeypatch.setattr(TreeDraft, "_bounded", lambda self, device: True)
    monkeypatch.setattr(TreeDraft, "threaded", False)  # inline: the levels the test sees are deterministic
    model = load_model(noisy_pairs["llama"][1], CPU, torch.float32)
    cfg = TreeConfig(budget=32, max_beams=8, max_branch=4, max_depth=32, reuse=True, grow="ahead", overlap=12)
    seq = [5, 6, 7, 8]
    ctx = StepContext(samp=S(), gen=None, budget=32)
    grown = {}
    for after in (3, 10**6):  # the target's pass ends at the 3rd question; never
        td = TreeDraft(DraftModel(model, 1024), cfg)
        td.begin(seq)
        p = td.propose(seq, ctx)
        _Event.made.clear()
        target = _Event(lag=after)
        td.target_queued(target)
        td.background(p)
        levels = _Event.made[1:]
        grown[after] = td.background_passes
        assert len(levels) == td.background_passes
        # the throttle: every level but the last AHEAD_LEVELS was waited for (asked until done) before the next
        assert all(e.asked >= e.lag for e in levels[: -tree_mod.AHEAD_LEVELS]), [e.asked for e in levels]
        assert all(e.asked == 0 for e in levels[-tree_mod.AHEAD_LEVELS :])
        td.commit(p, [0], seq + [int(p.tree.tokens[0])])  # joins (nothing in flight) and forgets the target's event
        assert td._target_done is None
    assert grown[3] == 2 and grown[10**6] == cfg.overlap
    # the thread (forced on a CPU), bounded: the same text as AR
    monkeypatch.setattr(TreeDraft, "threaded", True)
    e = _engine(*noisy_pairs["llama"])
    tree = replace(cfg, budget=16, max_depth=8, overlap=6, early_stop=False)
    for ids in PROMPTS[:2]:
        e.reset()
        want = e.generate(ids, 24, method="ar").tokens
        e.reset()
        assert e.generate(ids, 24, method="specexec", tree=tree).tokens == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_overlap_on_a_side_stream_equals_ar(noisy_pairs):
    """On a GPU the background levels run on a side stream beside the target's pass: greedy and sampled output
    still equal AR's (a fixed count and ``--overlap auto``), and the carried subtrees grow."""
    dev = torch.device("cuda")
    target, draft = noisy_pairs["llama"]
    e = Engine(
        load_model(target, dev, torch.float32), load_tokenizer(target), load_model(draft, dev, torch.float32), 512
    )
    reused = 0
    for mode, overlap in [(m, n) for m in MODES for n in (6, OVERLAP_AUTO)]:
        tree = TreeConfig(budget=16, max_beams=4, max_branch=8, max_depth=8, reuse=True, grow=mode, overlap=overlap)
        for ids in PROMPTS:
            for seed in (None, 5):
                samp = SamplingConfig() if seed is None else SamplingConfig(temperature=1.0, seed=seed)
                e.reset()
                want = e.generate(ids, 32, method="ar", sampling_cfg=samp).tokens
                e.reset()
                r = e.generate(ids, 32, method="specexec", sampling_cfg=samp, tree=tree)
                assert r.tokens == want, (mode, ids, seed)
                reused += r.stats.reused_nodes
    assert reused > 0


@pytest.mark.parametrize("mode", MODES)
def test_a_carried_start_grows_only_down_to_max_depth(noisy_pairs, mode):
    """``max_depth`` bounds a tree's depth, carried start included: a step that starts from a subtree d deep waits
    for at most max_depth - d levels (it used to grow max_depth - 1 more, deepening the tree instead of shortening
    the step), and a fresh tree still grows its max_depth - 1 levels after the root's pass."""
    from specexec.config import SamplingConfig as S
    from specexec.propose import StepContext

    model = load_model(noisy_pairs["llama"][1], CPU, torch.float32)
    cfg = TreeConfig(budget=48, max_beams=64, max_branch=4, max_depth=5, reuse=True, grow=mode, overlap=8)
    td = TreeDraft(DraftModel(model, 1024), cfg)
    seq = [5, 6, 7, 8]
    td.begin(seq)
    ctx = StepContext(samp=S(), gen=None, budget=48)
    p1 = td.propose(seq, ctx)
    assert p1.tree.max_depth() <= cfg.max_depth
    td.background(p1)
    td._join()
    _, k, full, index = td._grown
    a = max(range(1, k), key=lambda i: float(p1.tree.logp[i]) if int(p1.tree.depth[i]) == 1 else float("-inf"))
    fa = int(index[a])
    kids = [c for c in range(full.size) if int(full.parents[c]) == fa and int(full.draft_slot[c]) >= 0]
    assert kids, "8 background levels with 64 beams expand the likeliest depth-1 node's best children"
    c = max(kids, key=lambda i: float(full.logp[i]))
    seq2 = seq + [int(p1.tree.tokens[a]), int(full.tokens[c])]
    td.commit(p1, p1.tree.path_to(a), seq2)
    start = td._next
    assert start is not None
    p2 = td.propose(seq2, ctx)
    assert p2.reused > 0
    d = int(start.depth[: start.size][start.draft_slot[: start.size] >= 0].max()) + 1  # expanded depth + children
    assert d >= 3, d  # the background levels went deep below the bonus root
    assert p2.passes <= max(0, cfg.max_depth - d), (p2.passes, d)
    assert p2.tree.max_depth() <= max(cfg.max_depth, d)
