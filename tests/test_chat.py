"""ChatSession on a tiny model pair: turns, prefix-cache reuse across turns, history, reset, transcripts, the
context window, interruption; and the REPL's pure input helpers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from specexec.chat import ChatSession, GenOptions, InvalidInput, decode_line, format_stats, parse_command, read_message
from specexec.errors import SpecexecError
from tests.conftest import make_noisy_copy, make_tiny

# user / assistant / system turns are "t3 ... t4", "t5 ... t4", "t6 ... t4"; the generation prompt is "t5", so an
# assistant message renders back exactly as generated (like Qwen's and Llama's templates)
STABLE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}t3 {% elif m['role'] == 'assistant' %}t5 {% else %}t6 "
    "{% endif %}{{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"
)


def make_chat_pair(root: Path, seed: int = 5, hidden: int = 64) -> tuple[Path, Path]:
    """A tiny (target, draft) pair with a stable chat template whose target never emits EOS (greedy).

    The target's lm_head row for EOS (id 2) is zero, so its logit is 0 while the best logit is positive: answers
    always run to max-new-tokens, which makes lengths predictable (and Ctrl-C tests possible).
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    target = make_tiny(root / "target", "llama", seed=seed, hidden=hidden)
    f = target / "model.safetensors"
    sd = load_file(f)
    sd["lm_head.weight"][2] = 0
    save_file(sd, f, metadata={"format": "pt"})
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = STABLE_TEMPLATE
    tok.save_pretrained(target)
    draft = make_noisy_copy(target, root / "draft", 0.1)
    return target, draft


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared machine: torch's intra-op threads only contend (one thread is ~40x faster)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_chat_pair(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def engine(pair):
    from specexec.api import load

    return load(str(pair[0]), str(pair[1]), device="cpu", context=256, progress=False)


@pytest.fixture
def session(engine):
    engine.reset()
    return ChatSession(engine, system="t7 t8", options=GenOptions(max_new_tokens=12))


def _answer(session: ChatSession, text: str):
    reply = session.send(text)
    pieces = list(reply)
    assert reply.result is not None
    return reply, "".join(pieces)


def test_two_turns_prefill_only_the_new_turn(session, engine):
    r1, text1 = _answer(session, "t10 t11 t12")
    assert text1 == r1.text == r1.result.text and len(r1.result.tokens) == 12
    assert r1.result.stats.prefill_tokens == r1.prompt_tokens - 1  # a fresh engine: everything but the pending token
    r2, _ = _answer(session, "t20 t21")
    ids1, ids2, answer = r1.generation.ids, r2.generation.ids, r1.result.tokens
    assert ids2[: len(ids1) + len(answer)] == ids1 + answer  # the template renders the answer back verbatim
    new_turn = len(ids2) - len(ids1) - len(answer)  # "t4 t3 t20 t21 t4 t5"
    assert new_turn == 6
    assert r2.result.stats.prefill_tokens == new_turn
    assert session.messages == [
        {"role": "system", "content": "t7 t8"},
        {"role": "user", "content": "t10 t11 t12"},
        {"role": "assistant", "content": text1},
        {"role": "user", "content": "t20 t21"},
        {"role": "assistant", "content": r2.text},
    ]


def test_answers_equal_a_fresh_engine(session, engine):
    """Prefix reuse across turns changes nothing: turn 2 equals a cold generation of the same ids."""
    _answer(session, "t10 t11 t12")
    r2, _ = _answer(session, "t30")
    engine.reset()
    cold = engine.generate(r2.generation.ids, 12, method="ar")
    assert cold.tokens == r2.result.tokens


def test_reset_and_system(session):
    _answer(session, "t10")
    session.reset()
    assert session.messages == [{"role": "system", "content": "t7 t8"}]
    _answer(session, "t11")
    session.set_system("t9")
    assert session.messages == [{"role": "system", "content": "t9"}] and session.turns == []
    session.set_system(None)
    assert session.messages == []


def test_save_transcript(session, tmp_path):
    r1, _ = _answer(session, "t10 t11")
    _answer(session, "t12")
    path = session.save(tmp_path / "chat.json")
    data = json.loads(path.read_text())
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert data["messages"][2]["content"] == r1.text
    assert [a["message"] for a in data["answers"]] == [2, 4]
    stats = data["answers"][0]["stats"]
    assert stats["new_tokens"] == 12 and stats["tokens_per_s"] > 0 and "accepted_hist" in stats
    assert data["settings"]["max_new_tokens"] == 12
    with pytest.raises(SpecexecError, match="cannot save"):
        session.save(tmp_path / "missing-dir" / "chat.json")


