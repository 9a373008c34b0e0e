"""The draft's CLI options end to end on tiny models: ``--draft-vocab`` (FR-Spec head), ``--draft-dtype int8`` and
``--draft auto`` (the default: which draft, said in one line; doctor shows the choice).

Each goes from every command's options to ``api.load`` unchanged; a bad value is one ``error:`` line before any
load; a cheaper draft never changes the greedy output. The models "on this machine" that auto scans are what
``hub.list_models`` reports, set per test.
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


# ---------------------------------------------------------------------------------------------- --draft auto


def _draft_lines(r: Any) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("draft:")]


@pytest.fixture
def stop_at_load(monkeypatch) -> list[Any]:
    """api.load_engine records the ModelOptions it gets and stops (one ``error: stop here`` line)."""
    import specexec.api
    from specexec.errors import SpecexecError

    seen: list[Any] = []

    def capture(model: Any, tree: Any, progress: bool = True, status: Any = None) -> Any:
        seen.append(model)
        raise SpecexecError("stop here")

    monkeypatch.setattr(specexec.api, "load_engine", capture)
    return seen


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
@pytest.mark.parametrize("given", [(), ("--draft", "auto"), ("-d", "AUTO")])
def test_auto_picks_the_demo_draft_for_the_demo_target(stop_at_load, command, given):
    """The default (and an explicit auto) picks the demo pair's draft and says so in one line before loading."""
    from specexec.cli.options import DEMO_DRAFT, DEMO_TARGET

    cmd = [command, "--target", DEMO_TARGET, "--device", "cpu", *given]
    r = runner.invoke(app, cmd + (["-p", "hi"] if command == "generate" else []))
    assert r.exit_code == 2 and "stop here" in r.stderr, r.output
    assert [m.draft for m in stop_at_load] == [DEMO_DRAFT]
    lines = _draft_lines(r)
    assert len(lines) == 1 and lines[0].startswith(f"draft: {DEMO_DRAFT} (the known pair 'demo'"), lines


def test_auto_is_silent_when_quiet_and_unused_by_ar(stop_at_load):
    from specexec.cli.options import DEMO_DRAFT, DEMO_TARGET

    r = runner.invoke(app, ["generate", "--target", DEMO_TARGET, "--device", "cpu", "-q", "-p", "hi"])
    assert not _draft_lines(r) and [m.draft for m in stop_at_load] == [DEMO_DRAFT]
    r = runner.invoke(app, ["generate", "--target", DEMO_TARGET, "--device", "cpu", "--method", "ar", "-p", "hi"])
    assert not _draft_lines(r) and stop_at_load[-1].draft is None


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> dict[str, Any]:
    """A tiny llama target and the models "on this machine" around it: a smaller llama with its tokenizer (the
    one auto must pick), a still smaller one, a llama of over half its size, a small mistral and a small llama with
    another tokenizer."""
    from tests.conftest import make_tiny
    from tests.loading.test_pairing import save_tokenizer, symbols

    root = tmp_path_factory.mktemp("family")
    target = make_tiny(root / "target", "llama", seed=21)
    models = {
        "small": make_tiny(root / "small", "llama", seed=21, layers=1, hidden=32),
        "smaller": make_tiny(root / "smaller", "llama", seed=22, layers=1, hidden=16),
        "too-big": make_tiny(root / "too-big", "llama", seed=23, layers=1, hidden=64),
        "mistral": make_tiny(root / "mistral", "mistral", seed=24, layers=1, hidden=32),
        "other-tok": make_tiny(root / "other-tok", "llama", seed=25, layers=1, hidden=32),
    }
    save_tokenizer(models["other-tok"], symbols(96, word="u"))
    return {"target": target, **models}


def _on_this_machine(monkeypatch, rows: dict[str, Any]) -> None:
    """hub.list_models reports these models as present (what a user has in the cache)."""
    from specexec.loading import hub

    listed = [{"alias": k, "source": "test", "path": str(p), "present": True} for k, p in rows.items()]
    monkeypatch.setattr(hub, "list_models", lambda home=None: listed)


