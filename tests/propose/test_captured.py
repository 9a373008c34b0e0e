"""Captured growth levels (TreeConfig.grow "captured", specexec/propose/captured.py): a level's bookkeeping and draft
pass replayed as two CUDA graphs, the beams' count read between them.

A CUDA graph bakes every host value into its kernels and replays them with the same arguments. On a CPU there is no
graph, so these tests stand one in: "capturing" records the level's code without running it, and a replay runs the
code recorded at capture time (a closure over the step that captured it) in a later level or step. A level whose
code read anything from the host that changes between levels (the tree's size, the next slot, the prefix length)
would then grow from stale values and the trees would differ; they must be node for node those of the dynamic
growth (with the same passes), and generation must stay exactly the target's greedy text. The CUDA tests replay
real graphs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specexec.config import SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.propose import DraftModel, StepContext, TreeDraft, captured, fixed_grow
from specexec.steps.record import Arm
from tests.model.test_graphs import static_engine
from tests.propose.test_fixed_grow import PROMPTS, _same_tree

CPU = torch.device("cpu")


class _Recorded:
    """A stand-in graph: the level's code as recorded (not run) at capture; each replay runs it."""

    def __init__(self, body):
        self.body = body
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.body()


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """Every level of a static-pass draft is "capturable" on the CPU; capturing records the code, not running it."""
    recorded = []

    def capture(self, body):
        g = _Recorded(body)
        recorded.append(g)
        return g

    monkeypatch.setattr(captured.LevelSpace, "_capture", capture)
    monkeypatch.setattr(fixed_grow, "capturable", lambda static, rows: True)
    return recorded


@pytest.fixture(scope="module")
def draft(noisy_pairs):
    return load_model(noisy_pairs["llama"][1], CPU, torch.float32)


def _steps(model, cfg, seqs, static):
    """One proposer over several steps (fresh prefixes: the recorded levels replay across steps): each step's tree
    and (passes, rows per pass)."""
    td = TreeDraft(DraftModel(model, 1024, static=static, static_rows=cfg.max_beams), cfg)
    out = []
    for seq in seqs:
        td.begin(seq)
        td.draft.prefill(seq)
        tree, passes, beams, _ = td.grow(seq, cfg)
        out.append((tree, (passes, beams)))
    return td, out


@pytest.mark.parametrize("static", [True, False])
def test_replayed_levels_grow_the_dynamic_trees(draft, stand_in_graphs, static):
    """Across levels and steps, with and without static (padded) draft passes, budgets the tree fills (the threshold
    comes from the top ``budget``) and ones it never fills: the trees, passes and rows of the dynamic growth (which
    also reads each level's count before its pass)."""
    seqs = [list(p) for p in PROMPTS] + [PROMPTS[0] + [11, 12], PROMPTS[1][:3]]
    for budget, beams, branch, depth in ((6, 2, 4, 8), (40, 4, 8, 10), (400, 8, 6, 6)):
        base = TreeConfig.fixed(budget, max_beams=beams, max_branch=branch, max_depth=depth, early_stop=False)
        _, want = _steps(draft, replace(base, grow="dynamic"), seqs, static)
        td, got = _steps(draft, replace(base, grow="captured"), seqs, static)
        for i, ((a, pa), (b, pb)) in enumerate(zip(want, got)):
            _same_tree(a, b, (budget, i))
            assert pa == pb, (budget, i, pa, pb)
        space = td.draft.level_space
        assert space.captures == len(space.graphs) <= len(space.seen)
        if static:  # spans come in buckets: a graph replays at many levels (unbucketed spans seldom repeat a key)
            assert space.replays > space.captures > 0, (budget, space.captures, space.replays)


def _static_engine(noisy_pairs) -> Engine:
    """The llama pair on the CPU, the draft on padded static passes (eager here): spans come in buckets, so levels
    repeat their keys and recorded levels replay."""
    return static_engine(noisy_pairs["llama"], 512)


