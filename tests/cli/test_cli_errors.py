"""Every error a user can cause ends in one clear ``error: ...`` line and a non-zero exit, never a traceback.

Driven in-process through Typer's CliRunner on tiny models built here (generate and chat share the loaders).
A bug is not a user error: it says "internal error" (the traceback under -v).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specexec.cli import app
from tests.conftest import make_tiny
from tests.test_chat import make_chat_pair

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Good and broken model directories."""
    root = tmp_path_factory.mktemp("cli")
    target, draft = make_chat_pair(root / "pair")
    other = make_tiny(root / "other-vocab", "llama", vocab=80, seed=3)  # a different tokenizer
    corrupt = shutil.copytree(target, root / "corrupt")
    f = corrupt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    pickled = root / "pickle-only"
    pickled.mkdir()
    shutil.copy(target / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x02not really a pickle")
    alien = shutil.copytree(target, root / "unsupported-architecture")
    (alien / "config.json").write_text(
        json.dumps({**json.loads((target / "config.json").read_text()), "model_type": "gpt2"})
    )
    huge = shutil.copytree(target, root / "huge-context")  # lets --context reach petabytes of KV cache
    cfg = json.loads((huge / "config.json").read_text())
    cfg["max_position_embeddings"] = 10**13
    (huge / "config.json").write_text(json.dumps(cfg))
    return {"target": target, "draft": draft, "other": other, "corrupt": corrupt, "pickled": pickled, "huge": huge,
            "alien": alien}  # fmt: skip


def _one_error_line(result, pattern: str) -> None:
    """Exit non-zero with exactly one stderr line ``error: ...`` matching ``pattern`` and no traceback."""
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and pattern.lower() in lines[0].lower(), lines[0]


def _generate(
    m: dict[str, Path],
    *args: str,
    target: str = "target",
    draft: str | None = "draft",
    prompt: str = "t10 t11",
    stdin: bytes | None = None,
):
    cmd = ["generate", "--target", str(m.get(target, target)), "--device", "cpu", "-q", "-p", prompt, *args]
    if draft:
        cmd += ["--draft", str(m.get(draft, draft))]
    return runner.invoke(app, cmd, input=stdin)


def _chat(m: dict[str, Path], *args: str, target: str = "target", draft: str | None = "draft", stdin: bytes = b""):
    cmd = ["chat", "--target", str(m.get(target, target)), "--device", "cpu", "-q", "--max-new-tokens", "8", *args]
    cmd += ["--draft", str(m.get(draft, draft)) if draft else "none"]
    return runner.invoke(app, cmd, input=stdin)


CASES = {
    "missing model path": (dict(target="/nonexistent/model-dir"), "model path not found"),
    "unknown alias": (dict(target="no-such-alias-7b"), "unknown model alias"),
    "tokenizer mismatch": (dict(draft="other"), "different tokenizers"),
    "corrupt weights": (dict(target="corrupt", draft=None), "corrupt"),
    "pickle-only directory": (dict(target="pickled", draft=None), "refusing to load pickle"),
    "unsupported architecture": (dict(target="alien", draft=None), "unsupported model_type 'gpt2'"),
    "budget zero": (dict(args=("--budget", "0")), "budget must be >= 1"),
    "budget absurd": (dict(args=("--budget", "70000")), "absurdly large"),
}


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("case", list(CASES))
def test_load_and_option_errors(models, command, case):
    kw, pattern = CASES[case]
    kw = dict(kw)
    args = kw.pop("args", ())
    run = _generate if command == "generate" else _chat
    _one_error_line(run(models, *args, **kw), pattern)


def test_generate_max_new_tokens_beyond_context(models):
    _one_error_line(_generate(models, "--context", "64", "-n", "100"), "exceeds the context")


def test_generate_prompt_longer_than_context(models):
    _one_error_line(_generate(models, "--context", "64", "-n", "4", prompt=" ".join(["t9"] * 80)), "context holds 64")


def test_generate_non_utf8_stdin(models):
    _one_error_line(_generate(models, prompt="-", stdin=b"t10 \xff\xfe t11"), "not valid UTF-8")


def test_chat_max_new_tokens_beyond_context(models):
    _one_error_line(_chat(models, "--context", "64", "--max-new-tokens", "100"), "max-new-tokens")


def test_chat_message_too_long_then_goes_on(models):
    """A message longer than the context: one error line for it, the session answers the next one."""
    stdin = (" ".join(["t9"] * 80) + "\nt10 t11\n").encode()
    result = _chat(models, "--context", "64", stdin=stdin)
    assert result.exit_code == 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "message too long" in errors[0]
    assert result.stdout.count(">>> ") == 3 and result.stdout.count(" t") >= 8  # the second message was answered


def test_chat_non_utf8_input_then_goes_on(models):
    result = _chat(models, stdin=b"t10 \xff\xfe\nt11\n/quit\n")
    assert result.exit_code == 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not valid UTF-8" in errors[0]
    assert "Traceback" not in result.output


def test_chat_unknown_method(models):
    _one_error_line(_chat(models, "--method", "beam"), "unknown --method")


def test_chat_method_needs_a_draft(models):
    _one_error_line(_chat(models, "--method", "specexec", draft=None), "needs a draft")


def test_chat_not_enough_memory(models):
    """A context whose KV caches exceed the RAM is refused from config.json, before anything is allocated."""
    _one_error_line(_chat(models, "--context", str(10**12), target="huge", draft=None), "not enough RAM")


def test_generate_not_enough_memory(models):
    _one_error_line(_generate(models, "--context", str(10**12), target="huge", draft=None), "not enough RAM")


def test_check_load_estimate(models):
    """The estimate matches what a loaded engine really allocates (KV caches, within a few slots)."""
    import torch

    from specexec.api import load
    from specexec.config import ChainConfig, TreeConfig
    from specexec.loading.memory import check_load

    tree = TreeConfig.fixed(16)
    need = check_load(models["target"], models["draft"], torch.device("cpu"), "auto", None, 300, tree, ChainConfig())
    engine = load(str(models["target"]), str(models["draft"]), device="cpu", context=300, tree=tree, progress=False)
    real = engine.target_cache.nbytes() + engine.draft_model.cache.nbytes()
    assert abs(need.kv - real) <= 0.01 * real


# ---------------------------------------------------------------------------------------------- no model needed


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if anything tries to resolve or load a model: these errors must come before any load."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was resolved or loaded before the options were validated")

    import specexec.api
    import specexec.loading.hub

    monkeypatch.setattr(specexec.api, "load", forbidden)
    monkeypatch.setattr(specexec.loading.hub, "resolve", forbidden)


