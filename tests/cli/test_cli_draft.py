"""The draft's CLI options end to end on tiny models: ``--draft-vocab`` (FR-Spec head) and ``--draft-dtype int8``.

Each goes from every command's options to ``api.load`` unchanged; a bad value is one ``error:`` line before any
load; a cheaper draft never changes the greedy output.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from specexec.cli import app

runner = CliRunner()
COMMANDS = ("generate", "chat", "bench", "serve")


@pytest.fixture
def loads(monkeypatch) -> list[dict[str, Any]]:
    """Record every ``api.load`` call's keyword arguments and the engine it returned."""
    import specexec.api

    real = specexec.api.load
    seen: list[dict[str, Any]] = []

    def spy(*args: Any, **kw: Any) -> Any:
        engine = real(*args, **kw)
        seen.append({"kw": kw, "engine": engine})
        return engine

    monkeypatch.setattr(specexec.api, "load", spy)
    return seen


@pytest.fixture
def no_load(monkeypatch):
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was resolved or loaded before the options were validated")

    import specexec.api
    import specexec.loading.hub

    monkeypatch.setattr(specexec.api, "load", forbidden)
    monkeypatch.setattr(specexec.loading.hub, "resolve", forbidden)


def _cmd(command: str, *args: str) -> list[str]:
    cmd = [command, "--target", "/nonexistent/model-dir", "--device", "cpu", "-q", *args]
    return cmd + (["-p", "t10 t11"] if command == "generate" else [])


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("value", ["100", "1023", "-1", "lots", "1e4", ""])
def test_bad_draft_vocab_refused_before_loading(no_load, command, value):
    r = runner.invoke(app, _cmd(command, "--draft-vocab", value))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert len(lines) == 1 and lines[0].startswith("error: --draft-vocab must be an integer >= 1024"), lines


@pytest.mark.parametrize("command", COMMANDS)
def test_draft_vocab_in_help(command):
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert r.exit_code == 0 and "--draft-vocab" in r.output and "--draft-dtype" in r.output


def test_help_states_the_library_default():
    """--draft-vocab's help names the size api.load picks by default (the option passes None: the library decides)."""
    from specexec.loading.checkpoint import DEFAULT_DRAFT_VOCAB

    r = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    text = " ".join(r.output.replace("│", " ").split())  # the help's wrapped lines, joined
    assert f"Default: on a CPU {DEFAULT_DRAFT_VOCAB} for a draft whose vocabulary is over twice that" in text


@pytest.mark.parametrize("default, restricted", [(32, True), (48, False)])
def test_load_restricts_a_large_draft_vocabulary_by_default_on_a_cpu(tiny_pair, monkeypatch, default, restricted):
    """draft_vocab=None on a CPU: a frequency-ranked head of the default size for a draft whose vocabulary is over
    twice that default (the tiny draft's 96 ids against 32), the whole head otherwise (96 against 48)."""
    from specexec import api
    from specexec.formats.subset import SubsetHead

    monkeypatch.setattr(api, "DEFAULT_DRAFT_VOCAB", default)
    engine = api.load(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", dtype="fp32", context=64, progress=False)
    head = engine.draft.globals.lm_head
    assert isinstance(head, SubsetHead) == restricted, type(head)
    if restricted:
        assert len(head.ids) < 96


@pytest.mark.parametrize(
    "value, want", [(None, None), ("full", 0), ("FULL", 0), ("0", 0), ("1024", 1024), (" 32768 ", 32768)]
)
def test_draft_vocab_values(value, want):
    from specexec.cli.options import draft_vocab_size

    assert draft_vocab_size(value) == want


def _generate(pair, *args: str) -> Any:
    target, draft = pair
    cmd = ["generate", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--dtype", "fp32"]
    return runner.invoke(app, [*cmd, "-p", "t10 t11 t12", "-n", "12", "--json", "--temperature", "0", *args])


def test_draft_vocab_and_int8_end_to_end(tiny_pair, loads):
    """--draft-dtype int8 --draft-vocab N reaches api.load, loads an int8 draft with a subset head, and generates
    exactly the target's greedy tokens (the same as --method ar)."""
    from specexec.formats.int8 import Int8Linear
    from specexec.formats.subset import SubsetHead

    ref = _generate(tiny_pair, "--method", "ar")
    assert ref.exit_code == 0, ref.output
    want = json.loads(ref.stdout)["tokens"]
    assert len(want) == 12
    for args, vocab, int8 in (
        (("--draft-dtype", "int8"), None, True),
        (("--draft-vocab", "1024"), 1024, False),
        (("--draft-vocab", "full"), 0, False),
        (("--draft-dtype", "int8", "--draft-vocab", "2048"), 2048, True),
    ):
        loads.clear()
        for method in ("specexec", "chain"):
            r = _generate(tiny_pair, *args, "--method", method, "--budget", "8")
            assert r.exit_code == 0, (args, r.output)
            assert json.loads(r.stdout)["tokens"] == want, (args, method)
        kw, engine = loads[0]["kw"], loads[0]["engine"]
        assert kw.get("draft_vocab") == vocab, (args, kw)
        head = engine.draft.globals.lm_head
        assert isinstance(head, SubsetHead) == bool(vocab), (args, type(head))
        weight = head.weight if isinstance(head, SubsetHead) else head
        assert isinstance(weight, Int8Linear) == int8, (args, type(weight))
        layer = engine.draft.layers.layer(0)
        assert any(isinstance(w, Int8Linear) for w in layer.values()) == int8, args


def test_draft_vocab_without_a_draft_is_a_notice(tiny_pair):
    target, _ = tiny_pair
    cmd = ["generate", "--target", str(target), "--draft", "none", "--device", "cpu", "-p", "t10", "-n", "2"]
    r = runner.invoke(app, [*cmd, "--draft-vocab", "4096"])
    assert r.exit_code == 0, r.output
    assert "note: --draft-vocab 4096 has no effect without a draft model" in r.stderr
