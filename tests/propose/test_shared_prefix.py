"""A self-derived draft reads the target's KV prefix (``Engine(share_prefix=True)``, the default for ``draft="self"``).

The committed tokens' keys/values come from the target's cache (copied after each step; the draft's layer i is the
target's layer ``source_layers[i]``), so the draft never runs the prompt or an accepted token itself. Checked here:
the draft's committed prefix *is* the target's, entry for entry, after every kind of step (tree, chain, fixed-width
levels, a cut at the token limit, the next chat turn, a new prompt); the draft's first pass of a generation is the
root alone; greedy output equals the target's AR output; sampled output follows the target's distribution
(chi-square, as tests/decoding/test_sampling.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specexec import api
from specexec.config import ChainConfig, SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine, shared_layers
from specexec.loading.checkpoint import load_model, load_tokenizer
from tests.loading.test_self_draft import PROMPT, assert_tree_and_chain_equal_ar

CPU = torch.device("cpu")
DEEP = TreeConfig.fixed(8, max_beams=2, early_stop=False, max_depth=16, max_branch=8)
LEVELS = replace(DEEP, grow="ahead")


def _self(path, share=True, context=256):
    return api.load(
        str(path), "self", device="cpu", dtype="fp32", draft_dtype="int8", context=context, tree=TreeConfig.fixed(8),
        share_prefix=share,
    )  # fmt: skip


def assert_prefix_is_the_targets(engine) -> None:
    """The draft's committed entries are the target's (its layers), and it holds every committed token but the
    pending one."""
    d, state = engine.draft_model, engine.state
    assert d is not None and state is not None and d.prefix is not None
    n = d.length
    assert n == state.t_len == len(state.seq) - 1
    assert d.tokens == state.seq[:-1]
    src = list(engine.draft.source_layers)
    torch.testing.assert_close(d.cache.k[:, :, :n], state.cache.k[src, :, :n], rtol=0, atol=0)
    torch.testing.assert_close(d.cache.v[:, :, :n], state.cache.v[src, :, :n], rtol=0, atol=0)


@pytest.fixture(scope="module")
def whole(tiny_models):
    return _self(tiny_models["qwen2"])


def test_only_a_self_derived_draft_shares_and_it_can_be_turned_off(tiny_models, tiny_pair, whole):
    assert whole.draft.source_layers == tuple(range(whole.target.cfg.num_layers))
    assert whole.share_prefix and whole.draft_model.prefix is not None
    off = _self(tiny_models["qwen2"], share=False)
    assert not off.share_prefix and off.draft_model.prefix is None
    want = off.generate(PROMPT, 20, method="ar").tokens
    assert off.generate(PROMPT, 20, method="specexec", tree=DEEP).tokens == want
    off.set_share_prefix(True)  # turned on (and off) on a loaded engine
    assert off.share_prefix and off.draft_model.prefix is not None
    assert off.generate(PROMPT, 20, method="specexec", tree=DEEP).tokens == want
    assert_prefix_is_the_targets(off)
    off.set_share_prefix(False)
    assert off.draft_model.prefix is None and off.draft_model.length == 0
    separate = api.load(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", dtype="fp32", context=64)
    assert separate.draft.source_layers is None and separate.draft_model.prefix is None
    assert shared_layers(separate.target, separate.draft) is None
    separate.set_share_prefix(True)  # a separate draft cannot share: stays off
    assert not separate.share_prefix and separate.draft_model.prefix is None


def test_greedy_equals_ar_and_the_prefix_is_the_targets(whole):
    engine = whole
    assert_tree_and_chain_equal_ar(engine, 30)
    assert_prefix_is_the_targets(engine)
    want = engine.generate(PROMPT, 40, method="ar").tokens
    for tree in (DEEP, LEVELS):  # deep trees; fixed-width levels (their padding rows write the scratch slot)
        r = engine.generate(PROMPT, 40, method="specexec", tree=tree)
        assert r.tokens == want, tree
        assert_prefix_is_the_targets(engine)


def test_the_draft_runs_no_committed_token(whole):
    """The draft's first pass of a generation is the root alone, and every committed token's entries were copied."""
    d = whole.draft_model
    rows: list[int] = []
    real = d.model.forward

    def spy(tokens, *a, **kw):
        rows.append(int(tokens.shape[0]))
        return real(tokens, *a, **kw)

    d.model.forward = spy
    try:
        whole.reset()
        before = d.prefix.copied
        r = whole.generate(PROMPT, 20, method="specexec", tree=DEEP)
        assert rows[0] == 1  # the root: the prompt's entries came from the target's prefill
        assert d.prefix.copied - before == len(PROMPT) + len(r.tokens) - 1  # every committed token
        rows.clear()
        whole.generate(PROMPT, 20, method="chain", chain=ChainConfig(gamma=4))
        assert rows and max(rows) == 1  # a chain drafts one token a pass and never catches up on committed ones
    finally:
        del d.model.forward


def test_a_cut_step_the_next_turn_and_a_new_prompt(whole):
    """A step cut at the token limit commits fewer tokens than were accepted; the next turn extends the sequence
    (the cached prefix is kept); a new prompt shares only its first token."""
    e = whole
    e.reset()
    first = e.generate(PROMPT, 3, method="specexec", tree=DEEP)
    assert len(first.tokens) == 3
    assert_prefix_is_the_targets(e)
    ids = PROMPT + first.tokens + [11, 12]  # the next turn: the prefix is kept and extended
    got = e.generate(ids, 25, method="specexec", tree=DEEP).tokens
    assert_prefix_is_the_targets(e)
    other = [PROMPT[0], 40, 41, 3, 90]
    got_other = e.generate(other, 25, method="chain", chain=ChainConfig(gamma=4)).tokens
    assert_prefix_is_the_targets(e)
    e.reset()
    assert got == e.generate(ids, 25, method="ar").tokens
    assert got_other == e.generate(other, 25, method="ar").tokens


def test_sampling_with_a_shared_prefix_follows_the_target(tmp_path_factory):
    """Engine-level chi-square (as in test_sampling.py): a noisy copy of the target marked as derived from it (so it
    reads the target's prefix), SpecExec with deep trees; token-for-token equal to AR for the same seed."""
    from tests.decoding import test_sampling as ts

    root = tmp_path_factory.mktemp("shared_sampling")
    target = ts.make_tiny(root / "target", "llama", vocab=ts.V, seed=3, std=0.3, layers=2, hidden=32)
    draft = ts.make_noisy_copy(target, root / "draft", 0.1)
    t_model, d_model = load_model(target, CPU, torch.float32), load_model(draft, CPU, torch.float32)
    d_model.source_layers = (0, 1)
    e = Engine(t_model, load_tokenizer(target), d_model, context=256)
    assert e.draft_model is not None and e.draft_model.prefix is not None
    table = ts.Table(t_model, ts.PROMPT)
    samp = SamplingConfig(temperature=1.0, top_p=0.8)
    P = ts.truncate_at_eos(ts.joint(table, samp))
    out, mismatched, _ = ts.engine_samples(e, samp, replace(DEEP, budget=8))
    assert mismatched == 0
    assert ts.record("T1-p0.8", "engine: specexec budget=8 + shared prefix", out, P) > ts.ALPHA