def _run(command: str, *args: str, prompt: str | None = "t10 t11"):
    """``command`` with a target that does not exist (a load would fail differently) and the given options."""
    cmd = [command, "--target", "/nonexistent/model-dir", "--device", "cpu", "-q", *args]
    if command == "generate" and prompt is not None:
        cmd += ["-p", prompt]
    return runner.invoke(app, cmd)


BEFORE_LOAD = {
    "max-new-tokens 0": (("-n", "0"), "--max-new-tokens must be >= 1, got 0"),
    "max-new-tokens -1": (("-n", "-1"), "--max-new-tokens must be >= 1, got -1"),
    "max-new-tokens > context": (("-n", "100", "--context", "64"), "--max-new-tokens 100 exceeds the context"),
    "temperature nan": (("--temperature", "nan"), "--temperature must be a finite number, got nan"),
    "temperature inf": (("--temperature", "inf"), "--temperature must be a finite number, got inf"),
    "temperature -1": (("--temperature", "-1"), "--temperature must be >= 0"),
    "top-p nan": (("--top-p", "nan"), "--top-p must be a finite number"),
    "top-p -inf": (("--top-p", "-inf"), "--top-p must be a finite number"),
    "min-p inf": (("--min-p", "inf"), "--min-p must be a finite number"),
    "top-k -1": (("--top-k", "-1"), "--top-k must be >= 0"),
    "gpu-memory nan": (("--gpu-memory", "nan"), "--gpu-memory must be a finite number"),
    "gpu-memory inf": (("--gpu-memory", "inf"), "--gpu-memory must be a finite number"),
    "gpu-memory 0": (("--gpu-memory", "0"), "--gpu-memory must be > 0"),
    "offload disk": (("--offload", "disk"), "--offload must be one of"),
    "target-dtype int4": (("--target-dtype", "int4"), "--target-dtype must be one of"),
    "budget word": (("--budget", "lots"), "--budget must be a positive integer or 'auto'"),
    "budget 0": (("--budget", "0"), "--budget must be >= 1"),
    "max-budget 0": (("--max-budget", "0"), "--max-budget must be >= 1"),
    "max-beams 0": (("--max-beams", "0"), "--max-beams must be >= 1"),
    "ngram-nodes -1": (("--ngram-nodes", "-1"), "--ngram-nodes must be in 0..1024"),
    "ngram-nodes word": (("--ngram-nodes", "many"), "--ngram-nodes must be in 0..1024 or auto"),
    "gamma 0": (("--gamma", "0"), "--gamma must be in 1..256"),
    "context 4": (("--context", "4", "-n", "2"), "--context must be >= 8 tokens"),
    "unknown method": (("--method", "beam"), "unknown --method 'beam'"),
    "method needs a draft": (
        ("--method", "chain", "--draft", "none"),
        "--method chain needs a draft model: pass --draft",
    ),
}


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("case", list(BEFORE_LOAD))
def test_checked_before_loading(no_load, command, case):
    """Bad options give one line naming the flag, without a model load (the target does not even exist)."""
    args, pattern = BEFORE_LOAD[case]
    result = _run(command, *args)
    _one_error_line(result, pattern)
    assert result.exit_code == 2


