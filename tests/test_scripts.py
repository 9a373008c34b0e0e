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
    assert SCRIPTS == ["bench_before_after.py", "bench_cpu.py", "bench_gpu.py", "bench_offload.py", "check_exact.py"]


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
