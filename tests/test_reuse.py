"""Subtree reuse across steps (TreeConfig.reuse): the subtree the draft grew and expanded under the accepted path +
the target's bonus token is carried into the next step (nodes re-based, draft keys/values moved behind the new
prefix). Exactness: greedy == AR with reuse on in every setting that touches it; sampled output follows the target's
distribution; the carried draft keys/values and log-probs equal a fresh draft's; reuse really happens and saves
draft passes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specexec.config import SamplingConfig, TreeConfig
from specexec.decoding.budget import AdaptiveBudget
from specexec.decoding.engine import Engine
from specexec.errors import ConfigError
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.propose import DraftModel, NGramConfig, StepContext, TreeDraft
from tests.conftest import FAMILIES

CPU = torch.device("cpu")
PROMPTS = ([5, 6, 7, 8, 9, 10], [40, 41, 3, 90, 17], [33])
# settings where growth runs long (no early stop, few beams per pass), so the draft expands nodes the budget later
# prunes: those are what a later step can start from
DEEP = dict(early_stop=False, max_depth=16, max_branch=8, reuse=True)


def _engine(target, draft, context=512, tok=None):
    t = load_model(target, CPU, torch.float32)
    d = load_model(draft, CPU, torch.float32) if draft is not None else None
    return Engine(t, tok or load_tokenizer(target), d, context=context)


@pytest.fixture(scope="module")
def engines(noisy_pairs):
    return {f: _engine(*noisy_pairs[f]) for f in FAMILIES}


def _ar(e, ids, n):
    e.reset()
    return e.generate(ids, n, method="ar").tokens


def test_config_validates_reuse():
    assert TreeConfig().reuse is False  # off by default until the draft grows beyond what is verified
    with pytest.raises(ConfigError):
        TreeConfig(reuse="yes")  # type: ignore[arg-type]


# -- the mechanism, step by step ---------------------------------------------------------------------------------------
def _draft_logprobs(model, seq: list[int]) -> torch.Tensor:
    """Fresh draft log-probs (V,) after ``seq`` (a new cache, one plain causal pass)."""
    cache = model.new_cache(len(seq) + 1)
    pos = torch.arange(len(seq))
    mask = pos[None, :] <= pos[:, None]
    return torch.log_softmax(model.forward(torch.tensor(seq), pos, pos, mask, cache)[-1], -1)


def _path_tokens(tree, node: int) -> list[int]:
    return [int(tree.tokens[i]) for i in tree.path_to(node)[1:]]


def assert_carried_equals_fresh(model, draft: DraftModel, seq: list[int], tree) -> None:
    """A tree started from a carried subtree below ``seq``: every node's cumulative log-prob equals a fresh draft's
    along its path (re-based at the new root), and the committed prefix and every expanded node's keys/values in
    ``draft``'s cache equal a fresh pass over its path."""
    for i in range(1, tree.size):
        toks = _path_tokens(tree, i)
        want = sum(float(_draft_logprobs(model, seq + toks[:j])[toks[j]]) for j in range(len(toks)))
        assert abs(float(tree.logp[i]) - want) < 1e-4, (i, toks)
    n = len(seq) - 1
    fresh = None
    for i in range(tree.size):
        s = int(tree.draft_slot[i])
        if s < 0:
            continue
        ctx_toks = seq + _path_tokens(tree, i)
        fresh = model.new_cache(len(ctx_toks) + 1)
        pos = torch.arange(len(ctx_toks))
        model.forward(torch.tensor(ctx_toks), pos, pos, pos[None, :] <= pos[:, None], fresh)
        last = len(ctx_toks) - 1
        torch.testing.assert_close(draft.cache.k[:, :, s], fresh.k[:, :, last], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(draft.cache.v[:, :, s], fresh.v[:, :, last], atol=1e-5, rtol=1e-5)
    assert fresh is not None, "the root of a carried tree was expanded"
    torch.testing.assert_close(draft.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_carried_subtree_equals_a_fresh_draft(noisy_pairs, family):
    """Commit a step whose bonus token is an expanded child of the root: the next proposal starts from that child's
    subtree. Its nodes' log-probs and its draft keys/values equal a fresh draft's for the same prefix, and it costs
    fewer draft passes than growing the same tree from scratch."""
    _, draft_path = noisy_pairs[family]
    model = load_model(draft_path, CPU, torch.float32)
    cfg = TreeConfig(budget=24, max_beams=4, **DEEP)
    td = TreeDraft(DraftModel(model, 512), cfg)
    seq = [5, 6, 7, 8]
    td.begin(seq)
    ctx = StepContext(samp=SamplingConfig(), gen=None, budget=24)
    p1 = td.propose(seq, ctx)
    full, _ = td._full or (None, None)
    assert full is None  # handed over to the commit bookkeeping
    tree = p1.tree
    # the root's expanded child with the most expanded descendants: a bonus token the target may well choose
    kids = [i for i in range(1, tree.size) if int(tree.parents[i]) == 0 and int(tree.draft_slot[i]) >= 0]
    assert kids, "the root's best child is always expanded in a deep tree"
    c = max(kids, key=lambda i: float(tree.logp[i]))
    b = int(tree.tokens[c])
    seq2 = seq + [b]
    td.commit(p1, [0], seq2)  # the target rejected every child and chose b itself (a bonus token)
    assert td._next is not None and int(td._next.tokens[0]) == b

    p2 = td.propose(seq2, ctx)
    assert p2.reused > 0 and p2.reused_passes >= 1
    t2 = p2.tree
    t2.check()
    assert t2.size - 1 == 24
    assert_carried_equals_fresh(model, td.draft, seq2, t2)

    # the same step without reuse: a fresh tree costs more draft passes
    off = TreeDraft(DraftModel(model, 512), replace(cfg, reuse=False))
    off.begin(seq2)
    p_off = off.propose(seq2, ctx)
    assert p2.passes < p_off.passes


def test_carried_subtree_is_dropped_when_it_does_not_apply(noisy_pairs):
    """A different sequence, a budget-0 step, a cut at EOS / the limit, or another user of the draft cache: no reuse."""
    _, draft_path = noisy_pairs["llama"]
    model = load_model(draft_path, CPU, torch.float32)
    cfg = TreeConfig(budget=24, max_beams=4, **DEEP)
    ctx = StepContext(samp=SamplingConfig(), gen=None, budget=24)
    seq = [5, 6, 7, 8]

    def carried(td):
        p1 = td.propose(seq, ctx)
        t = p1.tree
        c = next(i for i in range(1, t.size) if int(t.parents[i]) == 0 and int(t.draft_slot[i]) >= 0)
        return p1, int(t.tokens[c])

    td = TreeDraft(DraftModel(model, 512), cfg)
    td.begin(seq)
    p1, b = carried(td)
    td.commit(p1, [0], seq + [b])
    assert td.propose(seq + [(b + 1) % 96], ctx).reused == 0  # a different pending token
    td.reset()
    td.begin(seq)
    p1, b = carried(td)
    td.commit(p1, [0], seq + [b])
    assert td.propose(seq + [b], replace(ctx, budget=0)).reused == 0  # a budget-0 step drops it
    assert td._next is None
    td.reset()
    td.begin(seq)
    p1, b = carried(td)
    td.commit(p1, [0], seq + [b])
    td.draft.forward(torch.tensor([3]), torch.tensor([4]), torch.tensor([40]), torch.ones(1, 41, dtype=torch.bool))
    assert td.propose(seq + [b], ctx).reused == 0  # someone else ran the draft in between
    # a path cut at EOS / the limit: the committed tokens do not end with path + bonus
    td.reset()
    td.begin(seq)
    p1 = td.propose(seq, ctx)
    t = p1.tree
    a = next(i for i in range(1, t.size) if int(t.parents[i]) == 0 and int(t.draft_slot[i]) >= 0)
    td.commit(p1, [0, a], seq + [int(t.tokens[a])])  # the bonus after a was cut off
    assert td._next is None
    assert td.draft.length == len(seq)


# -- exactness through the engine --------------------------------------------------------------------------------------
def test_greedy_with_reuse_equals_ar(engines):
    """Every family, many budgets and tree shapes, with and without n-gram merging, limits that cut a step."""
    reused = 0
    for family, ids in ((f, ids) for f in FAMILIES for ids in PROMPTS):
        e = engines[family]
        ref = _ar(e, ids, 40)
        for budget, beams in ((4, 2), (16, 8), (64, 16)):
            for ngram in (None, NGramConfig()):
                for n in (40, 13):
                    e.reset()
                    tree = TreeConfig(budget=budget, max_beams=beams, **DEEP)
                    r = e.generate(ids, n, method="specexec", tree=tree, ngram=ngram)
                    assert r.tokens == ref[:n], (family, ids, budget, beams, ngram, n)
                    reused += r.stats.reused_nodes
    # deterministic models and prompts: the count only checks the test exercises reuse at all
    assert reused > 0


def test_greedy_with_reuse_and_eos_inside_a_step(noisy_pairs):
    """EOS inside an accepted step ends the answer exactly where AR ends it."""
    import dataclasses

    target, draft = noisy_pairs["llama"]
    plain = _engine(target, None)
    ref = plain.generate(PROMPTS[0], 40, method="ar").tokens
    for eos in sorted(set(ref[3:20]))[:4]:
        tok = dataclasses.replace(load_tokenizer(target), eos_ids=frozenset({eos}))
        e = _engine(target, draft, tok=tok)
        r = e.generate(PROMPTS[0], 40, method="specexec", tree=TreeConfig(budget=16, max_beams=4, **DEEP))
        want = ref[: ref.index(eos) + 1]
        assert r.tokens == want and r.stats.finish_reason == "stop"


def test_greedy_with_reuse_second_generation_and_budget_switches(noisy_pairs):
    """A chat-like continuation on the same engine (prefix cache kept) and AdaptiveBudget switching among 0, 4
    and 16 from step to step: still the AR tokens."""
    target, draft = noisy_pairs["qwen2"]
    e = _engine(target, draft)
    plain = _engine(target, None)
    tree = TreeConfig(budget=16, max_beams=4, **DEEP)
    ids = [5, 6, 7, 8]
    for turn in range(3):
        pol = AdaptiveBudget(arms=(0, 4, 16), explore_every=2)
        r = e.generate(ids, 24, method="specexec", tree=tree, policy=pol)
        assert r.tokens == plain.generate(ids, 24, method="ar").tokens, turn
        assert len(set(pol.history)) > 1, pol.history  # the budget did switch
        ids = ids + r.tokens + [11 + turn, 12]


# -- sampling ----------------------------------------------------------------------------------------------------------
def test_sampling_with_reuse_follows_the_target(tmp_path_factory):
    """Engine-level chi-square (as tests/test_sampling.py) for SpecExec with reuse on, token-for-token equal to AR
    for the same seed, and reuse happened in the run (so the test sees it)."""
    from tests import test_sampling as ts

    root = tmp_path_factory.mktemp("reuse_sampling")
    target = ts.make_tiny(root / "target", "llama", vocab=ts.V, seed=3, std=0.3, layers=2, hidden=32)
    draft = ts.make_noisy_copy(target, root / "draft", 0.1)
    models = (load_model(target, CPU, torch.float32), load_model(draft, CPU, torch.float32))
    e = Engine(models[0], load_tokenizer(target), models[1], context=256)
    table = ts.Table(models[0], ts.PROMPT)
    samp = SamplingConfig(temperature=1.0, top_p=0.8)
    P = ts.truncate_at_eos(ts.joint(table, samp))
    tree = TreeConfig(budget=8, max_beams=2, **DEEP)
    out, mismatched, results = ts.engine_samples(e, samp, tree)
    reused = sum(r.stats.reused_nodes for r in results)
    assert reused > 0
    assert mismatched == 0
    assert ts.record("T1-p0.8", "engine: specexec budget=8 + reuse", out, P) > ts.ALPHA
