"""The draft's CLI options end to end on tiny models: ``--draft-vocab`` (FR-Spec head) and ``--draft-dtype int8``.

Each goes from every command's options to ``api.load`` unchanged; a bad value is one ``error:`` line before any
load; a cheaper draft never changes the greedy output.
"""

from __future__ import annotations

import inspect
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
    """--draft-vocab's default is api.load's (None: the option passes nothing); the help states that default as
    api.load documents it (this fails, as a reminder to update the help, when the library's default changes)."""
    from specexec import api
    from specexec.cli.options import draft_vocab
    from specexec.loading.checkpoint import DEFAULT_DRAFT_VOCAB

    assert inspect.signature(api.load).parameters["draft_vocab"].default is None
    doc = " ".join((api.load.__doc__ or "").split())
    assert f"None: on a CPU {DEFAULT_DRAFT_VOCAB} for a draft whose vocabulary is over twice that" in doc
    assert "else the full vocabulary; 0: the full vocabulary" in doc
    opt = draft_vocab()
    assert opt.default is None
    assert f"Default: on a CPU {DEFAULT_DRAFT_VOCAB} for a draft whose vocabulary is over twice that" in opt.help
    assert "else the whole vocabulary" in opt.help and "0 or 'full': the whole vocabulary" in opt.help


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
        assert kw.get("draft_vocab") == vocab and ("draft_vocab" in kw) == (vocab is not None), (args, kw)
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


def test_overlap_options_end_to_end(tiny_pair, loads):
    """--grow static|ahead --overlap N|auto reach the engine's tree config and keep the target's greedy tokens."""
    from specexec.config import OVERLAP_AUTO

    want = json.loads(_generate(tiny_pair, "--method", "ar").stdout)["tokens"]
    for grow, overlap, level in (("static", "3", 3), ("ahead", "auto", OVERLAP_AUTO)):
        r = _generate(tiny_pair, "--method", "specexec", "--budget", "8", "--grow", grow, "--overlap", overlap)
        assert r.exit_code == 0, (grow, overlap, r.output)
        assert json.loads(r.stdout)["tokens"] == want, (grow, overlap)
        tree = loads[-1]["kw"]["tree"]
        assert tree.overlap == level and tree.reuse and tree.grow == grow
