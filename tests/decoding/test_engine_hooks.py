"""The engine's text entry and per-step hook: ``encode(chat=True)`` is the text layer's rendering, and
``stream(on_step=...)`` sees every step once (totals match the stats) and can cancel cleanly at a step boundary."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specexec.config import ChainConfig, TreeConfig
from specexec.decoding.engine import Cancelled, Engine, StepInfo
from specexec.decoding.text import ChatTemplateError, encode_text, render_chat
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.propose import NGramConfig
from specexec.steps.record import Arm
from tests.conftest import make_noisy_copy, make_tiny

CPU = torch.device("cpu")
PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7]  # a repeat, so n-gram lookup has something to propose


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hooks")
    target = make_tiny(root / "target", "llama", seed=4)
    return target, make_noisy_copy(target, root / "draft", 0.1)


def _engine(pair) -> Engine:
    target, draft = pair
    t = load_model(target, CPU, torch.float32)
    return Engine(t, load_tokenizer(target), load_model(draft, CPU, torch.float32), context=256)


@pytest.fixture(scope="module")
def engine(pair) -> Engine:
    return _engine(pair)


@pytest.fixture(scope="module")
def reference(pair):
    """The target's greedy continuation of any prompt, from an engine of its own (method ar)."""
    ref = _engine(pair)

    def ar(ids: list[int], n: int) -> list[int]:
        ref.reset()
        return ref.generate(ids, n, method="ar").tokens

    return ar


# ---------------------------------------------------------------------------------------------- encode


def test_encode_chat_is_render_chat(engine, monkeypatch):
    tok = engine.tokenizer.tokenizer
    for text in ("t10 t11 t12", "t40", "t7 t7 t7 t8"):
        want = render_chat(tok, [{"role": "user", "content": text}])
        assert engine.encode(text, chat=True) == want
        assert engine.encode(text) == encode_text(tok, text)
        assert want != encode_text(tok, text)  # the template really wraps it
    calls = []
    import specexec.decoding.engine

    monkeypatch.setattr(specexec.decoding.engine, "render_chat", lambda t, m: calls.append(m) or [7])
    assert engine.encode("t10", chat=True) == [7] and calls == [[{"role": "user", "content": "t10"}]]


def test_encode_chat_without_a_template_names_the_setting(pair):
    e = _engine(pair)
    e.tokenizer.tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError) as info:
        e.encode("t10", chat=True)
    from specexec.cli.common import user_message

    assert user_message(info.value) == "--chat needs a chat template, and this tokenizer has none"


# ---------------------------------------------------------------------------------------------- on_step

METHODS = {
    "ar": dict(method="ar"),
    "chain:4": dict(method="chain", chain=ChainConfig(gamma=4)),
    "specexec:8": dict(method="specexec", tree=TreeConfig.fixed(8)),
    "specexec:32+ngram": dict(method="specexec", tree=TreeConfig.fixed(32), ngram=NGramConfig()),
    "ngram": dict(method="ngram"),
    "default": dict(tree=TreeConfig(budget=8, auto=True, max_budget=32)),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_on_step_once_per_step_with_consistent_totals(engine, reference, name):
    engine.reset()
    seen: list[StepInfo] = []
    r = engine.generate(PROMPT, 24, on_step=seen.append, **METHODS[name])
    st = r.stats
    assert r.tokens == reference(PROMPT, 24)
    assert len(seen) == st.steps > 0 and [s.index for s in seen] == list(range(st.steps))
    assert [t for s in seen for t in s.tokens] == r.tokens
    assert sum(s.passes for s in seen) == st.draft_passes
    assert sum(s.draft_s for s in seen) == pytest.approx(st.draft_s)
    assert sum(s.target_s for s in seen) == pytest.approx(st.target_s)
    assert sum(s.tree_size for s in seen) / st.steps == pytest.approx(st.mean_tree_size)
    budgets: dict[Arm, int] = {}
    for s in seen:
        budgets[s.arm] = budgets.get(s.arm, 0) + 1
    assert budgets == st.budgets
    assert all(s.draft_s >= 0 and s.target_s > 0 for s in seen)
    if name == "ar":
        assert all(s.tree_size == 0 and s.passes == 0 and len(s.tokens) == 1 for s in seen)
    with pytest.raises(dataclasses.FrozenInstanceError):  # read-only
        seen[0].index = 5  # type: ignore[misc]


@pytest.mark.parametrize("how", ["false", "raise"])
@pytest.mark.parametrize("name", ["ar", "chain:4", "specexec:8", "default"])
def test_cancel_from_the_hook_leaves_the_engine_usable(engine, reference, name, how):
    engine.reset()

    def hook(info: StepInfo) -> bool:
        if info.index < 2:
            return True
        if how == "raise":
            raise Cancelled
        return False

    seen: list[StepInfo] = []
    g = engine.stream(PROMPT, 40, on_step=lambda i: seen.append(i) or hook(i), **METHODS[name])
    pieces = list(g)
    r = g.result
    assert r is not None and r.finish_reason == "cancelled" and r.stats.finish_reason == "cancelled"
    assert len(seen) == 3 == r.stats.steps
    assert r.tokens == [t for s in seen for t in s.tokens] and 3 <= len(r.tokens) < 40
    assert "".join(pieces) == r.text
    assert r.tokens == reference(PROMPT, 40)[: len(r.tokens)]  # what was emitted is exact
    assert engine.seq == PROMPT + r.tokens  # the committed sequence is what was emitted
    # the next generation extends the cancelled one (prefix cache reused) and is still exact
    longer = PROMPT + r.tokens
    nxt = engine.generate(longer, 16, **METHODS[name])
    assert nxt.stats.prefill_tokens < len(longer) and nxt.tokens == reference(longer, 16)
    assert nxt.finish_reason in ("length", "stop")  # no hook: not cancelled
    # and an unrelated prompt after a fresh cancel
    engine.generate(PROMPT, 40, on_step=hook, **METHODS[name])
    other = [30, 31, 32, 33]
    assert engine.generate(other, 16, **METHODS[name]).tokens == reference(other, 16)


def test_cancel_matches_close(engine):
    """Cancelling from the hook after step k leaves the state close() after step k's piece leaves."""
    engine.reset()
    hooked = engine.generate(PROMPT, 40, method="ar", on_step=lambda i: i.index < 3)
    seq_hooked = engine.seq
    engine.reset()
    g = engine.stream(PROMPT, 40, method="ar")
    it = iter(g)
    for _ in range(4):  # AR: one token, one piece per step
        next(it)
    g.close()
    assert g.result is not None and g.result.finish_reason == hooked.finish_reason == "cancelled"
    assert g.result.tokens == hooked.tokens and engine.seq == seq_hooked


def test_cancel_on_the_last_step_is_not_a_cancel(engine):
    engine.reset()
    r = engine.generate(PROMPT, 5, method="ar", on_step=lambda i: False if i.index == 4 else None)
    assert r.finish_reason == "length" and len(r.tokens) == 5


def test_hook_error_propagates_and_the_engine_stays_usable(engine, reference):
    engine.reset()

    def boom(info: StepInfo) -> None:
        if info.index == 1:
            raise RuntimeError("hook failed")

    g = engine.stream(PROMPT, 24, method="specexec", tree=TreeConfig.fixed(8), on_step=boom)
    with pytest.raises(RuntimeError, match="hook failed"):
        list(g)
    assert g.result is None
    other = [40, 41, 42]
    assert engine.generate(other, 12, method="specexec", tree=TreeConfig.fixed(8)).tokens == reference(other, 12)