def test_context_overflow_drops_oldest_turns(engine, tmp_path):
    engine.reset()
    s = ChatSession(engine, system="t7 t8", options=GenOptions(max_new_tokens=60))  # context 256
    notices = []
    for i in range(6):
        reply, _ = _answer(s, f"t{10 + i} t{20 + i} t{30 + i}")
        notices += reply.notices
        assert reply.prompt_tokens + 60 <= engine.context
    assert any("oldest turn" in n for n in notices)
    assert s.messages[0] == {"role": "system", "content": "t7 t8"}
    assert s.messages[1]["content"] != "t10 t20 t30"  # the first turn left the window...
    data = s.to_json()
    assert data["messages"][1]["content"] == "t10 t20 t30"  # ...but stays in the transcript
    assert data["answers"][0]["in_context"] is False and data["answers"][-1]["in_context"] is True


def test_message_too_long_is_refused_and_session_goes_on(session):
    _answer(session, "t10")
    before = list(session.messages)
    with pytest.raises(SpecexecError, match="message too long"):
        session.send(" ".join(["t40"] * 300))
    assert session.messages == before
    _answer(session, "t11")
    assert len(session.turns) == 2


def test_answer_limited_when_message_is_long(engine):
    engine.reset()
    s = ChatSession(engine, options=GenOptions(max_new_tokens=60))
    reply, _ = _answer(s, " ".join(["t40"] * 220))
    assert any("limited to" in n for n in reply.notices)
    assert reply.prompt_tokens + len(reply.result.tokens) <= engine.context


def test_interrupt_inside_the_engine_keeps_partial_answer(session, engine, monkeypatch):
    """A KeyboardInterrupt raised in the middle of a target pass: partial answer kept, engine still exact."""
    import specexec.decoding.loop as eng

    real, calls = eng.score_tree, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(eng, "score_tree", flaky)
    reply = session.send("t10 t11")
    shown = []
    with pytest.raises(KeyboardInterrupt):
        for piece in reply:
            shown.append(piece)
    monkeypatch.setattr(eng, "score_tree", real)
    assert reply.interrupted and reply.result is None
    assert session.turns[-1].interrupted and session.turns[-1].assistant == "".join(shown) != ""
    assert session.last_stats is None
    r2, _ = _answer(session, "t12")
    engine.reset()
    assert engine.generate(r2.generation.ids, 12, method="ar").tokens == r2.result.tokens
    assert session.to_json()["answers"][0]["interrupted"] is True


def test_interrupt_before_any_text_drops_the_turn(session, monkeypatch):
    import specexec.decoding.loop as eng

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(eng, "score_tree", interrupted)
    reply = session.send("t10")
    with pytest.raises(KeyboardInterrupt):
        list(reply)
    assert session.turns == [] and reply.interrupted


def test_bad_inputs(engine, session):
    with pytest.raises(InvalidInput):
        session.send("t10 \udcff")
    with pytest.raises(SpecexecError, match="empty"):
        session.send("   ")
    with pytest.raises(SpecexecError, match="max_new_tokens=250 leaves no room"):
        ChatSession(engine, options=GenOptions(max_new_tokens=250))
    with pytest.raises(ValueError):
        GenOptions(max_new_tokens=0)


def test_format_stats(session):
    _answer(session, "t10")
    lines = format_stats(session.last_stats)
    assert any("tokens/s" in line for line in lines) and any("#" in line for line in lines)
    st = replace(session.last_stats, ngram_tokens=3)  # the tokens the prompt-lookup branches carried, when any
    assert not any(line.startswith("n-gram") for line in format_stats(replace(st, ngram_tokens=0)))
    assert "n-gram       3 of the" in "\n".join(format_stats(st))


def test_read_message_and_commands():
    def reader(lines):
        it = iter(lines)
        return lambda prompt: next(it)

    assert read_message(reader(["hello"])) == "hello"
    assert read_message(reader(['"""one', "two", 'three"""'])) == "one\ntwo\nthree"
    assert read_message(reader(['"""', "a", "", "b", '"""'])) == "a\n\nb"
    assert read_message(reader(['"""inline"""'])) == "inline"
    with pytest.raises(InvalidInput):
        read_message(reader(["bad \udcff"]))
    assert parse_command("/system be brief ") == ("system", "be brief")
    assert parse_command("/QUIT") == ("quit", "")
    assert parse_command("/ not a command") is None and parse_command("hello") is None
    assert decode_line(b"caf\xc3\xa9\n") == "café"
    with pytest.raises(InvalidInput, match="UTF-8"):
        decode_line(b"\xff\xfe\n")


