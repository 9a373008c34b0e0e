"""Smoke tests of the benchmark scripts in scripts/: each answers --help, refuses bad options with exit code 2, and
runs end to end on tiny random models on the CPU where it can (their numbers mean nothing; the flow, the table and
the JSON fields are what is checked). bench_cpu.py has its own file, tests/test_bench_cpu.py."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py") if p.name != "shapes.py")


def script(name: str) -> Any:
    return importlib.import_module(f"scripts.{name}")


def test_the_scripts_are_the_kept_ones():
    assert SCRIPTS == [
        "bench_before_after.py",
        "bench_cpu.py",
        "bench_gpu.py",
        "bench_offload.py",
        "bench_structured.py",
        "check_exact.py",
    ]


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_run_from_a_checkout_answers_help(name):
    r = subprocess.run([sys.executable, f"scripts/{name}", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage:") and "--out" in r.stdout


def run_gpu_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "gpu.json"
    argv = ["--smoke", "--settings", "70b-nf4@24", "--prompts", "1", "--prompt-tokens", "40", "--new-tokens", "12"]
    rc = script("bench_gpu").main([*argv, "--ar-tokens", "4", "--budgets", "8", "--out", str(out), *extra])
    return rc, json.loads(out.read_text()), capsys.readouterr().out


def test_bench_gpu_smoke_measures_runs_against_our_ar_the_pcie_limit_and_accelerate(tmp_path, capsys):
    """A --smoke run on the CPU: our AR without a draft, a fixed budget per growth mode and the automatic budget,
    every target layer streamed, every run's text the target's greedy one; echo prompts are carried by the n-gram
    branches; the table prints the ratios; the PCIe4 and 80-layer accelerate figures are named projections."""
    rc, rep, printed = run_gpu_smoke(tmp_path, capsys, "--grows", "auto,captured", "--echo")
    assert rc == 0
    (setting,) = rep["settings"]
    runs = {r["run"]: r for r in setting["runs"]}
    assert list(runs) == ["ar (no draft)", "specexec 8", "specexec 8 captured", "auto"]
    assert setting["placement"]["resident_layers"] == 0 and setting["placement"]["streamed_layers"] == 4
    assert setting["echo_prompts"] is True
    for r in runs.values():
        assert r["exact"] and r["tokens"] > 0 and r["step_s"] > 0, r
        assert r["speedup_vs_ar"] > 0 and r["copy_floor_s"] > 0 and r["pcie_limit_tok_s"] > 0
        assert 0 < r["of_pcie_limit"] and r["projected_pcie4_tok_s"] > 0 and "pcie4_tok_s" not in r
    assert runs["ar (no draft)"]["speedup_vs_ar"] == 1.0 and runs["ar (no draft)"]["tok_per_step"] == 1.0
    assert runs["specexec 8 captured"]["grow"] == "captured" and runs["auto"]["budgets"]
    assert runs["specexec 8"]["ngram_tokens"] > 0  # the echo prompts repeat their continuation
    acc = rep["accelerate"]
    assert acc["accelerate_tok_s"] > 0 and acc["ours_ar_tok_s"] > 0 and acc["layers"] == 4
    assert acc["projected_accelerate_80_layer_tok_s"] > 0 and "ours_best_70b_nf4_over_projected_accelerate" in acc
    for column in ("| tok/s |", "| × our AR |", "| step/verify |", "| PCIe limit tok/s |", "PCIe4 tok/s (projected)"):
        assert column in printed
    assert "| 70b-nf4@24 | auto |" in printed and "accelerate at 80 layers (projected)" in printed


@pytest.mark.parametrize(
    "bad",
    [
        ["--settings", "70b-nf4@24,nope"],
        ["--grows", "static"],
        ["--budgets", "x"],
        ["--budgets", "0"],
        ["--echo", "--prompt-tokens", "20"],
        ["--ngram-nodes", "-1"],
        ["--warmup-tokens", "0"],
    ],
)
def test_bench_gpu_refuses_bad_options_with_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        script("bench_gpu").main(["--smoke", *bad])
    assert e.value.code == 2


@pytest.mark.parametrize("bad", [["--formats", "fp8"], ["--tokens", "1,x"], ["--repeats", "0"]])
def test_bench_offload_refuses_bad_options_with_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        script("bench_offload").main(bad)
    assert e.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_bench_offload_without_a_gpu_exits_1_with_one_line(capsys):
    assert script("bench_offload").main(["--baseline-layers", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: bench_offload.py needs a CUDA GPU") and err.count("\n") == 1


def test_bench_offload_efficiency_is_one_at_the_copy_floor():
    mod = script("bench_offload")
    assert mod.efficiency(55e9, 55.0, 1.0) == pytest.approx(1.0)
    assert mod.efficiency(55e9, 55.0, 2.0) == pytest.approx(0.5)
    assert mod.layers_that_fit(10**9, 200 * 10**9, 500) == 180  # 10% of the RAM kept free
    assert mod.layers_that_fit(2 * 10**9, 12 * 10**9, 80) == 1  # and at least 10 GB
    assert mod.layers_that_fit(10**9, 200 * 10**9, 80) == 80


def test_bench_before_after_compares_tokens_and_speed_across_revisions(tiny_pair, tmp_path, capsys):
    """HEAD's and this checkout's `specexec bench` on the same tiny pair, each in its own process: every token equal
    across revisions and to each run's AR; one row per config with both revisions' speeds; exit 0."""
    target, draft = tiny_pair
    out = tmp_path / "ba.json"
    bench = ["--target", str(target), "--draft", str(draft), "--methods", "ar,chain,specexec", "--budgets", "4"]
    bench += ["--gammas", "2", "--num-prompts", "1", "-n", "4", "--context", "256"]
    rc = script("bench_before_after").main(["--order", "AB", "--out", str(out), "--", *bench])
    report = json.loads(out.read_text())
    assert rc == 0 and report["before"] == "HEAD" and report["mismatches"] == []
    assert {r["config"] for r in report["rows"]} == {"ar", "chain 2", "specexec 4"}
    assert report["token_comparisons"] == 2 * 3 * 2  # 2 revisions x 3 configs x (vs the first run, vs its own AR)
    assert report["cross_revision_runs"] == 3
    assert all(r["before_tok_s"] and r["after_tok_s"] and r["after_over_before"] for r in report["rows"])
    printed = capsys.readouterr().out
    assert "| config | before tok/s | after tok/s | after / before |" in printed and "mismatches: 0" in printed


def test_bench_before_after_unknown_revision_is_one_line_and_exit_2(capsys):
    assert script("bench_before_after").main(["--before", "no-such-rev-0000", "--", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --before no-such-rev-0000: no such commit") and "Traceback" not in err


def test_check_exact_smoke_checks_every_token_against_the_target(tiny_pair, capsys, monkeypatch):
    """check_exact.py on tiny models: every set's row, every token the target's greedy choice, AR and a repeat equal;
    a draft-only corruption of the check (a wrong token) is reported and exits 1."""
    target, draft = tiny_pair
    mod = script("check_exact")
    argv = ["--smoke", "--target", str(target), "--draft", str(draft), "--repeat", "--ar", "1"]
    assert mod.main(argv) == 0
    out = capsys.readouterr().out
    for name in ("code", "prose", "grounded"):
        assert f"| {name} | 1 | 8 | 0 | 1/1 | 1/1 |" in out
    real = mod.greedy_mismatches
    monkeypatch.setattr(mod, "greedy_mismatches", lambda e, ids, toks: real(e, ids, [(toks[0] + 1) % 90, *toks[1:]]))
    assert mod.main(argv) == 1


@pytest.fixture(scope="module")
def json_tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target whose byte-level tokenizer the grammar engine can read (with a chat template), and a noisy copy
    of it as its draft (the word-level tokenizer of conftest's tiny models cannot carry a grammar)."""
    from transformers import AutoTokenizer

    from tests.conftest import make_noisy_copy, make_tiny
    from tests.decoding.test_constraint import VOCAB, json_tokenizer

    root = tmp_path_factory.mktemp("json-pair")
    target = make_tiny(root / "target", "llama", vocab=VOCAB, seed=3)
    json_tokenizer(target)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    tok.save_pretrained(target)
    return target, make_noisy_copy(target, root / "draft", 0.1)