def test_auto_picks_the_largest_smaller_model_of_the_family(family, monkeypatch, loads):
    """No known pair: the largest local model of the target's model_type, at most half its size, whose tokenizer
    pairs with the target's; it runs, and the output is the target's greedy decoding."""
    _on_this_machine(monkeypatch, {k: v for k, v in family.items() if k != "target"})
    cmd = ["generate", "--target", str(family["target"]), "--device", "cpu", "--dtype", "fp32", "--json"]
    cmd += ["-p", "t10 t11 t12", "-n", "12", "--budget", "8"]
    r = runner.invoke(app, cmd)
    assert r.exit_code == 0, r.output
    lines = _draft_lines(r)
    assert len(lines) == 1 and lines[0].startswith("draft: small (a llama model on this machine"), lines
    d = loads[-1]["engine"].draft
    assert (d.cfg.hidden_size, d.cfg.num_layers) == (32, 1)  # "small", not "smaller" (16) nor "other-tok"
    got = json.loads(r.stdout)["tokens"]
    ref = runner.invoke(app, [*cmd, "--draft", "none"])
    assert ref.exit_code == 0 and len(got) == 12 and json.loads(ref.stdout)["tokens"] == got


def test_auto_without_a_candidate_decodes_plainly_and_says_so(family, monkeypatch, loads):
    _on_this_machine(monkeypatch, {"too-big": family["too-big"], "mistral": family["mistral"]})
    cmd = ["generate", "--target", str(family["target"]), "--device", "cpu", "-p", "t10", "-n", "2"]
    r = runner.invoke(app, cmd)
    assert r.exit_code == 0, r.output
    lines = _draft_lines(r)
    assert len(lines) == 1 and lines[0].startswith("draft: none (no known pair for"), lines
    assert lines[0].endswith(
        "no smaller llama model with its tokenizer on this machine): plain decoding; name a draft with --draft"
    )
    assert loads[-1]["engine"].draft is None


def test_auto_finding_none_for_a_method_that_needs_a_draft_is_one_error_line(family, monkeypatch, no_load):
    _on_this_machine(monkeypatch, {})
    cmd = ["generate", "--target", str(family["target"]), "--device", "cpu", "-q", "-p", "t10", "--method", "chain"]
    r = runner.invoke(app, cmd)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith("error: --method chain needs a draft model and --draft auto found none (no known pair")
    assert lines[0].endswith("on this machine): pass --draft"), lines


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_draft_from_another_family_is_one_error_line(family, command):
    cmd = [command, "--target", str(family["target"]), "--draft", str(family["other-tok"]), "--device", "cpu"]
    r = runner.invoke(app, cmd + (["-p", "t10"] if command == "generate" else []), input="t10\n")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert len(lines) == 1 and lines[0].startswith("error: draft "), lines
    assert "use different tokenizers: 93 of 96 token ids differ (id 3: 't3' vs 'u3'" in lines[0]


def test_doctor_shows_the_auto_choice(monkeypatch, tmp_path):
    from specexec.cli.options import DEMO_DRAFT, DEMO_TARGET

    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    r = runner.invoke(app, ["doctor", "--json", "--disk-mb", "0", "--target", DEMO_TARGET])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)["recommendation"]
    assert rec["draft_choice"].startswith(f"draft: {DEMO_DRAFT} (the known pair 'demo'") and rec["draft"] is None
    text = runner.invoke(app, ["doctor", "--disk-mb", "0", "-q", "--target", DEMO_TARGET], env={"COLUMNS": "200"})
    assert text.exit_code == 0 and "draft (auto)" in text.stdout and DEMO_DRAFT in text.stdout
    charged = runner.invoke(app, ["doctor", "--json", "--disk-mb", "0", "--target", DEMO_TARGET, "--draft", "auto"])
    assert json.loads(charged.stdout)["recommendation"]["draft"] == DEMO_DRAFT