def test_captured_levels_keep_greedy_exact_with_early_stop(noisy_pairs, stand_in_graphs):
    """Through the engine: greedy output equals AR with replayed levels, with and without the early stop; a sampled
    step grows uncaptured and stays AR's draw."""
    e = _static_engine(noisy_pairs)
    trees = (
        TreeConfig.fixed(16, max_beams=4, max_branch=8, max_depth=8, grow="captured"),
        TreeConfig.fixed(24, max_beams=8, max_branch=4, max_depth=10, grow="captured", early_stop=True),
    )
    for tree in trees:
        for ids in PROMPTS:
            e.reset()
            want = e.generate(ids, 32, method="ar").tokens
            e.reset()
            assert e.generate(ids, 32, method="specexec", tree=tree).tokens == want, (tree, ids)
    assert sum(g.replays for g in stand_in_graphs) > 0
    # the space and its graphs live on the draft: a new generation (a new proposer) replays them, capturing nothing
    space = e.draft_model.level_space
    e.reset()
    e.generate(PROMPTS[0], 32, method="specexec", tree=trees[0])
    captures, replays = space.captures, space.replays
    e.reset()
    e.generate(PROMPTS[0], 32, method="specexec", tree=trees[0])
    assert e.draft_model.level_space is space and space.captures == captures and space.replays > replays
    samp = SamplingConfig(temperature=0.9, seed=4)
    e.reset()
    want = e.generate(PROMPTS[0], 24, method="ar", sampling_cfg=samp).tokens
    e.reset()
    assert e.generate(PROMPTS[0], 24, method="specexec", sampling_cfg=samp, tree=trees[0]).tokens == want


def test_captured_passes_run_the_open_rows_bucket(draft, stand_in_graphs, monkeypatch):
    """Grow "captured" knows a level's count before its pass, so the pass runs the smallest static bucket holding
    the open rows, at least 16 (a small tree leaves few open), where "ahead" runs the level's width once the tree
    holds that many nodes."""
    ran = []
    forward = draft.forward

    def counted(tokens, *a, **kw):  # rows of every draft pass (prefills ask for the last row's logits only)
        if kw.get("logits_rows") is None:
            ran.append(int(tokens.shape[0]))
        return forward(tokens, *a, **kw)

    monkeypatch.setattr(draft, "forward", counted)
    base = TreeConfig.fixed(6, max_beams=64, max_branch=4, max_depth=6, early_stop=False)
    for mode in ("captured", "ahead"):
        ran.clear()
        _, got = _steps(draft, replace(base, grow=mode), [PROMPTS[0], PROMPTS[1]], static=True)
        levels = [b for b in ran if b > 1]  # (the root's catch-up passes run a row each)
        opened = [r for _, (_, log) in got for r in log[1:]]
        if mode == "captured":  # at least captured.MIN_ROWS rows
            assert max(opened) < 16 and set(levels) == {16}, (levels, opened)
        else:
            assert max(levels) == 64, levels


def test_a_failed_capture_leaves_the_levels_eager(noisy_pairs, stand_in_graphs, monkeypatch, caplog):
    """A capture that raises (an op a graph cannot hold, on some GPU or torch) only turns the captured levels off,
    with one warning: the level that was being captured runs eagerly (a capture only records) and the text is
    still the target's."""
    e = _static_engine(noisy_pairs)

    def fail(self, body):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(captured.LevelSpace, "_capture", fail)
    tree = TreeConfig.fixed(16, max_beams=4, max_branch=8, max_depth=8, grow="captured")
    for ids in PROMPTS:
        e.reset()
        want = e.generate(ids, 24, method="ar").tokens
        e.reset()
        with caplog.at_level("WARNING", logger="specexec.propose.captured"):
            assert e.generate(ids, 24, method="specexec", tree=tree).tokens == want
    space = e.draft_model.level_space
    assert space.failed is not None and "capturing" in space.failed and space.captures == space.replays == 0
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1


def test_a_sampled_step_runs_no_captured_level(draft, stand_in_graphs):
    """The coupled draft noise is keyed by the step's seed (a host value a graph would bake): a seeded step of grow
    "captured" grows the uncaptured "ahead" levels (a host that never waits, as on a GPU by default)."""
    samp = SamplingConfig(temperature=1.0, seed=3)
    seq = PROMPTS[0]
    props = {}
    for mode in ("ahead", "captured"):
        cfg = TreeConfig.fixed(4, max_beams=8, max_branch=4, max_depth=12, grow=mode, early_stop=False)
        td = TreeDraft(DraftModel(draft, 512), cfg)
        td.begin(seq)
        props[mode] = td.propose(seq, StepContext(samp=samp, gen=None, arm=Arm("tree", 4), seed=3))
        assert td.draft.level_space is None
        if mode == "captured":
            td.propose(seq, StepContext(samp=SamplingConfig(), gen=None, arm=Arm("tree", 4)))
            assert td.draft.level_space is not None
    _same_tree(props["ahead"].tree, props["captured"].tree, "captured")
    assert (props["captured"].passes, props["captured"].beams) == (props["ahead"].passes, props["ahead"].beams)


