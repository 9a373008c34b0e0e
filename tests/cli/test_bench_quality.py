"""``specexec bench --quality FILE``: perplexity, top-1 agreement and KL of the chosen weight format against the dense
fp32 reference, on tiny random models on the CPU."""

from __future__ import annotations

import json
import math
import random
import weakref
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specexec import quality as q
from specexec.cli import app

runner = CliRunner()
CHUNK = 32


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("quality") / "text.txt"
    path.write_text(" ".join(f"t{rng.randint(3, 95)}" for _ in range(200)), encoding="utf-8")
    return path


def quality(target: Path, text: Path, *args: str) -> dict:
    cmd = ["bench", "--quality", str(text), "--target", str(target), "--device", "cpu", "--quality-chunk", str(CHUNK)]
    result = runner.invoke(app, [*cmd, "-q", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_table_shows_the_format_and_the_reference(tiny_pair, text):
    cmd = ["bench", "--quality", str(text), "--target", str(tiny_pair[0]), "--device", "cpu", "-q"]
    result = runner.invoke(app, [*cmd, "--quality-chunk", str(CHUNK), "--target-dtype", "int8"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 2 and "int8" in rows[0] and "fp32 (reference)" in rows[1], result.stdout
    assert "perplexity" in result.stdout and "top-1" in result.stdout


def test_dense_fp32_against_itself_agrees_exactly(tiny_pair, text):
    r = quality(tiny_pair[0], text, "--dtype", "fp32")
    mine, ref = r["rows"]
    assert (mine["format"], ref["format"], ref["reference"]) == ("fp32", "fp32", True)
    assert mine["agreement"] == 1.0 and mine["kl"] == 0.0 and mine["perplexity"] == ref["perplexity"]
    assert 1 < ref["perplexity"] < math.inf
    assert r["chunks"] == 200 // CHUNK and mine["tokens"] == r["chunks"] * (CHUNK - CHUNK // 2)


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_a_low_bit_target_against_the_reference(tiny_pair, text, fmt):
    if fmt == "q4":
        from specexec.formats import q4

        if q4.available() is not None:
            pytest.skip(f"q4: {q4.available()}")
    r = quality(tiny_pair[0], text, "--target-dtype", fmt, "--quality-tokens", "40")
    mine, ref = r["rows"]
    assert mine["format"] == fmt and ref["format"] == "fp32" and not mine["reference"]
    assert r["chunks"] == 3 and mine["tokens"] == ref["tokens"] == 48  # --quality-tokens 40: whole chunks of 16
    assert 0 <= mine["agreement"] <= 1 and mine["kl"] >= 0
    assert all(1 < row["perplexity"] < math.inf and row["seconds"] >= 0 for row in r["rows"])
    assert mine["perplexity"] != ref["perplexity"]  # the weights differ


@pytest.mark.parametrize(
    "make, args, message",
    [
        (None, [], "cannot read the --quality file"),
        ("", [], "is empty"),
        (b"\xff\xfe t5", [], "not valid UTF-8"),
        ("t5 t6 t7 " * 10, [], "fewer than 2 chunks of 32 (--quality-chunk)"),
        ("t5 t6 t7 " * 30, ["--quality-chunk", "4"], "--quality-chunk must be >= 8"),
        ("t5 t6 t7 " * 30, ["--quality-tokens", "0"], "--quality-tokens must be >= 1"),
    ],
)
def test_bad_input_is_one_error_line(tiny_pair, tmp_path, make, args, message):
    path = tmp_path / "text.txt"
    if isinstance(make, bytes):
        path.write_bytes(make)
    elif make is not None:
        path.write_text(make, encoding="utf-8")
    cmd = ["bench", "--quality", str(path), "--target", str(tiny_pair[0]), "--device", "cpu", "-q"]
    result = runner.invoke(app, [*cmd, "--quality-chunk", str(CHUNK), *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "Traceback" not in result.output


def test_one_model_at_a_time_and_chunks_lead_with_the_tokenizers_bos(tiny_pair, tmp_path):
    """The chosen engine is gone before the reference loads; a tokenizer that adds a BOS starts every chunk with it."""
    from specexec.decoding.engine import Engine
    from specexec.loading.checkpoint import load_model, load_tokenizer

    tok = load_tokenizer(tiny_pair[0])
    chunks = q.text_chunks(tok.tokenizer, " ".join(f"t{3 + i % 90}" for i in range(100)), 16, 1000)
    assert len(chunks) == 6 and all(len(c) == 16 for c in chunks) and chunks[1][0] == 19  # t19
    alive: list[weakref.ref] = []

    def load() -> Engine:
        engine = Engine(load_model(tiny_pair[0], torch.device("cpu"), torch.float32), tok, context=16)
        alive.append(weakref.ref(engine))
        return engine

    def reference(device: torch.device) -> Engine:
        assert device.type == "cpu" and alive[0]() is None  # freed before this load
        return load()

    report = q.compare(load, reference, chunks, workdir=tmp_path)
    assert report.rows[0].agreement == 1.0 and report.rows[0].kl == 0.0 and report.chunks == 6
    assert list(tmp_path.iterdir()) == []  # the temporary log-prob file is gone

    class WithBos:  # the tiny tokenizer with a BOS in front of every text, as Llama's adds one
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
            ids = tok.tokenizer(text, add_special_tokens=False)["input_ids"]
            return {"input_ids": [1, *ids] if add_special_tokens else ids}

    with_bos = q.text_chunks(WithBos(), " ".join(f"t{3 + i % 90}" for i in range(100)), 16, 1000)
    assert len(with_bos) == 6 and all(c[0] == 1 and len(c) == 16 for c in with_bos)
    assert with_bos[1][1:] == [t for c in chunks for t in c][15:30]  # 15 text tokens a chunk after the BOS


def test_speed_bench_json_is_one_object(tiny_pair):
    cmd = ["bench", "--target", str(tiny_pair[0]), "--draft", "none", "--methods", "ar", "--device", "cpu"]
    result = runner.invoke(app, [*cmd, "--num-prompts", "1", "--max-new-tokens", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["method"] for r in report["rows"]] == ["ar"] and report["rows"][0]["new_tokens"] == 2