@pytest.mark.parametrize(
    "value, pattern",
    [("-1", "--prefix-cache-gb must be >= 0 (0: no prefix cache), got -1"), ("nan", "must be a finite number")],
)
def test_serve_prefix_cache_checked_before_loading(no_load, value, pattern):
    result = _run("serve", "--prefix-cache-gb", value)
    _one_error_line(result, pattern)
    assert result.exit_code == 2


@pytest.mark.parametrize(
    "args, pattern",
    [
        (("--num-prompts", "0"), "--num-prompts must be >= 1, got 0"),
        (("--temperature", "nan"), "--temperature must be a finite number"),
        (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
        (("--methods", "ar,beam"), "unknown method(s) beam in --methods; choose from ar, chain, specexec"),
        (("--budgets", "16,x"), "--budgets must be comma-separated integers"),
        (("--budgets", "0"), "--budget must be >= 1"),
        (("--gpu-memory", "inf"), "--gpu-memory must be a finite number"),
    ],
)
def test_bench_checked_before_loading(no_load, args, pattern):
    result = _run("bench", *args)
    _one_error_line(result, pattern)


@pytest.mark.parametrize(
    "prompt, pattern",
    [
        ("", "the prompt is empty"),
        ("t10 \udcff t11", "the --prompt argument is not valid UTF-8"),
    ],
)
def test_generate_bad_prompt_before_loading(no_load, prompt, pattern):
    _one_error_line(_run("generate", prompt=prompt), pattern)


def test_generate_samples_before_loading(no_load):
    _one_error_line(_run("generate", "--samples", "0"), "--samples must be >= 1, got 0")


def test_generate_non_utf8_argv_subprocess(tmp_path):
    """Bytes that are not UTF-8 in argv (as a shell passes them): one error line, exit 2, before any load."""
    code = "import sys; from specexec.cli import main; sys.argv[0] = 'specexec'; main()"
    argv = [
        sys.executable,
        "-c",
        code,
        "generate",
        "--target",
        str(tmp_path / "missing"),
        "--device",
        "cpu",
        "-q",
        "-p",
        os.fsdecode(b"t10 \xff\xfe t11"),
    ]
    proc = subprocess.run(argv, capture_output=True, timeout=300, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines == ["error: the --prompt argument is not valid UTF-8 (character 4)"], lines


# ---------------------------------------------------------------------------------------------- bugs are bugs


def _boom(*args, **kwargs):
    raise ValueError("boom: a bug, not the user's fault")


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_internal_error_is_one_line_pointing_to_verbose(monkeypatch, command):
    """A plain ValueError from inside the library is a bug: not shown as a user error, exit 1, a pointer to -v."""
    import specexec.loading.hub

    monkeypatch.setattr(specexec.loading.hub, "resolve", _boom)
    result = _run(command)
    _one_error_line(result, "internal error (ValueError: boom: a bug, not the user's fault)")
    assert "run again with -v" in result.stderr and result.exit_code == 1


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_internal_error_with_verbose_raises(monkeypatch, command):
    """With -v the bug propagates: Python prints the whole traceback."""
    import specexec.loading.hub

    monkeypatch.setattr(specexec.loading.hub, "resolve", _boom)
    result = _run(command, "-v")
    assert isinstance(result.exception, ValueError) and "boom" in str(result.exception)
    assert "error: internal error" not in result.stderr


def test_internal_error_traceback_subprocess(tmp_path):
    """End to end: -v shows the traceback of a bug, without -v one line (a bug is simulated by a sitecustomize)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import specexec.loading.hub\ndef _boom(*a, **k):\n    raise ValueError('boom')\n"
        "specexec.loading.hub.resolve = _boom\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    base = [
        sys.executable,
        "-c",
        "from specexec.cli import main; main()",
        "generate",
        "--device",
        "cpu",
        "-q",
        "-p",
        "hi",
        "--draft",
        "none",
    ]
    quiet = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env)
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
    assert quiet.stderr.strip().splitlines() == [
        "error: internal error (ValueError: boom); this is a bug in specexec: run again with -v for the traceback "
        "and report it"
    ]
    loud = subprocess.run(base + ["-v"], capture_output=True, text=True, timeout=300, env=env)
    assert loud.returncode == 1 and "Traceback (most recent call last)" in loud.stderr
    assert "ValueError: boom" in loud.stderr


# ---------------------------------------------------------------------------------------------- messages


def test_library_errors_render_with_cli_flags():
    """Core errors name settings in library terms; the CLI shows the same error with its flags."""
    from offload import OffloadConfig
    from specexec.cli.common import user_message
    from specexec.errors import ConfigError, SpecexecError, setting

    e = SpecexecError(f"lower {setting('context')} or use {setting('OffloadConfig.mode', 'ssd')}")
    assert str(e) == "lower context or use OffloadConfig.mode=ssd"
    assert user_message(e) == "lower --context or use --offload ssd"
    with pytest.raises(ConfigError) as info:
        OffloadConfig(gpu_memory_gb=-1)
    assert isinstance(info.value, ValueError)  # library users catching ValueError still work
    assert str(info.value) == "OffloadConfig.gpu_memory_gb must be > 0, got -1"
    assert user_message(info.value) == "--gpu-memory must be > 0, got -1"


def test_disk_error_names_cache_dir(monkeypatch, tmp_path):
    """The SSD tier's "not enough disk" error points at --cache-dir (there is no --ssd-dir)."""
    from offload import OffloadConfig
    from offload import plan as plan_mod
    from specexec.cli.common import user_message
    from specexec.errors import OutOfMemory
    from tests.offload.test_offload import _fake_ram, _plan

    _fake_ram(monkeypatch, available_gb=40)
    monkeypatch.setattr(plan_mod, "_free_disk", lambda p: int(50e9))
    with pytest.raises(OutOfMemory) as info:
        _plan(OffloadConfig(mode="ssd", target_dtype="bf16", cache_dir=tmp_path))
    assert info.value.resource == "disk" and info.value.have == int(50e9)
    assert (
        "point the cache (--cache-dir, or the SPECEXEC_HOME environment variable) at a disk with more space"
        in user_message(info.value)
    )


def test_every_flag_a_message_names_exists():
    """Library errors name settings through FLAGS; every flag there is an option of some command."""
    from specexec.cli.options import FLAGS

    help_text = "".join(
        runner.invoke(app, [c, "--help"], env={"COLUMNS": "200"}).output
        for c in ("generate", "chat", "bench", "serve", "doctor")
    )
    missing = {flag for flag in FLAGS.values() if flag not in help_text}
    assert not missing, missing


def test_same_default_draft_for_generate_chat_bench(monkeypatch):
    """With the demo target and no --draft every command loads the demo draft; --draft none loads none."""
    import specexec.api
    from specexec.cli.options import DEMO_DRAFT, DEMO_TARGET
    from specexec.errors import SpecexecError

    seen = []

    def capture(model, tree, progress=True, status=None):
        seen.append(model.draft)
        raise SpecexecError("stop here")

    monkeypatch.setattr(specexec.api, "load_engine", capture)
    for command in ("generate", "chat", "bench"):
        for draft_args, want in (((), DEMO_DRAFT), (("--draft", "none"), None), (("--draft", "x"), "x")):
            seen.clear()
            cmd = [command, "--target", DEMO_TARGET, "--device", "cpu", "-q", *draft_args]
            if command == "generate":
                cmd += ["-p", "hi"]
            result = runner.invoke(app, cmd)
            assert result.exit_code == 2 and "stop here" in result.stderr, (command, result.output)
            assert seen == [want], (command, draft_args, seen)
    for command in ("generate", "chat"):  # --method ar needs no draft: the default one is not loaded
        seen.clear()
        cmd = [command, "--target", DEMO_TARGET, "--device", "cpu", "-q", "--method", "ar"]
        runner.invoke(app, cmd + (["-p", "hi"] if command == "generate" else []))
        assert seen == [None], (command, seen)


# ---------------------------------------------------------------------------------------------- notices


def test_notices_gpu_memory_on_cpu_and_capped_context(models):
    """--gpu-memory on a CPU and a --context beyond the model's maximum: one note each, then it runs."""
    max_ctx = json.loads((models["target"] / "config.json").read_text())["max_position_embeddings"]
    result = _generate(models, "--gpu-memory", "4", "--context", str(max_ctx * 100), "-n", "4")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: --gpu-memory 4 has no effect on the CPU (the model is held in RAM)",
        f"note: --context {max_ctx * 100} is more than the model supports; using {max_ctx} tokens",
    ]
    assert not [line for line in result.stderr.splitlines() if line.startswith("error")]


def test_generate_stats_line_shows_the_cost_measurement(models, monkeypatch, tmp_path):
    """Not quiet: the stats line on stderr includes the auto budget's one-time cost measurement (the cost-model policy a
    GPU uses; a CPU's measured policy needs none)."""
    from specexec.decoding.engine import Engine

    monkeypatch.setattr(Engine, "_measured_policy", lambda self: False)
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))  # no costs cached from an earlier run
    cmd = [
        "generate",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--device",
        "cpu",
        "-p",
        "t10 t11",
        "-n",
        "4",
        "--budget",
        "auto",
        "--max-budget",
        "8",
    ]
    result = runner.invoke(app, cmd)
    assert result.exit_code == 0, result.output
    stats = [line for line in result.stderr.splitlines() if line.startswith("[specexec")]
    assert len(stats) == 1 and ", cost measurement " in stats[0], result.stderr


