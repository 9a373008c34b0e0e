"""Every error a user can cause ends in one clear ``error: ...`` line and a non-zero exit, never a traceback.

Driven in-process through Typer's CliRunner on tiny models built here (generate and chat share the loaders).
"""

from __future__ import annotations

import json
import shutil
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
    huge = shutil.copytree(target, root / "huge-context")  # lets --context reach petabytes of KV cache
    cfg = json.loads((huge / "config.json").read_text())
    cfg["max_position_embeddings"] = 10**13
    (huge / "config.json").write_text(json.dumps(cfg))
    return {"target": target, "draft": draft, "other": other, "corrupt": corrupt, "pickled": pickled, "huge": huge}


def _one_error_line(result, pattern: str) -> None:
    """Exit non-zero with exactly one stderr line ``error: ...`` matching ``pattern`` and no traceback."""
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and pattern.lower() in lines[0].lower(), lines[0]


def _generate(m: dict[str, Path], *args: str, target: str = "target", draft: str | None = "draft",
              prompt: str = "t10 t11", stdin: bytes | None = None):
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
    _one_error_line(_generate(models, "--context", "64", "-n", "4", prompt=" ".join(["t9"] * 80)),
                    "context holds 64")


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
    from specexec.memory import check_load

    tree = TreeConfig(budget=16)
    need = check_load(models["target"], models["draft"], torch.device("cpu"), "auto", None, 300, tree, ChainConfig())
    engine = load(str(models["target"]), str(models["draft"]), device="cpu", context=300, tree=tree, progress=False)
    real = engine._t_cache.nbytes() + engine._drafter.cache.nbytes()
    assert abs(need.kv - real) <= 0.01 * real
