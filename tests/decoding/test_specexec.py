"""SpecExec and chain speculative decoding reproduce the target's greedy output exactly; tree invariants;
KV-cache compaction equals a fresh prefill of the accepted sequence."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specexec.config import ChainConfig, TreeConfig
from specexec.decoding.engine import Engine
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.propose import DraftModel, TreeDraft
from specexec.steps.rules import GrowCost
from tests.conftest import FAMILIES

CPU = torch.device("cpu")
PROMPTS = ([5, 6, 7, 8, 9, 10], [40, 41, 3, 90, 17], [33])


def _grow(model, seq, cfg, cost=None):
    """One best-first tree from a fresh draft cache: (tree, passes, stopped early)."""
    tree, passes, _, early = TreeDraft(DraftModel(model, 2048), cfg).grow(seq, cfg, cost=cost)
    return tree, passes, early


def _engine(target, draft, context=512):
    t = load_model(target, CPU, torch.float32)
    d = load_model(draft, CPU, torch.float32) if draft is not None else None
    return Engine(t, load_tokenizer(target), d, context=context)


@pytest.fixture(scope="module")
def engines(noisy_pairs):
    return {f: _engine(*noisy_pairs[f]) for f in FAMILIES}


def _ar(engine, ids, n):
    engine.reset()
    return engine.generate(ids, n, method="ar").tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [1, 2, 16, 128, 1024, 200])
def test_specexec_equals_ar(engines, family, budget):
    e = engines[family]
    for ids in PROMPTS:
        ref = _ar(e, ids, 40)
        e.reset()
        # budget 200 > vocab (96): the tree must go deep instead of wide
        tree = TreeConfig.fixed(budget, max_beams=16 if budget == 200 else 128)
        r = e.generate(ids, 40, method="specexec", tree=tree)
        assert r.tokens == ref, f"{family} budget={budget} prompt={ids}"
        assert r.stats.mean_tree_size <= budget


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("gamma", range(1, 9))
def test_chain_equals_ar(engines, family, gamma):
    e = engines[family]
    for ids in PROMPTS:
        ref = _ar(e, ids, 40)
        e.reset()
        r = e.generate(ids, 40, method="chain", chain=ChainConfig(gamma=gamma))
        assert r.tokens == ref


def test_speculation_accepts_more_than_one(engines):
    e = engines["llama"]
    e.reset()
    r = e.generate(PROMPTS[0], 60, method="specexec", tree=TreeConfig.fixed(64))
    assert r.stats.tokens_per_step > 1.5, r.stats


@pytest.mark.parametrize("budget", [1, 5, 64, 300])
def test_tree_invariants(noisy_pairs, budget):
    target, draft = noisy_pairs["llama"]
    tree, passes, _ = _grow(
        load_model(draft, CPU, torch.float32), [5, 6, 7, 8], TreeConfig.fixed(budget, max_beams=32, max_branch=8)
    )
    tree.check()  # parents precede children, depths, monotone logp, ancestry mask == parent pointers
    assert tree.size - 1 == budget, "trimmed to exactly budget nodes"
    # connected: every non-root node's parent is in the tree (parents index < own index, all >= 0)
    assert int(tree.n_parents[1:].min()) >= 0
    # the kept set is the top-budget nodes: nothing outside can beat the worst node inside
    assert passes >= 1


def test_tree_is_exact_top_budget(noisy_pairs):
    """For a shallow search the best-first tree equals brute-force top-B over depth-2 paths."""
    target, draft = noisy_pairs["llama"]
    model = load_model(draft, CPU, torch.float32)
    budget = 20
    tree, _, _ = _grow(model, [5, 6, 7], TreeConfig.fixed(budget, max_beams=1000, max_branch=96, max_depth=2))
    # brute force: all depth-1 and depth-2 continuations
    from specexec.model.kv_cache import KVCache  # noqa: F401

    e = Engine(model, load_tokenizer(draft), None, context=64)
    lp1 = torch.log_softmax(_logits(e, [5, 6, 7]), -1)
    scores = {(a,): float(lp1[a]) for a in range(lp1.shape[0])}
    best1 = sorted(scores, key=scores.get, reverse=True)[:budget]
    for (a,) in best1:
        lp2 = torch.log_softmax(_logits(e, [5, 6, 7, a]), -1)
        for b in range(lp2.shape[0]):
            scores[(a, b)] = scores[(a,)] + float(lp2[b])
    want = sorted(scores.values(), reverse=True)[:budget]
    got = sorted(tree.n_logp[1:].tolist(), reverse=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


def _logits(engine, ids):
    m = engine.target
    cache = m.new_cache(64)
    pos = torch.arange(len(ids))
    mask = pos[None, :] <= pos[:, None]
    return m.forward(torch.tensor(ids), pos, pos, mask, cache)[-1]


@pytest.mark.parametrize("method", ["specexec", "chain"])
def test_cache_compaction_equals_fresh_prefill(noisy_pairs, method):
    target, draft = noisy_pairs["qwen2"]
    e = _engine(target, draft)
    r = e.generate([5, 6, 7, 8], 30, method=method, tree=TreeConfig.fixed(32), chain=ChainConfig(gamma=4))
    assert r.stats.steps < 30  # several multi-token steps happened
    seq = e.seq
    for model, cache, length in (
        (e.target, e.state.cache, e.state.t_len),
        (e.draft, e.draft_model.cache, e.draft_model.length),
    ):
        fresh = model.new_cache(cache.capacity)
        pos = torch.arange(length)
        mask = pos[None, :] <= pos[:, None]
        model.forward(torch.tensor(seq[:length]), pos, pos, mask, fresh)
        torch.testing.assert_close(cache.k[:, :, :length], fresh.k[:, :, :length], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.v[:, :, :length], fresh.v[:, :, :length], atol=1e-5, rtol=1e-5)
        assert length >= len(seq) - 1 - 8  # most of the sequence is cached


def test_prefix_cache_reuse(noisy_pairs):
    """A second request extending the first only prefills the new suffix, and still matches AR."""
    target, draft = noisy_pairs["llama"]
    e = _engine(target, draft)
    r1 = e.generate([5, 6, 7, 8], 10, method="specexec")
    ids2 = [5, 6, 7, 8] + r1.tokens + [11, 12, 13]
    r2 = e.generate(ids2, 10, method="specexec")
    assert r2.stats.prefill_tokens <= 4  # only the new turn's tokens (and the old pending one)
    fresh = _engine(target, None)
    assert fresh.generate(ids2, 10, method="ar").tokens == r2.tokens


def test_draft_with_smaller_vocabulary(tmp_path):
    """A target with extra (e.g. padding) tokens the draft lacks: the draft is fed token 0 instead, output exact."""
    from specexec.config import SamplingConfig
    from tests.conftest import make_tiny

    target = make_tiny(tmp_path / "t", "llama", vocab=16, seed=3, std=0.6)
    draft = make_tiny(tmp_path / "d", "llama", vocab=13, seed=3, std=0.6)
    e = _engine(target, draft, context=128)
    seen_high = False
    for seed in range(20):
        samp = SamplingConfig(temperature=1.0, seed=seed)
        e.reset()
        ref = e.generate([5, 6], 12, method="ar", sampling_cfg=samp).tokens
        e.reset()
        # the tree walk keys its draws by output position: same seed, same text as AR
        assert e.generate([5, 6], 12, method="specexec", sampling_cfg=samp, tree=TreeConfig.fixed(8)).tokens == ref
        # chain sampling draws from its own stream (its distribution is tested in test_sampling.py): here the
        # draft's missing rows must neither crash nor leak -- every token is a target token, reproducibly
        e.reset()
        a = e.generate([5, 6], 12, method="chain", sampling_cfg=samp).tokens
        e.reset()
        assert e.generate([5, 6], 12, method="chain", sampling_cfg=samp).tokens == a
        assert all(0 <= t < 16 for t in a) and (len(a) == 12 or a[-1] == 2)
        seen_high |= any(t >= 13 for t in a + ref)
    assert seen_high, "the target's extra tokens must occur for this test to mean anything"
    for method in ("specexec", "chain"):
        e.reset()
        assert e.generate([14, 15], 12, method=method).tokens == _ar(e, [14, 15], 12)


def test_early_stop_rule():
    c = GrowCost(pass_s=0.1, target_s=1.0)
    # E = 3 tokens, T = 2 passes x 0.1 + 1.0 = 1.2 s: one more pass is worth it iff g x 1.2 >= 3 x 0.1, g >= 0.25
    assert c.more(3.0, 0.26, 2) and not c.more(3.0, 0.24, 2)
    # an over-confident draft (half the predicted tokens come true): E = 1 + 0.5 x 2 = 2, worth it iff 0.5 g >= 1/6
    half = GrowCost(pass_s=0.1, target_s=1.0, acc_scale=0.5)
    assert half.more(3.0, 0.34, 2) and not half.more(3.0, 0.33, 2)


@pytest.mark.parametrize("budget", [5, 64, 300])
def test_early_stop_keeps_exact_budget(noisy_pairs, budget):
    """Free passes: the same tree as without the rule. Costly passes: fewer passes, still exactly budget nodes."""
    _, draft = noisy_pairs["llama"]
    model = load_model(draft, CPU, torch.float32)
    cfg = TreeConfig.fixed(budget, max_beams=32, max_branch=8)
    seq = [5, 6, 7, 8]
    full, f_passes, _ = _grow(model, seq, replace(cfg, early_stop=False))
    free, e_passes, e_early = _grow(model, seq, cfg, cost=GrowCost(pass_s=0.0, target_s=1.0))
    assert not e_early and e_passes == f_passes
    assert torch.equal(free.n_tokens, full.n_tokens) and torch.equal(free.n_parents, full.n_parents)
    cut, c_passes, c_early = _grow(model, seq, cfg, cost=GrowCost(pass_s=1e3, target_s=1e-3))
    cut.check()
    assert c_early and c_passes < f_passes
    assert cut.size - 1 == budget
    if budget <= cfg.max_branch:
        assert c_passes == 1  # the root's children fill the tree: no further pass is worth 1000 s


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_in_the_engine_is_exact(engines, early_stop):
    from specexec.policy import FixedBudget, StepCosts
    from specexec.steps.record import Arm

    e = engines["llama"]
    tree = TreeConfig.fixed(32, early_stop=early_stop)
    for ids in PROMPTS:
        ref = _ar(e, ids, 40)
        e.reset()
        costs = StepCosts(pass_s=10.0, target_s={Arm("tree", 32): 1e-3})  # passes look costly: stop as soon as full
        r = e.generate(ids, 40, method="specexec", tree=tree, policy=FixedBudget(Arm("tree", 32), costs))
        assert r.tokens == ref
        assert (r.stats.early_stops > 0) == early_stop, r.stats
        assert costs.target_s[Arm("tree", 32)] != 1e-3, "the loop feeds the measured step costs back"


def test_the_default_tree_config_is_the_command_lines_default():
    """``TreeConfig()`` is what the command line builds from its defaults (``--budget auto``: the cost-driven policy
    from 64 up to 2048), so ``engine.generate(prompt, n)`` runs the command line's policy; ``TreeConfig.fixed(n)``
    is a fixed budget."""
    from specexec.cli.options import Shared

    assert Shared().tree_config() == TreeConfig()
    assert TreeConfig().auto and TreeConfig().budget == 64 and TreeConfig().max_budget == 2048
    assert TreeConfig.fixed(16) == TreeConfig(budget=16, auto=False) and TreeConfig.fixed(16).largest == 16


def test_early_stop_default_follows_the_device():
    from specexec.cli.generate import tree_config

    assert tree_config("16", 2048, 128, 32, 32).early_stop is None  # None: on for a CPU draft, off on a GPU
    assert tree_config("auto", 2048, 128, 32, 32, False).early_stop is False
    assert tree_config("16", 2048, 128, 32, 32, True).early_stop is True


def test_stop_strings_end_the_answer(noisy_pairs):
    """engine.stream(stop=...): the text ends right before the stop string, the kept tokens end with the token
    that completed it, finish_reason is "stop"; the same answer without stops runs on (finish_reason "length")."""
    target, draft = noisy_pairs["llama"]
    e = _engine(target, draft)
    full = e.generate([5, 6, 7], 30, method="specexec", tree=TreeConfig.fixed(8))
    assert full.finish_reason in ("length", "stop")
    words = full.text.split()
    assert len(words) > 6
    stop = " ".join(words[3:5])
    e.reset()
    g = e.stream([5, 6, 7], 30, method="specexec", tree=TreeConfig.fixed(8), stop=[stop, "never-there"])
    pieces = list(g)
    r = g.result
    assert r.finish_reason == "stop" and "".join(pieces) == r.text
    assert r.text == full.text[: full.text.index(stop)] and stop not in r.text
    assert r.tokens == full.tokens[: len(r.tokens)] and len(r.tokens) < len(full.tokens)
    from specexec.errors import SpecexecError

    with pytest.raises(SpecexecError, match="empty"):
        e.stream([5, 6, 7], 5, stop=[""])