def test_stats_line_shows_the_cost_measurement_only_when_measured():
    from specexec.cli.generate import stats_line
    from specexec.decoding.engine import Stats

    s = Stats(method="ar").to_json()
    assert "cost measurement" not in stats_line(s)
    s["costs_s"] = 1.5
    assert ", cost measurement 1.50s," in stats_line(s)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--dtype", "int8", "--dtype must be one of"), ("--draft-dtype", "int9", "--draft-dtype must be one of")],
)
def test_bad_dtype_names_refused_before_loading(option, value, message):
    """A dtype name that does not exist is one error line, before any model path is even looked at."""
    r = runner.invoke(app, ["generate", "--target", "/nonexistent/model", "-p", "hi", option, value])
    assert r.exit_code == 2 and message in r.stderr and "not found" not in r.stderr, r.output
    assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
@pytest.mark.parametrize(
    "args, pattern",
    [
        (("--draft-dtype", "q3"), "--draft-dtype must be one of auto, fp32, bf16, fp16, int8, nf4, q4, got 'q3'"),
        (("--draft-dtype", "q2", "--draft", "self"), "--draft-dtype must be one of auto, fp32, bf16, fp16, int8, nf4"),
        (("--draft", "self", "--draft-layers", "0.5"), "no such option: --draft-layers"),
    ],
)
def test_removed_draft_formats_and_partial_drafts_are_refused(no_load, command, args, pattern):
    """Group-wise q3/q2 draft formats and partial self drafts (--draft-layers) are not options: one error line,
    exit 2, before any model is looked at."""
    result = _run(command, *args)
    _one_error_line(result, pattern)
    assert result.exit_code == 2