def test_the_space_grows_and_keys_its_graphs(draft, stand_in_graphs):
    """A step that needs more room than the space holds gets a bigger one (and its graphs start afresh); a step that
    fits keeps the space, so its graphs replay."""
    small = TreeConfig.fixed(8, max_beams=2, max_branch=4, max_depth=4, grow="captured", early_stop=False)
    td, _ = _steps(draft, small, [PROMPTS[0], PROMPTS[1]], static=True)
    first = td.draft.level_space
    td.begin(PROMPTS[2])
    td.draft.prefill(PROMPTS[2])
    big = replace(small, max_depth=8, max_beams=4)
    td.grow(PROMPTS[2], big)
    assert td.draft.level_space is not first and td.draft.level_space.capacity >= first.capacity
    again = td.draft.level_space
    td.grow(PROMPTS[2], small)
    assert td.draft.level_space is again


def test_auto_growth_asks_whether_its_levels_can_replay_as_graphs(draft, monkeypatch):
    """The proposer resolves grow "auto" with whether a level of ``max_beams`` rows can replay as a CUDA graph (its
    draft's static passes graphed and that wide): on a GPU "captured" then, else "ahead" (levels that cannot be
    captured would only add a host wait a level). A CPU's static passes are not graphed."""
    from specexec.propose import best_first as tree_mod

    asked = []
    resolve = TreeConfig.grow_mode

    def spy(self, device, graphs=None):  # the growth's own resolution passes ``graphs``; other callers do not
        if graphs is not None:
            asked.append(graphs)
        return resolve(self, device, True if graphs is None else graphs)

    monkeypatch.setattr(TreeConfig, "grow_mode", spy)
    cfg = TreeConfig.fixed(24, max_beams=4, max_branch=8, max_depth=8, early_stop=False, grow="ahead")
    _steps(draft, cfg, [list(PROMPTS[0])], static=True)
    assert asked and not any(asked)  # CPU: no graphs
    asked.clear()
    monkeypatch.setattr(tree_mod, "capturable", lambda static, rows: static is not None and rows <= static.max_rows)
    _steps(draft, cfg, [list(PROMPTS[0])], static=True)
    assert asked and all(asked)
    asked.clear()
    _steps(draft, cfg, [list(PROMPTS[0])], static=False)  # no static passes: nothing to replay
    assert asked and not any(asked)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_captured_levels_replay_real_graphs(noisy_pairs):
    """On a GPU: levels are captured and replayed as CUDA graphs, the trees equal the dynamic growth's, and greedy
    generation equals AR."""
    dev = torch.device("cuda")
    target, draft_path = noisy_pairs["llama"]
    model = load_model(draft_path, dev, torch.float32)
    seqs = [list(p) for p in PROMPTS] * 2
    for budget, beams in ((24, 4), (300, 16)):
        base = TreeConfig.fixed(budget, max_beams=beams, max_branch=8, max_depth=12, early_stop=False)
        _, want = _steps(model, replace(base, grow="dynamic"), seqs, static=True)
        td, got = _steps(model, replace(base, grow="captured"), seqs, static=True)
        for i, ((a, pa), (b, pb)) in enumerate(zip(want, got)):
            _same_tree(a, b, (budget, i))
            assert pa == pb, (budget, i)
        assert td.draft.level_space.captures > 0 and td.draft.level_space.replays > 0
    e = Engine(load_model(target, dev, torch.float32), load_tokenizer(target), model, context=512)
    for tree in (
        TreeConfig.fixed(16, max_beams=4, max_branch=8, max_depth=8, grow="captured", early_stop=True),
        TreeConfig.fixed(16, max_beams=4, max_branch=8, max_depth=8, grow="ahead"),
    ):
        for ids in PROMPTS:
            e.reset()
            want = e.generate(ids, 32, method="ar").tokens
            e.reset()
            assert e.generate(ids, 32, method="specexec", tree=tree).tokens == want, (tree, ids)