def test_bench_structured_smoke_times_four_configs_checks_exactness_and_validity(json_tiny_pair, tmp_path, capsys):
    """bench_structured.py on the JSON-capable tiny pair: every configuration on every prompt in a rotating order,
    the default's tokens equal AR's (schema and free), the overall and per-prompt tables with the ratios, the
    warm-up reported apart; exit 0."""
    target, draft = json_tiny_pair
    out, md = tmp_path / "structured.json", tmp_path / "structured.md"
    argv = ["--smoke", "--quiet", "--target", str(target), "--draft", str(draft), "--dtype", "fp32"]
    argv += ["--prompts", "2", "--max-new-tokens", "16", "--warmup-tokens", "4", "--context", "512"]
    assert script("bench_structured").main([*argv, "--out", str(out), "--md", str(md)]) == 0
    rep = json.loads(out.read_text())
    m = rep["meta"]
    assert m["smoke"] and m["chat"] and m["schema_name"] == "book" and len(m["prompts"]) == 2
    assert m["warm_up"]["seconds"] > 0 and m["warm_up"]["costs_s"] >= 0 and "partial" not in m
    runs = rep["runs"]
    assert len(runs) == 2 * 4
    names = ["ar-schema", "default-schema", "default-free", "ar-free"]
    for p in ("the novel Dune by Frank Herbert", "Pride and Prejudice by Jane Austen"):
        rs = {r["config"]: r for r in runs if r["prompt"] == p}
        assert sorted(rs) == sorted(names)
        assert sorted(r["order"] for r in rs.values()) == [0, 1, 2, 3]
        assert rs["default-schema"]["match"] and rs["default-free"]["match"]
        assert rs["ar-schema"]["method"] == "ar" and rs["default-schema"]["method"] == "specexec"
        assert all(1 <= r["tokens"] <= 16 and r["decode_tok_s"] > 0 and r["wall_s"] > 0 for r in rs.values())
        assert rs["ar-schema"]["forced_tokens"] > 0  # the schema's key names
        assert "valid" in rs["ar-schema"] and "valid" not in rs["ar-free"]
    assert [r["order"] for r in runs if r["config"] == "ar-schema"] == [0, 3]  # the order rotates per prompt
    s = rep["summary"]
    assert s["mismatches"] == 0 and s["invalid"] == 0
    overall = s["overall"]
    assert set(overall["configs"]) == set(names)
    for c in overall["configs"].values():
        for key in ("tokens", "decode_tok_s", "tok_s", "tokens_per_step", "forced_share", "finished"):
            assert key in c
    assert overall["configs"]["default-schema"]["forced_share"] > 0
    assert set(overall["ratios"]) == {"default-schema/ar-schema", "default-schema/default-free"}
    assert all(v["decode_tok_s"] > 0 and v["tok_s"] > 0 for v in overall["ratios"].values())
    assert len(s["per_prompt"]) == 2
    printed = capsys.readouterr().out
    assert "| config | tokens | decode tok/s | tok/s | tokens/step | forced | finished | checks |" in printed
    for label in ("| AR, schema |", "| default, schema |", "| default, free |", "| AR, free |"):
        assert label in printed
    assert "| default-schema/ar-schema |" in printed and "| default-schema/default-free |" in printed
    assert "SMOKE RUN" in printed and "Exactness: 0 mismatches" in printed
    assert md.read_text() == printed[:-1]  # the same tables (print adds one newline)


def test_bench_structured_checks_answers_against_the_schema():
    mod = script("bench_structured")
    book = mod.SCHEMAS["book"].schema
    good = {"title": "Dune", "author": "Frank Herbert", "year": 1965, "pages": 412, "rating": 4.3}
    good |= {"genres": ["science fiction"], "in_print": True}
    assert mod.check_answer(json.dumps(good), book) is None
    assert mod.check_answer(json.dumps({**good, "year": "1965"}), book).startswith("does not validate")
    assert mod.check_answer('{"title": "Dune"', book).startswith("not JSON")
    for name in mod.SCHEMAS:
        prompts = mod.build_prompts(name, mod.MAX_PROMPTS)
        assert 4 <= len(prompts) <= 6 and len({p.text for p in prompts}) == len(prompts)


@pytest.mark.parametrize(
    "bad",
    [["--schema", "poem"], ["--prompts", "0"], ["--prompts", "99"], ["--max-new-tokens", "0"], ["--max-budget", "0"]],
)
def test_bench_structured_refuses_bad_options_with_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        script("bench_structured").main(bad)
    assert e.value.code == 2