def test_unknown_options_and_commands_are_one_line():
    """Usage errors Typer finds itself (an unknown option or command, a value of the wrong type) are one line that
    points to the command's --help, exit 2; a bare command group still prints its help."""
    for args, pattern in (
        (["doctor", "--draft", "self", "--draft-layers", "20"], "no such option: --draft-layers"),
        (["generate", "--max-beams", "x", "-p", "hi"], "invalid value for '--max-beams'"),
        (["frobnicate"], "no such command 'frobnicate'; see 'specexec --help'"),
        (["cache", "--bogus"], "no such option: --bogus; see 'specexec cache --help'"),
    ):
        result = runner.invoke(app, args, prog_name="specexec")
        _one_error_line(result, pattern)
        assert result.exit_code == 2
    result = runner.invoke(app, ["models"], prog_name="specexec")
    assert "Usage" in result.output and "error:" not in result.output


def test_notice_when_load_lowered_the_max_budget(capsys):
    """The CLI says when the memory plan lowered --max-budget (Engine.max_tree), and nothing when it did not."""
    from types import SimpleNamespace

    from specexec.cli import options as o

    model = SimpleNamespace(context=256)
    o.notices_after_load(model, SimpleNamespace(context=256, max_tree=None))
    assert capsys.readouterr().err == ""
    o.notices_after_load(model, SimpleNamespace(context=256, max_tree=256))
    assert "--max-budget lowered to 256" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda d: ("--json-schema", str(d / "missing.json")), "missing.json: no such file"),
        (lambda d: ("--json-schema", _write(d / "s.json", "{not json")), "--json-schema: the JSON schema is not valid"),
        (lambda d: ("--json-schema", _write(d / "t.json", '{"type": "bogus"}')), "does not compile: Invalid type"),
        (lambda d: ("--grammar", _write(d / "g.gbnf", "root ::= (")), "--grammar: the grammar does not compile"),
        (lambda d: ("--grammar", _write(d / "g.lark", "start: nowhere")), "--grammar: the grammar does not compile"),
        (lambda d: ("--regex", "(a"), "--regex: the regular expression does not compile"),
        (lambda d: ("--regex", "a", "--grammar", _write(d / "ok.gbnf", 'root ::= "a"')), "cannot be combined"),
        # past what the compiler can take: refused by the limits (decoding.constraint), never a crash or a bug report
        (
            lambda d: ("--json-schema", _write(d / "deep.json", DEEP_SCHEMA)),
            "--json-schema: the JSON schema nests more",
        ),
        (
            lambda d: ("--json-schema", _write(d / "huge.json", HUGE_SCHEMA)),
            "--json-schema: the JSON schema is 6,400,034 bytes",
        ),
        (lambda d: ("--regex", "(a|aa)*a{1000000}"), "--regex: the regular expression repeats a piece 1,000,000"),
        (lambda d: ("--regex", "x" * 70_000), "--regex: the regular expression is 70,000 bytes"),
        (lambda d: ("--grammar", _write(d / "deep.gbnf", "root ::= " + "(" * 3000 + '"a"' + ")" * 3000)), "--grammar"),
        (
            lambda d: ("--grammar", _write(d / "big.lark", "start: " + "|".join(f'"w{i}"' for i in range(60_000)))),
            "--grammar: the grammar is",
        ),
    ],
)
def test_generate_bad_constraint_before_loading(no_load, tmp_path, make, pattern):
    """A constraint that cannot be read or compiled: one line naming its flag, exit 2, before any model load."""
    result = _run("generate", *make(tmp_path))
    _one_error_line(result, pattern)
    assert result.exit_code == 2


DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 1000 + '{"type": "string"}' + "}}" * 1000
HUGE_SCHEMA = json.dumps({"type": "object", "properties": {f"p{i:06}": {"type": "integer"} for i in range(200_000)}})


def test_generate_grammar_failing_part_way_is_one_line(models, monkeypatch):
    """A grammar that fails part-way through the answer (a limit of llguidance's hit at some step; simulated: the
    engine's stream raises as the decode loop does then): the text so far stays printed, then one error line
    naming the flag, exit 2."""
    from specexec.decoding.constraint import ConstraintError
    from specexec.decoding.engine import Engine

    def stream(self, *args, **kwargs):
        yield "t10 t11"
        raise ConstraintError("the regular expression failed part-way through the answer: lexer error: too many")

    monkeypatch.setattr(Engine, "stream", stream)
    result = _generate(models, "--regex", "t1[0-9]( t1[0-9])*", "--context", "512")
    _one_error_line(result, "--regex: the regular expression failed part-way through the answer")
    assert result.exit_code == 2 and result.stdout == "t10 t11\n"


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_generate_constraint_on_an_unreadable_tokenizer(models, tmp_path):
    """The tiny pair's word-level tokenizer cannot spell arbitrary bytes, so no grammar can run over it: one line."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    result = _generate(models, "--json-schema", str(schema), "--context", "512")
    _one_error_line(result, "constrained decoding cannot read this model's tokenizer")
    assert result.exit_code == 2