# ---------------------------------------------------------------------------------------------- a clean stop


def _flag_on_step(monkeypatch, step: int, action):
    """Run ``action()`` inside the target pass of ``step`` (1-based): a Ctrl-C arriving while that step runs."""
    import specexec.decoding.loop as eng

    real, calls = eng.score_tree, []

    def spy(*a, **k):
        calls.append(1)
        if len(calls) == step:
            action()
        return real(*a, **k)

    monkeypatch.setattr(eng, "score_tree", spy)
    return calls


def test_stop_flag_shows_nothing_of_the_step_in_flight(session, engine, monkeypatch):
    import threading

    stop, shown, at_flag = threading.Event(), [], []
    _flag_on_step(monkeypatch, 3, lambda: (at_flag.append(len(shown)), stop.set()))
    reply = session.send("t10 t11")
    for piece in reply.pieces(stop.is_set):
        shown.append(piece)
    assert at_flag and len(shown) == at_flag[0] > 0  # nothing after the flag, though step 3 produced tokens
    assert reply.interrupted and reply.result is None
    turn = session.turns[-1]
    assert turn.interrupted and turn.assistant == "".join(shown)  # the history holds exactly what was shown
    monkeypatch.undo()
    r2, _ = _answer(session, "t12")  # the engine re-syncs and stays exact
    engine.reset()
    assert engine.generate(r2.generation.ids, 12, method="ar").tokens == r2.result.tokens


def test_stop_flag_already_set_drops_the_turn(session):
    reply = session.send("t10")
    assert list(reply.pieces(lambda: True)) == []
    assert reply.interrupted and session.turns == []


def test_cli_ctrl_c_prints_nothing_more_and_history_matches(session, monkeypatch, capsys):
    """A real SIGINT during the 3rd target pass: stdout holds exactly the history's partial answer."""
    import os
    import signal

    from specexec.cli.chat import answer

    before = []  # stdout as it was when Ctrl-C arrived

    def ctrl_c():
        before.append(capsys.readouterr().out)
        os.kill(os.getpid(), signal.SIGINT)

    _flag_on_step(monkeypatch, 3, ctrl_c)
    answer(session, "t10 t11")
    after, err = capsys.readouterr()
    turn = session.turns[-1]
    assert turn.interrupted and turn.assistant
    assert after == "\n"  # not one character of the step in flight
    assert before[0] == turn.assistant  # the history records exactly what was shown
    assert "interrupted: the partial answer stays in the history" in err and "tok/s" not in err


def test_cli_speed_summary_after_each_answer(session, capsys):
    from specexec.cli.chat import answer

    answer(session, "t10")
    out, err = capsys.readouterr()
    stats = session.last_stats
    assert out == session.turns[-1].assistant + "\n"
    summary = [line for line in err.splitlines() if "tok/s" in line]
    assert summary == [f"[12 tokens, {stats.tokens_per_s:.1f} tok/s, {stats.tokens_per_step:.2f} tokens/step]"]
    answer(session, "t11", quiet=True)
    out, err = capsys.readouterr()
    assert out.strip() and "tok/s" not in err


def test_stats_histogram_counts_only_emitted_tokens(engine):
    """A 2-token answer cannot have a step that emitted 5 tokens: the histogram adds up to the answer."""
    from specexec.config import TreeConfig

    engine.reset()
    fixed = TreeConfig(budget=64, auto=False)  # one tree size: no measured (timing-dependent) choice of chains
    s = ChatSession(engine, options=GenOptions(max_new_tokens=2, tree=fixed))
    reply, _ = _answer(s, "t10 t11 t12")
    st = reply.result.stats
    assert st.new_tokens == 2
    assert sum(k * n for k, n in st.accepted_hist.items()) == st.new_tokens
    assert max(st.accepted_hist) <= 2 and sum(st.accepted_hist.values()) == st.steps
    assert any(line.strip().startswith("2 ") for line in format_stats(st))


def test_cli_banner_names_the_drafts_weight_format(engine, capsys):
    """The chat banner says in which format the draft was loaded (--draft-dtype auto may pick int8 or NF4)."""
    from types import SimpleNamespace

    from specexec.cli.chat import _banner

    model = SimpleNamespace(target="t", draft="d")
    engine.draft_weights = "int8"
    _banner(model, engine, None)
    assert "draft d in int8 (specexec)" in capsys.readouterr().err
    engine.draft_weights = None
    _banner(model, engine, None)
    assert "draft d (specexec)" in capsys.readouterr().err
