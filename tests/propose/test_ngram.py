"""Draft-free n-gram (prompt lookup) proposals, merged n-gram branches and the measured CPU policy: all exact."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from specexec.config import NGRAM_LEN_GPU, NGRAM_NODES_CPU, NGRAM_NODES_GPU, SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine, default_ngram
from specexec.errors import ConfigError
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.policy import DEFAULT, AdaptiveBudget, AutoBudget
from specexec.propose import NGramConfig, NGramDraft, Proposal, StepContext
from specexec.steps.record import PLAIN, Arm, StepInfo

A = Arm.parse  # an arm by its label: 0 plain, -g a chain of g, b a tree of b


def _arms(*labels: int) -> tuple[Arm, ...]:
    return tuple(A(x) for x in labels)


CPU = torch.device("cpu")


def _engine(target, draft=None, context=512):
    d = load_model(draft, CPU, torch.float32) if draft is not None else None
    return Engine(load_model(target, CPU, torch.float32), load_tokenizer(target), d, context=context)


def _markov(src, dst, noise=0.0, seed=0):
    """A copy of a tiny model with its attention output projections zeroed: each next-token distribution then
    depends on the current token only, so greedy text soon cycles -- text that repeats itself, where prompt
    lookup pays (random tiny models never repeat otherwise). ``noise`` > 0 makes a draft for it."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import make_noisy_copy

    make_noisy_copy(src, dst, noise, seed)
    for f in dst.glob("*.safetensors"):
        sd = load_file(f)
        save_file({k: torch.zeros_like(v) if "o_proj" in k else v for k, v in sd.items()}, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def engine(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("markov")
    target = _markov(tiny_models["llama"], root / "t")
    draft = _markov(tiny_models["llama"], root / "d", noise=0.3, seed=1)
    return _engine(target, draft)


def _prompt(engine):
    """A prompt whose greedy continuation has a cycle: later steps are predictable from the text so far."""
    engine.reset()
    return [5, 6, 7] + engine.generate([5, 6, 7], 30, method="ar").tokens[:20]


def test_continuations_and_trie():
    ng = NGramDraft(CPU, NGramConfig(min_ngram=2, max_ngram=3, max_len=4, max_matches=8, max_nodes=64))
    seq = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 5, 1, 2]
    conts = ng.continuations(seq)
    # the suffix [1, 2] occurred three times before; most recent first, distinct continuations only
    assert conts == [(2, [3, 7, 5, 1]), (2, [4, 8, 1, 2]), (2, [3, 9, 1, 2])]
    prop = ng.propose(seq, StepContext(samp=SamplingConfig(), gen=None, arm=Arm("tree", 64)))
    tree = prop.tree
    tree.check()  # parents precede children, depths, monotone scores, ancestry
    toks, par = tree.n_tokens.tolist(), tree.n_parents.tolist()
    assert toks[0] == 2 and prop.rule == "tree"
    first = sorted(toks[i] for i in range(1, tree.size) if par[i] == 0)
    assert first == [3, 4], "one trie branch per distinct first token (shared prefixes merged)"
    assert tree.size - 1 == 4 + 4 + 3  # [3,7,5,1] + [4,8,1,2] + [3,9,1,2] sharing the node 3
    small = ng.propose(seq, StepContext(samp=SamplingConfig(), gen=None, arm=Arm("tree", 3)))
    assert small.tree.size - 1 == 3, "the budget caps the trie's nodes"
    assert ng.propose([1, 2, 3], StepContext(samp=SamplingConfig(), gen=None, arm=Arm("tree", 64))).tree.size == 1


def test_the_scores_follow_what_the_target_accepts_within_a_few_steps():
    """A text whose matches keep missing makes its next tries' scores (the chance each node is accepted) fall to
    under half within three steps, so trimming stops verifying them; accepted matches raise them again."""
    ng = NGramDraft(CPU, NGramConfig(min_ngram=2, max_ngram=3, max_len=4))
    seq = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    ctx = StepContext(samp=SamplingConfig(), gen=None, arm=Arm("tree", 64))

    def top(prop):  # the best first node's score as a probability
        return float(prop.tree.n_logp[1:].exp().max())

    ng.begin(seq)
    start = top(ng.propose(seq, ctx))
    for _ in range(3):  # the target takes none of the proposed tokens: its own token follows the root
        prop = ng.propose(seq, ctx)
        ng.commit(prop, [0], seq)
    missed = top(ng.propose(seq, ctx))
    assert missed < start / 2, (start, missed)
    for _ in range(3):  # the target takes a whole continuation
        prop = ng.propose(seq, ctx)
        depth = prop.tree.n_depth.tolist()
        path = [0]
        for d in range(1, max(depth) + 1):  # the deepest line: node by node down its parents
            path.append(next(i for i in range(prop.tree.size) if depth[i] == d and prop.tree.n_parents[i] == path[-1]))
        ng.commit(prop, path, seq)
    assert top(ng.propose(seq, ctx)) > missed


def test_a_new_text_starts_from_what_lookup_measured_on_the_earlier_ones():
    """Texts whose matches all missed make the next text's first lookup verify fewer rows (trimmed at what a row
    costs) than an engine's first text does; texts that try nothing drift back to the first text's prior, so lookup
    is tried again; texts whose matches are taken raise it."""
    from specexec.propose.ngram import PRIOR_ACC, LookupRecord
    from specexec.steps.rules import Trim

    cfg = NGramConfig(min_ngram=2, max_ngram=3, max_len=6)
    seq = [1, 2, 3, 9, 4, 5, 6, 1, 2]
    trim = Trim(rate=20.0, verify_s=lambda n: [0.05 + 0.01 * k for k in range(n)])  # a row: a fifth of a token
    ctx = StepContext(samp=SamplingConfig(), gen=None, arm=Arm("tree", 64), trim=trim)
    record = LookupRecord()

    def first_rows(text_misses: bool) -> int:
        ng = NGramDraft(CPU, cfg, record)
        ng.begin(seq)
        prop = ng.propose(seq, ctx)
        rows = prop.tree.size - 1
        for _ in range(3):
            prop = ng.propose(seq, ctx)
            if prop.tree.size > 1:
                ng.commit(prop, [0] if text_misses else list(range(prop.tree.size)), seq)
        return rows

    fresh = first_rows(text_misses=True)
    assert fresh >= 3, "an engine's first text bets on a deep match"
    assert record.prior() < PRIOR_ACC
    after = first_rows(text_misses=True)
    assert 0 < after < fresh, (fresh, after)
    for _ in range(6):  # texts with no match at all
        NGramDraft(CPU, cfg, record)
    assert record.prior() == pytest.approx(PRIOR_ACC, abs=0.02)
    for _ in range(3):
        first_rows(text_misses=False)
    assert record.prior() > PRIOR_ACC


def test_index_is_incremental_and_follows_a_new_sequence():
    ng = NGramDraft(CPU, NGramConfig(min_ngram=1, max_ngram=2))
    seq = [4, 5, 6, 4, 5]
    assert ng.continuations(seq)[0] == (2, [6, 4, 5])
    assert ng.continuations(seq + [9, 4, 5])[0] == (2, [9, 4, 5])  # extended: the newest occurrence first
    assert ng.continuations([7, 8, 7])[0] == (1, [8, 7])  # not an extension: the index is rebuilt


@pytest.mark.parametrize(
    "samp",
    [SamplingConfig(), SamplingConfig(temperature=1.0, seed=3), SamplingConfig(temperature=0.8, top_p=0.9, seed=7)],
)
def test_ngram_method_equals_ar(engine, samp):
    """Greedy: the target's own output. Sampling: the tree walk draws position-keyed uniforms, so the same seed
    gives exactly AR's sampled text (its distribution is the target's; see test_sampling.py)."""
    ids = _prompt(engine)
    engine.reset()
    ref = engine.generate(ids, 40, method="ar", sampling_cfg=samp).tokens
    for tree in (TreeConfig.fixed(64), TreeConfig()):
        engine.reset()
        r = engine.generate(ids, 40, method="ngram", sampling_cfg=samp, tree=tree)
        assert r.tokens == ref
    if samp.greedy:
        engine.reset()
        r = engine.generate(ids, 40, method="ngram", tree=TreeConfig.fixed(64))
        assert r.stats.tokens_per_step > 2.0, "the repeated passage is accepted several tokens at a time"
        assert r.stats.draft_passes == 0


def test_ngram_branches_merged_into_the_tree_equal_ar(engine):
    ids = _prompt(engine)
    engine.reset()
    ref = engine.generate(ids, 40, method="ar").tokens
    for budget in (1, 4, 32):
        engine.reset()
        plain = engine.generate(ids, 40, method="specexec", tree=TreeConfig.fixed(budget))
        engine.reset()
        merged = engine.generate(ids, 40, method="specexec", tree=TreeConfig.fixed(budget), ngram=NGramConfig())
        assert plain.tokens == ref and merged.tokens == ref
        assert merged.stats.tokens_per_step >= plain.stats.tokens_per_step


def test_tree_config_ngram_nodes_by_device():
    """None: the device's default -- every GPU tree, only a CPU's auto-budget trees; an explicit count anywhere."""
    gpu = torch.device("cuda")
    assert TreeConfig().ngram_nodes(gpu) == NGRAM_NODES_GPU
    assert TreeConfig.fixed(256).ngram_nodes(gpu) == NGRAM_NODES_GPU
    assert TreeConfig(auto=True).ngram_nodes(CPU) == NGRAM_NODES_CPU
    assert TreeConfig.fixed(16).ngram_nodes(CPU) == 0
    assert TreeConfig.fixed(16, ngram=8).ngram_nodes(CPU) == 8
    assert TreeConfig(auto=True, ngram=0).ngram_nodes(gpu) == 0
    for bad in (-1, 1025):
        with pytest.raises(ConfigError, match="ngram"):
            TreeConfig(ngram=bad)
    # what the engine merges when the caller names no n-gram config: longer continuations on a GPU
    assert default_ngram(TreeConfig(), gpu) == NGramConfig(max_nodes=NGRAM_NODES_GPU, max_len=NGRAM_LEN_GPU)
    assert default_ngram(TreeConfig(auto=True), CPU) == NGramConfig(max_nodes=NGRAM_NODES_CPU)
    assert default_ngram(TreeConfig.fixed(8), CPU) is None and default_ngram(TreeConfig(ngram=0), gpu) is None


@pytest.mark.parametrize("grow", ["dynamic", "ahead", "captured"])
@pytest.mark.parametrize("samp", [SamplingConfig(), SamplingConfig(temperature=0.9, seed=4)])
def test_ngram_nodes_of_the_tree_config_are_merged_exactly(engine, grow, samp):
    """``TreeConfig.ngram`` merges the lookup's branches into trees of every growth (the GPU's default, run here on
    a CPU): the same tokens as AR, greedy and sampled with the same seed, and on text that repeats the emitted
    tokens include some only the n-gram branches held (counted in ``Stats.ngram_tokens``)."""
    ids = _prompt(engine)
    engine.reset()
    ref = engine.generate(ids, 40, method="ar", sampling_cfg=samp).tokens
    got = {}
    for nodes in (0, 16):
        engine.reset()
        tree = TreeConfig.fixed(2, grow=grow, early_stop=False, ngram=nodes)
        r = engine.generate(ids, 40, method="specexec", sampling_cfg=samp, tree=tree)
        assert r.tokens == ref
        got[nodes] = r.stats
    assert got[0].ngram_tokens == 0
    if samp.greedy:
        assert got[16].ngram_tokens > 0
        assert got[16].tokens_per_step > got[0].tokens_per_step
        assert got[16].draft_passes <= got[0].draft_passes  # the n-gram branches cost no draft pass


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_trees_merge_ngram_branches_by_default(tiny_models, tmp_path):
    """On a GPU every tree gets the lookup's branches by default (fixed budget and auto alike, ``ahead`` levels and
    graphed draft passes): AR's tokens, and on repeating text tokens from the n-gram branches."""
    dev = torch.device("cuda")
    target = _markov(tiny_models["llama"], tmp_path / "t")
    draft = _markov(tiny_models["llama"], tmp_path / "d", noise=0.3, seed=1)
    eng = Engine(
        load_model(target, dev, torch.float32), load_tokenizer(target), load_model(draft, dev, torch.float32),
        context=512,
    )  # fmt: skip
    ids = _prompt(eng)
    eng.reset()
    ref = eng.generate(ids, 40, method="ar").tokens
    for tree in (TreeConfig.fixed(2), TreeConfig(auto=True, max_budget=64)):
        eng.reset()
        r = eng.generate(ids, 40, method="specexec", tree=tree)
        assert r.tokens == ref
        assert r.stats.ngram_tokens > 0


def test_engine_allocates_the_default_ngram_room_up_front(tiny_models):
    """The caches an engine allocates at construction already hold the n-gram branches its generations merge by
    default (the CPU's auto trees here), so the first generation does not reallocate them (and measure costs again)."""
    t = tiny_models["llama"]
    tree = TreeConfig(auto=True, max_budget=16)
    eng = Engine(load_model(t, CPU, torch.float32), load_tokenizer(t), load_model(t, CPU, torch.float32), tree=tree)
    state, draft = eng.state, eng.draft_model
    assert eng.target_cache.capacity >= eng.context + tree.largest + NGRAM_NODES_CPU
    eng.generate([5, 6, 7], 4, method="specexec", tree=tree)
    assert eng.state is state and eng.draft_model is draft


def test_ngram_tokens_counts_only_accepted_lookup_nodes(engine):
    """``Stats.ngram_tokens`` counts emitted tokens from nodes past ``Proposal.merged_at``: all of them for the
    draft-free method but each step's bonus token (the last step's bonus may be cut by the token limit), none
    without a lookup."""
    ids = _prompt(engine)
    engine.reset()
    r = engine.generate(ids, 40, method="ngram", tree=TreeConfig.fixed(16))
    assert 0 < r.stats.new_tokens - r.stats.steps <= r.stats.ngram_tokens <= r.stats.new_tokens - r.stats.steps + 1
    engine.reset()
    r = engine.generate([33, 34, 35], 8, method="specexec", tree=TreeConfig.fixed(4))
    assert r.stats.ngram_tokens == 0


@pytest.mark.parametrize("samp", [SamplingConfig(), SamplingConfig(temperature=1.0, seed=11)])
def test_cpu_auto_policy_is_exact(engine, samp):
    """The default on a CPU (measured choice among no draft / n-grams / trees of 4..32) is exact."""
    for ids in (_prompt(engine), [33, 34, 35]):
        engine.reset()
        ref = engine.generate(ids, 50, method="ar", sampling_cfg=samp).tokens
        engine.reset()
        r = engine.generate(ids, 50, method="specexec", sampling_cfg=samp, tree=TreeConfig(auto=True))
        assert r.tokens == ref
        assert r.stats.budget_auto and sum(r.stats.budgets.values()) == r.stats.steps


def _feed(policy, arm, tokens, seconds, n=1):
    for _ in range(n):
        policy.update(StepInfo(arm=arm, tree_logp=(), emitted=tokens, draft_s=0.0, target_s=seconds, passes=0))


def test_adaptive_policy_follows_measured_rates():
    p = AdaptiveBudget(_arms(0, 8, 32), config=replace(DEFAULT, explore_every=4))
    assert p.choose() == A(0)  # nothing measured, no prior: the cheapest arm first
    _feed(p, A(0), 1, 1.0, 2)  # 1 tok/s
    assert p.choose() == A(8), "an untried neighbour of the best arm is tried once it has a measurement"
    _feed(p, A(8), 3, 1.5)  # 2 tok/s
    picks = [p.choose() for _ in range(3)]
    assert picks.count(A(8)) >= 2
    _feed(p, A(32), 2, 4.0)  # 0.5 tok/s
    _feed(p, A(8), 3, 1.5, 3)
    # measured rates: each arm's EMA of tokens over its EMA of seconds
    assert p.rate(A(8)) == pytest.approx(2.0)
    assert p.rate(A(32)) == pytest.approx(0.5)
    # the text changes: arm 8 starts failing; exploration notices and the policy moves to arm 0
    for _ in range(40):
        a = p.choose()
        _feed(p, a, 1, 2.0 if a != PLAIN else 1.0)
    assert p.choose() == A(0) or p.history[-5:].count(PLAIN) >= 3


def test_adaptive_policy_prior_orders_untried_arms():
    p = AdaptiveBudget(_arms(0, 4, 16), prior=lambda a: {A(0): 1.0, A(4): 3.0, A(16): 2.0}[a])
    assert p.choose() == A(4)


def test_auto_budget_costs_are_cached_and_measured_again_on_drift(noisy_pairs, tmp_path, monkeypatch):
    """The cost-model auto budget (a GPU's) measures pass costs once per machine and model pair: a second engine
    reuses the cached file; step costs far from it make the engine measure again before the next generation."""
    from specexec.policy import drifted, interp

    monkeypatch.setattr(Engine, "_measured_policy", lambda self: False)  # the GPU's policy, on this CPU
    target, draft = noisy_pairs["llama"]
    tree = TreeConfig(auto=True, max_budget=64)

    def make():
        t, d = load_model(target, CPU, torch.float32), load_model(draft, CPU, torch.float32)
        return Engine(t, load_tokenizer(target), d, context=256, tree=tree, costs_dir=tmp_path)

    e1 = make()
    g1 = e1.stream([5, 6, 7], 20, method="specexec", tree=tree)
    list(g1)
    assert g1.result is not None and g1.result.stats.costs_s > 0
    assert len(list(tmp_path.glob("*.json"))) == 1, "measured and cached"
    e2 = make()
    g2 = e2.stream([5, 6, 7], 20, method="specexec", tree=tree)
    list(g2)
    assert g2.result is not None and g2.result.tokens == g1.result.tokens
    policy = g2.policy
    assert isinstance(policy, AutoBudget) and isinstance(g1.policy, AutoBudget)
    assert policy.target_s == g1.policy.target_s, "the cached costs were reused"
    for _ in range(10):  # steps that take 3x what the start-up measurement said
        b = policy.choose()
        slow = 3 * interp(policy.target_s, b.size + 1)
        policy.update(StepInfo(arm=b, tree_logp=(), emitted=1, draft_s=0.0, target_s=slow, passes=0))
    assert drifted(policy)
    g3 = e2.stream([5, 6, 7], 10, method="specexec", tree=tree)
    list(g3)
    assert g3.result is not None and g3.result.stats.costs_s > 0, "measured again"
    assert isinstance(g3.policy, AutoBudget) and g3.policy is not policy and not drifted(g3.policy)
    assert g3.policy.target_s != policy.target_s


def test_costs_measured_by_other_code_are_measured_again(noisy_pairs, tmp_path, monkeypatch):
    """The CPU policy's pass costs are cached per machine and model, and per version of the package's code: costs a
    former version measured (another kernel: a pass may cost half as much, and differently by size) are not read."""
    import specexec.policy.cache as cache

    target, draft = noisy_pairs["llama"]
    tree = TreeConfig(auto=True, max_budget=32)

    def run() -> dict[str, int]:  # the cost files after a generation, with their modification times
        t, d = load_model(target, CPU, torch.float32), load_model(draft, CPU, torch.float32)
        e = Engine(t, load_tokenizer(target), d, context=256, tree=tree, costs_dir=tmp_path)
        list(e.stream([5, 6, 7], 4, method="specexec", tree=tree))
        return {f.name: f.stat().st_mtime_ns for f in tmp_path.glob("*.json")}

    first = run()
    assert first and run() == first, "measured once, then read from the cache"
    monkeypatch.setattr(cache, "code_version", lambda: "another version")
    again = run()
    assert len(again) == 2 * len(first) and set(first) < set(again), "measured again, in files of their own"


def test_measured_policy_is_kept_across_generations(engine):
    """What the CPU policy measured of the costs carries over to the next request (a chat's next turn); what each
    arm yields depends on the text, so the next request measures that anew."""
    ids = _prompt(engine)
    engine.reset()
    first = engine.stream(ids, 20, method="specexec", tree=TreeConfig())
    list(first)
    policy = first.policy
    assert isinstance(policy, AdaptiveBudget) and policy.summary(), "the first generation measured its arms"
    assert first.result is not None
    assert sum(a["steps"] for a in policy.summary().values()) == first.result.stats.steps
    verify = policy.verify
    assert verify.known()
    engine.reset()
    second = engine.stream(ids, 20, method="specexec", tree=TreeConfig())
    list(second)
    assert second.policy is policy and policy.verify is verify
    assert second.result is not None
    assert sum(a["steps"] for a in policy.summary().values()) == second.result.stats.steps


def _scored_tree(logps):
    """A chain-free tree: every node a child of the root, with the given cumulative log-probs."""
    from specexec.steps.tree import Tree

    t = Tree(1, len(logps) + 1, CPU)
    t.append([0] * len(logps), list(range(2, 2 + len(logps))), [1] * len(logps), list(logps))
    return t


def _measured(policy: AdaptiveBudget, tokens_per_s: int) -> None:
    """Feed ``policy`` one step outside its arms that emitted ``tokens_per_s`` tokens in a second: the rate it
    measured, what a second of verification is worth to it."""
    policy.update(StepInfo(arm=A(10**6), tree_logp=(), emitted=tokens_per_s, draft_s=0.0, target_s=1.0, passes=0))


def _trimmed(policy: AdaptiveBudget, logps) -> Proposal:
    """A proposal of nodes with the given path log-probs, trimmed (by itself) with the policy's rule."""
    prop = Proposal(_scored_tree(logps))
    prop.trim(policy.trim_rule())
    return prop


def test_trim_keeps_the_nodes_worth_their_verification_time():
    from specexec.policy import VerifyCosts

    logps = [math.log(p) for p in (0.9, 0.6, 0.3, 0.05, 0.02, 0.01)]
    steep = VerifyCosts({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0})  # a compute-bound verifier: 0.1 s per extra token
    p = AdaptiveBudget(_arms(0, 4), verify=steep)
    assert p.trim_rule() is None and _trimmed(p, logps).trimmed == 0, "no measured rate yet: nothing is trimmed"
    _measured(p, 1)  # a second is worth one token: a node pays when its chance beats 0.1
    prop = _trimmed(p, logps)
    assert prop.trimmed == 3 and prop.tree.size == 4
    assert sorted(prop.tree.n_logp[1:].exp().tolist(), reverse=True) == pytest.approx([0.9, 0.6, 0.3])
    prop.tree.check()
    flat = AdaptiveBudget(_arms(0, 4), verify=VerifyCosts({1: 1.0, 64: 1.0}))  # a streamed verifier: every node is free
    _measured(flat, 1)
    prop = _trimmed(flat, logps)
    assert prop.trimmed == 0 and prop.tree.size == 7
    dear = AdaptiveBudget(_arms(0, 4), verify=VerifyCosts({1: 1.0, 2: 3.0}))  # one more token costs 2 s: plain AR
    _measured(dear, 1)
    prop = _trimmed(dear, logps)
    assert prop.trimmed == 6 and prop.tree.size == 1
    few = AdaptiveBudget(_arms(0, 4), verify=VerifyCosts(seconds={1: 1.0}))  # no prior, one size measured: no trim
    _measured(few, 1)
    assert few.trim_rule() is None and _trimmed(few, logps).trimmed == 0


def test_trimming_keeps_the_lookup_nodes_boundary():
    """A trimmed proposal still knows which of its nodes are prompt-lookup ones (``merged_at``), so the stats count
    the tokens they carried; with every lookup node trimmed away it has none."""
    from specexec.policy import VerifyCosts

    rule = AdaptiveBudget(_arms(0, 4), verify=VerifyCosts({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0}))
    _measured(rule, 1)
    # nodes 1-3 the draft's, 4-6 lookup nodes; the best three are 1, 4 and 2
    prop = Proposal(_scored_tree([math.log(p) for p in (0.9, 0.3, 0.05, 0.6, 0.02, 0.01)]), merged_at=4)
    prop.trim(rule.trim_rule())
    assert prop.trimmed == 3 and prop.tree.size == 4 and prop.merged_at == 3  # kept: 1, 2 (draft), then 4 (lookup)
    assert prop.tree.n_logp[prop.merged_at :].exp().tolist() == pytest.approx([0.6])
    only_draft = Proposal(_scored_tree([math.log(p) for p in (0.9, 0.6, 0.3, 0.02)]), merged_at=4)
    only_draft.trim(rule.trim_rule())
    assert only_draft.tree.size == 4 and only_draft.merged_at == 0


def test_every_lookup_bet_is_paid_from_the_answers_loss_budget():
    """Every prompt-lookup bet on a plain step is a bet the answer pays for, from the one loss budget its tries and
    explorations share: at its worst (the target takes none of its nodes) a bet may add no more seconds to the step
    than the budget has left; a miss charges the budget what it lost against one-row steps, and a hit credits it
    what it won."""
    from specexec.policy import VerifyCosts

    v = VerifyCosts({1: 0.05, 2: 0.06, 4: 0.08, 8: 0.14, 16: 0.27, 32: 0.41, 64: 0.6})
    p = AdaptiveBudget(_arms(0), verify=v)
    p.update(StepInfo(arm=A(0), tree_logp=(), emitted=1, draft_s=0.0, target_s=0.05, passes=0, size=1))
    logps = [(i + 1) * math.log(0.95) for i in range(40)]  # a confident 40-token continuation
    assert p.choose(left=64) == A(0)
    rule = p.trim_rule()
    assert rule is not None
    unbounded = Proposal(_scored_tree(logps))
    unbounded.trim(replace(rule, max_extra_s=math.inf))
    first = rule.max_extra_s
    assert first == pytest.approx(DEFAULT.loss_share * (0.05 + 64 * 0.05))
    kept = _trimmed(p, logps).tree.size - 1
    assert 1 <= kept < unbounded.tree.size - 1 and v.at(kept + 1) - v.at(1) <= first
    # the target takes none of them: the bet lost its rows' seconds beyond a one-row step
    p.update(StepInfo(arm=A(0), tree_logp=(), emitted=1, draft_s=0.0, target_s=v.at(kept + 1), passes=0, size=kept + 1))
    assert p.choose(left=63) == A(0)
    rule = p.trim_rule()
    assert rule is not None
    after_miss = rule.max_extra_s
    assert after_miss < first - 0.5 * (v.at(kept + 1) - v.at(1)), "the miss was charged to the budget"
    assert _trimmed(p, logps).tree.size - 1 < kept, "the next bet is capped by what is left"
    # the target takes every node of a bet: it won more than one-row steps would have, and the budget gets it back
    n = 4
    p.update(StepInfo(arm=A(0), tree_logp=(), emitted=n + 1, draft_s=0.0, target_s=v.at(n + 1), passes=0, size=n + 1))
    assert p.choose(left=63 - n - 1) == A(0)
    rule = p.trim_rule()
    assert rule is not None and rule.max_extra_s > after_miss, "the hit credited the budget"


def test_verify_costs_learn_and_never_decrease_with_size():
    from specexec.policy import VerifyCosts

    v = VerifyCosts({1: 1.0, 16: 2.0})
    assert v.at(8) == pytest.approx(1.0 + 7 / 15)
    v.update(1, 3.0)  # the prior was measured on an idle machine; steps now take 3x: the whole curve scales
    assert v.scale() == pytest.approx(3.0) and v.at(16) == pytest.approx(6.0)
    v.update(16, 4.0)  # a size measured online uses its own measurement
    assert v.at(16) == pytest.approx(4.0) and v.at(1) == pytest.approx(3.0)
    assert v.curve(16) == sorted(v.curve(16)), "a bigger pass never looks cheaper"
    p = AdaptiveBudget(_arms(0, 4), verify=v)
    p.update(StepInfo(arm=A(4), tree_logp=(), emitted=3, draft_s=0.5, target_s=1.0, passes=2, size=5))
    rule = p.trim_rule()
    assert rule is not None and rule.rate == pytest.approx(2.0) and 5 in v.seconds


def test_exploration_steps_are_trimmed_as_the_best_arm_is():
    """An arm is measured as it would run: exploring it verifies no more than choosing it would."""
    from specexec.policy import VerifyCosts

    p = AdaptiveBudget(
        _arms(0, 4, 16),
        config=replace(DEFAULT, explore_every=2),
        verify=VerifyCosts({1: 1.0, 2: 3.0}),
    )
    _feed(p, A(0), 1, 1.0, 3)
    _feed(p, A(4), 1, 2.0, 3)  # arm 0 is the best
    logps = [math.log(0.5)] * 3
    trimmed = []
    for _ in range(6):
        arm = p.choose(left=100)  # a long answer ahead: its loss share affords explorations
        trimmed.append((arm, _trimmed(p, logps).trimmed))
    assert any(a != 0 for a, _ in trimmed), "the policy explored"
    assert all(t == 3 for _, t in trimmed), "every step trims what costs more than it returns"


@pytest.mark.parametrize("left, explored", [(4, False), (100, True)])
def test_an_exploration_runs_only_if_its_worst_step_fits_the_answer(left, explored):
    """An exploration is a bet the answer pays for: an arm whose measured step, emitting a single token, would lose
    more than the answer's loss share (``loss_share`` of its expected time) is not explored near the end of a short
    answer, and is with a long one ahead."""
    p = AdaptiveBudget(_arms(0, 4), config=replace(DEFAULT, explore_every=2))
    _feed(p, A(0), 1, 1.0, 3)  # plain decoding: a token a second
    _feed(p, A(4), 2, 3.0, 3)  # arm 4: 3 s a step, 0.67 tokens a second; at worst 2 s lost
    picks = [p.choose(left=left) for _ in range(6)]
    assert any(a == A(4) for a in picks) == explored, picks


def test_trimmed_proposals_stay_exact(engine):
    """An auto CPU policy that trims (a steep verification curve) still reproduces AR, and does trim."""
    from specexec.policy import VerifyCosts

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    ar = engine.generate(prompt, 40, method="ar").tokens
    pol = AdaptiveBudget(_arms(0, 4, 16), verify=VerifyCosts({1: 0.001, 2: 0.002, 8: 0.02, 64: 0.2}))
    _measured(pol, 300)
    r = engine.generate(prompt, 40, method="specexec", tree=TreeConfig(auto=True), policy=pol)
    assert r.tokens == ar
    assert r.stats.trimmed > 0


@pytest.mark.parametrize("samp", [SamplingConfig(), SamplingConfig(temperature=1.0, seed=5)])
def test_chain_arms_of_the_cpu_policy_are_exact(engine, samp):
    """Negative arms are chains of the draft's argmax (sampling: its coupled draws), verified by the tree walk: the
    same tokens as AR for the same seed, also when sampling, and the policy really ran them."""
    from specexec.policy import VerifyCosts

    for ids in (_prompt(engine), [40, 41, 42]):
        engine.reset()
        ref = engine.generate(ids, 40, method="ar", sampling_cfg=samp).tokens
        engine.reset()
        pol = AdaptiveBudget(_arms(-3, -2), verify=VerifyCosts({1: 1.0, 64: 1.0}))
        r = engine.generate(ids, 40, method="specexec", sampling_cfg=samp, tree=TreeConfig(auto=True), policy=pol)
        assert r.tokens == ref
        assert set(r.stats.budgets) <= set(_arms(-3, -2)) and r.stats.draft_passes > 0


def test_chain_stop_weighs_the_next_token_against_its_pass():
    """ChainStop (a chain arm's per-token stop): a confident chain goes on, an unsure token ends it, a dear
    verification or draft pass ends it sooner, and no cost is guessed beyond the measured curve."""
    import math

    from specexec.steps.rules import ChainStop

    flat = [0.5] * 8  # verify seconds by size: every extra token free
    cheap = ChainStop(pass_s=0.05, verify_s=flat)
    sure = [math.log(0.95 ** (i + 1)) for i in range(4)]
    assert cheap.more(sure[:1], 1) and cheap.more(sure, 4)
    unsure = [math.log(0.9), math.log(0.9 * 0.2)]  # the second token was a coin toss: its successor likely fails
    assert not cheap.more(unsure, 2)
    assert not ChainStop(pass_s=2.0, verify_s=flat).more(sure[:1], 1)  # a draft pass as dear as 4 target passes
    steep = [0.5 * (k + 1) for k in range(8)]  # each verified token costs a whole target pass
    assert not ChainStop(pass_s=0.05, verify_s=steep).more(sure[:2], 2)
    assert not cheap.more([math.log(0.99)] * 7, 7)  # the curve ends at 8 tokens: no guess beyond it
    assert ChainStop(pass_s=0.05, verify_s=flat, acc_scale=0.3).more(sure[:1], 1) is True
    assert not ChainStop(pass_s=0.05, verify_s=flat, acc_scale=0.05).more(sure[:1], 1)  # an overconfident draft


def test_chain_arms_stop_per_token_and_stay_exact(engine):
    """Once a pass cost is measured the policy hands chain arms a ChainStop: chains end early where the draft is
    unsure (early_stops counts them), and the tokens are still AR's."""
    from specexec.policy import VerifyCosts
    from specexec.steps.rules import ChainStop

    pol = AdaptiveBudget(_arms(-6), verify=VerifyCosts({1: 0.01, 64: 0.01}))
    assert pol.grow_cost(A(-6)) is None  # nothing measured yet: full chains
    prompt = _prompt(engine)
    engine.reset()
    ref = engine.generate(prompt, 48, method="ar").tokens
    engine.reset()
    r = engine.generate(prompt, 48, method="specexec", tree=TreeConfig(auto=True), policy=pol)
    assert r.tokens == ref
    stop = pol.grow_cost(A(-6))
    assert isinstance(stop, ChainStop) and len(stop.verify_s) == 8
    assert r.stats.early_stops > 0 and r.stats.draft_passes < 6 * r.stats.steps


def test_chain_stop_leaves_to_a_following_continuation():
    """A chain whose next token an n-gram continuation proposes anyway (``covered``) is worth fewer passes."""
    from specexec.steps.rules import ChainStop

    cheap = ChainStop(pass_s=0.05, verify_s=[0.5] * 8)
    sure = [math.log(0.95)]
    assert cheap.more(sure, 1, covered=0.0)
    assert cheap.more(sure, 1, covered=0.5)
    assert not cheap.more(sure, 1, covered=0.98)


def test_follow_tracks_the_continuations_a_chain_still_matches():
    from specexec.propose.chain import _Follow

    f = _Follow([(3, [1, 2, 3, 4]), (2, [1, 9])], acc=0.7)
    assert f.step(1) == 0.7  # both still followed, and they go on
    assert f.step(2) == 0.7  # [1, 2, 3, 4] goes on after 2
    assert f.step(3) == 0.7
    assert f.step(4) == 0.0  # it ends here: the next pass adds a token no continuation proposes
    g = _Follow([(2, [1, 2])], acc=0.7)
    assert g.step(5) == 0.0 and g.step(2) == 0.0  # left the continuation: never followed again


@pytest.mark.parametrize("samp", [SamplingConfig(), SamplingConfig(temperature=0.3, seed=3)])
def test_chain_arms_run_on_along_ngram_continuations_exactly(engine, samp):
    """A chain arm's tree holds the n-gram continuations too: on text that repeats itself a step emits more than
    the chain's draft tokens + 1 (the continuation ran on past the chain at no draft cost), the chain stops
    earlier once costs are known, and the tokens are AR's for the same seed, greedy or sampled (at a temperature
    low enough that the sampled text follows the cycle too: a hot sample of a tiny random model does not repeat)."""
    from specexec.policy import VerifyCosts

    prompt = _prompt(engine)
    engine.reset()
    ref = engine.generate(prompt, 48, method="ar", sampling_cfg=samp).tokens
    engine.reset()
    pol = AdaptiveBudget(_arms(-2), verify=VerifyCosts({1: 0.01, 64: 0.01}))
    r = engine.generate(prompt, 48, method="specexec", sampling_cfg=samp, tree=TreeConfig(auto=True), policy=pol)
    assert r.tokens == ref
    assert set(r.stats.budgets) == {A(-2)}
    assert max(r.stats.accepted_hist) > 3, r.stats.accepted_hist  # a chain of 2 + the bonus token is 3 at most


def test_coupled_chains_when_sampling(tiny_models, tmp_path):
    """Sampling, a chain arm's draft tokens are coupled draws (the walk's own noise): with a draft that IS the
    target every draft token is the target's draw, so every full step keeps the whole chain -- an argmax chain
    at temperature 1 would not -- and the tokens are AR's for the same seed."""
    eng = _engine(tiny_models["llama"], tiny_models["llama"])
    samp = SamplingConfig(temperature=1.0, seed=21)
    prompt = [5, 6, 7]
    ref = eng.generate(prompt, 40, method="ar", sampling_cfg=samp).tokens
    eng.reset()
    pol = AdaptiveBudget(_arms(-3))  # no costs known: full chains of 3
    r = eng.generate(prompt, 40, method="specexec", sampling_cfg=samp, tree=TreeConfig(auto=True), policy=pol)
    assert r.tokens == ref
    full = {k: v for k, v in r.stats.accepted_hist.items()}
    assert len(ref) == 40 and full.get(4, 0) >= r.stats.steps - 1, full  # the last step may be cut at the limit


def test_coupling_raises_acceptance_over_the_argmax():
    """The coupled draw matches the target's Gumbel-max draw more often than the draft's argmax does, for a draft
    close to the target (deterministic: fixed logits, seeds 0..1999)."""
    from specexec.steps import sampling

    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(64, 50, generator=gen) * 2.0
    q_logits = p_logits + 0.5 * torch.randn(64, 50, generator=gen)  # a noisy copy
    samp = SamplingConfig(temperature=1.0)
    lp = sampling.logprobs(p_logits, samp)
    coupled = argmax = 0
    for seed in range(2000):
        pos = list(range(seed % 7, seed % 7 + 64))
        target = sampling.gumbel_max(lp, sampling.gumbels(seed, pos, 50))
        coupled += int((sampling.coupled_choice(q_logits, samp, seed, pos) == target).sum())
        argmax += int((q_logits.argmax(-1) == target).sum())
    n = 2000 * 64
    assert coupled / n > argmax / n + 0.1, (coupled / n, argmax / n)


def test_auto_budget_times_the_draft_through_its_own_passes(noisy_pairs, tmp_path, monkeypatch):
    """The cost-model auto budget times the draft through DraftModel.forward (its graphed passes on a GPU, what
    its steps run), not its model's eager forward: on an H200 the eager timing was ~3x the steps' passes, so the
    drift check measured the costs again before every generation."""
    from specexec.propose.draft_model import DraftModel

    monkeypatch.setattr(Engine, "_measured_policy", lambda self: False)  # the GPU's policy, on this CPU
    calls: list[int] = []
    orig = DraftModel.forward

    def counted(self, tokens, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(int(tokens.shape[0]))
        return orig(self, tokens, *a, **kw)

    monkeypatch.setattr(DraftModel, "forward", counted)
    target, draft = noisy_pairs["llama"]
    tree = TreeConfig(auto=True, max_budget=64, max_beams=16)
    e = Engine(
        load_model(target, CPU, torch.float32),
        load_tokenizer(target),
        load_model(draft, CPU, torch.float32),
        context=256,
        tree=tree,
        costs_dir=tmp_path,
    )
    g = e.stream([5, 6, 7], 4, method="specexec", tree=tree)
    list(g)
    assert {1, 16} <= set(calls), "the measured beam counts ran through DraftModel.forward"
    assert isinstance(g.policy, AutoBudget) and set(g.policy.draft_pass_s) == {1, 16}


def test_a_catch_up_pass_is_not_charged_to_the_arm():
    """The seconds a lagging draft spent catching up are the steps' before it: the arm is rated on the rest."""
    p = AdaptiveBudget(_arms(0, -2))
    p.update(StepInfo(arm=A(-2), tree_logp=(), emitted=3, draft_s=1.5, target_s=0.5, passes=2, catch_up_s=1.0))
    assert p.summary()[A(-2)]["seconds"] == pytest.approx(1.0)
