"""Smoke tests of the benchmark scripts on tiny random models: each script's ``main`` runs end to end with the
smallest settings and writes the JSON its docs rely on; composed estimates are labelled as projections."""

from __future__ import annotations

import importlib
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_COSTS = ROOT / "tests" / "data" / "bench_e2e_h100.json"
SCRIPTS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py"))


def script(name: str) -> Any:
    return importlib.import_module(f"scripts.{name}")


def keys(obj: Any) -> Iterator[str]:
    """Every dict key anywhere in a JSON value."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from keys(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from keys(v)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_imports_and_uses_no_old_modules(name):
    script(name)
    text = (ROOT / "scripts" / f"{name}.py").read_text()
    old = ["specexec" + r"\.draft\b", r"\bDraft" + r"er\b", r"\._draft" + "er", "_t_" + "cache"]  # the pre-seam names
    assert not re.search("|".join(old), text)


def fake_prompts(vocab: int):
    """Prompts of varied in-vocabulary ids (the tiny word-level tokenizer maps stdlib text to one unknown id)."""

    def make(tok, n_code, n_prose, min_tok, max_tok):
        ba = script("bench_acceptance")
        rng = random.Random(0)
        return [
            ba.Prompt(kind, "test", (0, 1), "", [rng.randrange(3, vocab) for _ in range(12)])
            for kind in ["code"] * n_code + ["prose"] * n_prose
        ]

    return make


def test_make_prompts_are_deterministic_and_split_by_kind(tiny_pair):
    from specexec.loading.checkpoint import load_tokenizer

    ba = script("bench_acceptance")
    tok = load_tokenizer(tiny_pair[0]).tokenizer
    a = ba.make_prompts(tok, 2, 1, 20, 60)
    b = ba.make_prompts(tok, 2, 1, 20, 60)
    assert [p.kind for p in a] == ["code", "code", "prose"]
    assert [(p.source, p.lines, p.ids) for p in a] == [(p.source, p.lines, p.ids) for p in b]
    assert all(20 <= len(p.ids) <= 60 for p in a)


def run_acceptance(tiny_pair, tmp_path, monkeypatch, *extra: str) -> tuple[int, dict[str, Any], Path]:
    ba = script("bench_acceptance")
    monkeypatch.setattr(ba, "make_prompts", fake_prompts(96))
    out, md = tmp_path / "acc.json", tmp_path / "acc.md"
    rc = ba.main(
        [
            "--target",
            str(tiny_pair[0]),
            "--draft",
            str(tiny_pair[1]),
            "--prompts",
            "2",
            "--new-tokens",
            "6",
            "--budgets",
            "4,8",
            "--gammas",
            "1,2",
            "--budget-prompts",
            "8:1",
            "--sampling-prompts",
            "1",
            "--sampling-budgets",
            "4",
            "--sampling-gamma",
            "2",
            "--context",
            "128",
            "--out",
            str(out),
            "--md",
            str(md),
            "--png",
            str(tmp_path / "acc.png"),
            *extra,
        ]
    )
    return rc, json.loads(out.read_text()), md


def test_bench_acceptance_records_real_runs_and_labels_the_projection(tiny_pair, tmp_path, monkeypatch):
    rc, rep, md = run_acceptance(tiny_pair, tmp_path, monkeypatch, "--grow-cost", str(GPU_COSTS))
    assert rc == 0 and rep["checks"]["greedy_differs_from_ar"] == []
    runs = rep["runs"]
    # every prompt x config ran (budget 8 on one prompt only), each with the engine's whole Stats
    assert sorted((r["prompt"], r["config"]) for r in runs) == sorted(
        [(i, c) for i in (0, 1) for c in ("ar", "chain:1", "chain:2", "specexec:4")] + [(0, "specexec:8")]
    )
    for r in runs:
        st = r["stats"]
        assert r["tokens_equal_ar"] and st["new_tokens"] == 6 and st["method"] == r["method"]
        assert sum(int(k) * v for k, v in st["accepted_hist"].items()) == 6
        assert len(st["tree_shapes"]) == (0 if r["method"] == "ar" else st["steps"])
        assert st["draft_passes"] == sum(len(s) for s in st["tree_shapes"])
        if r["method"] == "chain":
            assert all(s[0] >= 1 and len(s) == r["param"] for s in st["tree_shapes"])
    for kind in ("code", "prose", "all"):
        assert {"ar", "chain:1", "chain:2", "specexec:4"} <= set(rep["greedy"][kind])
    assert rep["tree_shapes"]["all"]["4"]["steps"] == sum(
        r["stats"]["steps"] for r in runs if r["config"] == "specexec:4"
    )
    assert set(rep["sampling"]["configs"]) == {"chain:2", "specexec:4"}
    # the projection: present (implied by the GPU costs), labelled, and never a plain tok/s field
    proj = rep["projection"]
    assert "projection" in proj["what"] and "not measured" in proj["what"]
    assert str(GPU_COSTS) in proj["costs"] and str(GPU_COSTS) in rep["grow_cost"]
    all_keys = set(keys(rep))
    assert "projected_tok_s_gpu" in all_keys and not any("composed" in k for k in all_keys)
    assert all(r["projected_tok_s_gpu"] > 0 for r in runs)
    assert "projection, not measured" in md.read_text()
    # --report-only re-renders from the JSON alone
    md.unlink()
    ba = script("bench_acceptance")
    assert (
        ba.main(
            ["--report-only", "--out", str(tmp_path / "acc.json"), "--md", str(md), "--png", str(tmp_path / "acc2.png")]
        )
        == 0
    )
    assert "projection, not measured" in md.read_text()


def test_bench_acceptance_without_projection_has_no_projected_fields(tiny_pair, tmp_path, monkeypatch):
    rc, rep, md = run_acceptance(tiny_pair, tmp_path, monkeypatch, "--grow-cost", "off", "--sampling-prompts", "0")
    assert rc == 0
    assert "projection" not in rep and not any("projected" in k for k in keys(rep))
    assert rep["grow_cost"].startswith("off")
    assert all(r["stats"]["early_stops"] == 0 for r in rep["runs"])
    assert "projected" not in md.read_text()


def test_bench_auto(tiny_pair, tmp_path):
    out = tmp_path / "auto.json"
    rc = script("bench_auto").main(
        [
            "--target",
            str(tiny_pair[0]),
            "--draft",
            str(tiny_pair[1]),
            "--budgets",
            "4,8",
            "--new-tokens",
            "4",
            "--prompts",
            "2",
            "--out",
            str(out),
        ]
    )
    rep = json.loads(out.read_text())
    assert rc == 0 and [r["config"] for r in rep["rows"]] == ["budget 4", "budget 8", "auto"]
    assert all(r["same_tokens"] and r["tokens"] == 8 for r in rep["rows"])
    assert rep["best_fixed"] in ("budget 4", "budget 8") and rep["auto_over_best"] > 0


def test_bench_ar(tiny_pair, tmp_path):
    out = tmp_path / "ar.json"
    rc = script("bench_ar").main(
        ["--target", str(tiny_pair[0]), "--new-tokens", "4", "--prompts", "2", "--context", "256", "--out", str(out)]
    )
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["summary"]["all_identical"] and len(rep["rows"]) == 2


def test_bench_e2e_smoke_and_recompute_label_projections(tmp_path, tiny_pair, monkeypatch):
    e2e = script("bench_e2e")
    for name, shape in (("LLAMA2_70B", e2e.LLAMA2_70B), ("LLAMA2_7B", e2e.LLAMA2_7B)):
        monkeypatch.setattr(e2e, name, dict(shape))  # --smoke shrinks them in place; keep other tests' shapes
    out = tmp_path / "e2e.json"
    assert (
        e2e.main(
            [
                "--smoke",
                "--budgets",
                "4,8",
                "--formats",
                "nf4",
                "--repeats",
                "1",
                "--context",
                "32",
                "--acceptance",
                str(tmp_path / "none.json"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rep = json.loads(out.read_text())
    assert "not measured" in rep["projection"] and set(rep["draft_pass_s_graphed"]) and rep["runs"]
    growth = rep["growth_by_mode"]  # one real growth per TreeConfig.grow mode, the same tree
    dyn = growth["dynamic"]
    for mode in ("static", "ahead"):
        assert growth[mode]["grow_s"] > 0 and growth[mode]["passes"] in (dyn["passes"], dyn["passes"] + 1), growth
        assert sum(growth[mode]["beams_per_pass"]) == sum(dyn["beams_per_pass"]), growth
    for r in rep["runs"]:
        assert {"projected_tok_s", "projected_speedup_vs_ar", "verify_s", "ar_step_s", "draft_s"} <= set(r)
        assert not set(e2e.LEGACY_COMPOSED) & set(r)
    # recompute: measured GPU times x a bench_acceptance JSON's real-run tokens/step and tree shapes
    _, acc, _ = run_acceptance(tiny_pair, tmp_path, monkeypatch, "--sampling-prompts", "0")
    out2 = tmp_path / "re.json"
    assert (
        e2e.main(
            [
                "--recompute",
                str(GPU_COSTS),
                "--acceptance",
                str(tmp_path / "acc.json"),
                "--budgets",
                "64",
                "--out",
                str(out2),
            ]
        )
        == 0
    )
    re_ = json.loads(out2.read_text())
    assert "not measured" in re_["projection"] and all("projected_tok_s" in r for r in re_["runs"])
    assert not any(set(e2e.LEGACY_COMPOSED) & set(r) for r in re_["runs"])
    loaded, _ = e2e.load_acceptance(tmp_path / "acc.json", "code", [4])
    assert loaded[4]["tokens_per_step"] == acc["greedy"]["code"]["specexec:4"]["tokens_per_step"]
    assert loaded[4]["beams_per_pass"] == acc["tree_shapes"]["code"]["4"]["beams_per_pass"]


def test_profile_draft(monkeypatch, capsys):
    e2e = script("bench_e2e")
    for name, shape in (("LLAMA2_70B", e2e.LLAMA2_70B), ("LLAMA2_7B", e2e.LLAMA2_7B)):
        monkeypatch.setattr(e2e, name, dict(shape))
    pd = script("profile_draft")
    if not torch.cuda.is_available():
        assert pd.main([]) == 1
        assert "error: profile_draft needs a CUDA GPU" in capsys.readouterr().err
    assert pd.main(["--smoke", "--tokens", "4", "--context", "32", "--capacity", "128", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "static=False" in out and "static=True" in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_draft_cuda(capsys):
    assert (
        script("profile_draft").main(["--tokens", "4", "--context", "64", "--capacity", "512", "--repeats", "1"]) == 0
    )
    assert "static=True" in capsys.readouterr().out


def test_profile_cpu_smoke(tiny_pair, tmp_path, capsys):
    """Every method's steps are split into parts that add up to the step the engine measured; greedy runs equal AR;
    --cprofile and --torch-profiler add their tables (and a Chrome trace per method)."""
    pc = script("profile_cpu")
    out, traces = tmp_path / "profile.json", tmp_path / "traces"
    argv = ["--smoke", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--sets", "code,prose"]
    argv += ["--max-new-tokens", "6", "--out", str(out), "--cprofile", "--torch-profiler", str(traces)]
    assert pc.main([*argv, "--profile-steps", "2", "--quiet"]) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    methods = ["ar", "chain:4", "specexec:8", "specexec:32", "ngram", "default"]
    assert rep["meta"]["smoke"] and rep["meta"]["methods"] == methods and rep["meta"]["prompts"] == 2
    assert len(rep["runs"]) == 2 * len(methods)
    for r in rep["runs"]:
        assert len(r["steps"]) == r["stats_steps"] > 0
        assert sum(s["tokens"] for s in r["steps"]) == len(r["tokens"])
        for s in r["steps"]:
            parts = pc.split(s)
            assert set(parts) == set(pc.PARTS)
            assert sum(parts.values()) == pytest.approx(s["draft_s"] + s["target_s"], rel=1e-9, abs=1e-12)
            assert all(v >= -1e-9 for v in parts.values()), parts  # nested timers: no part is negative
            if r["method"] == "ar":
                assert s["passes"] == 0 and s["draft_forward"] == 0 and s["ngram_propose"] == 0
            if r["method"].startswith(("chain", "specexec")):
                assert s["draft_forward"] > 0 and s["passes"] >= 1
            if r["method"] == "ngram":
                assert s["ngram_propose"] > 0 and s["draft_forward"] == 0
    for m in methods:
        summary = rep["methods"][m]
        assert summary["mismatches_vs_ar"] == 0, m
        assert summary["step_ms"] == pytest.approx(sum(summary["parts_ms"].values()))
        assert "cumulative" in summary["cprofile_top"] and "Self CPU" in summary["torch_top"]
        assert (traces / f"{m.replace(':', '-')}.json").is_file()
        assert f"| {m} |" in printed
    assert "SMOKE RUN" in printed and "draft glue" in printed


def test_profile_cpu_phase_timer_restores_the_library():
    """The timers wrap library functions only while the context is open."""
    from specexec.decoding import loop as decode
    from specexec.model.transformer import Transformer
    from specexec.propose.ngram import NGramDraft

    pc = script("profile_cpu")
    before = (Transformer.forward, decode.score_tree, decode.accept, decode.TargetState.commit, NGramDraft.propose)
    with pc.PhaseTimer(None):
        assert decode.score_tree is not before[1] and Transformer.forward is not before[0]
    after = (Transformer.forward, decode.score_tree, decode.accept, decode.TargetState.commit, NGramDraft.propose)
    assert after == before


@pytest.mark.parametrize("spec", ["beam", "chain", "specexec:x", "chain:0", "ngram:4", ""])
def test_profile_cpu_bad_methods(spec):
    with pytest.raises(SystemExit, match="error: --methods"):
        script("profile_cpu").parse_methods(spec)


def test_bench_before_after_runs_both_revisions_and_compares_tokens(tiny_pair, tmp_path):
    """The refactor check: the old revision's and this checkout's `specexec bench` on the same tiny pair, tokens
    compared across revisions (the old loop and the new one agree token for token)."""
    import subprocess

    ba = script("bench_before_after")
    # the pre-refactor revision where this clone has it; a shallow clone compares HEAD with itself (same logic)
    known = subprocess.run(["git", "cat-file", "-e", ba.BEFORE + "^{commit}"], cwd=ROOT, capture_output=True)
    before = ba.BEFORE if known.returncode == 0 else "HEAD"
    target, draft = tiny_pair
    out = tmp_path / "ba.json"
    bench = ["--target", str(target), "--draft", str(draft), "--methods", "ar,chain,specexec", "--budgets", "4"]
    bench += ["--gammas", "2", "--num-prompts", "1", "-n", "4", "--context", "256"]
    rc = ba.main(["--before", before, "--order", "AB", "--out", str(out), "--", *bench])
    report = json.loads(out.read_text())
    assert rc == 0 and report["mismatches"] == []
    assert {r["config"] for r in report["rows"]} == {"ar", "chain 2", "specexec 4"}
    assert report["token_comparisons"] == 2 * 2 * 3  # 2 revisions x 3 configs x (vs first run, vs own AR)
    assert report["cross_revision_runs"] == 3  # the same prompt names in both: tokens compared across revisions
    assert all(r["before_tok_s"] and r["after_tok_s"] for r in report["rows"])


def test_bench_before_after_unknown_revision_is_one_clean_line(capsys):
    assert script("bench_before_after").main(["--before", "no-such-rev-0000", "--", "--num-prompts", "1"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: --before no-such-rev-0000: no such commit") and "Traceback" not in out


def test_plan_draft_tradeoff(tmp_path):
    """The memory plan's placements: a lighter draft never leaves fewer target layers resident, a bigger cap never
    fewer, the streamed bytes follow the resident layers, and a draft that cannot fit is reported, not placed."""
    mod = script("plan_draft_tradeoff")
    out = tmp_path / "t.json"
    assert mod.main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(mod.PAIRS) * 2 * len(mod.CAPS) * len(mod.DRAFT_FORMATS)

    def resident(r):
        return r["resident_layers"] if r["fits"] else -1

    by = {(r["target"], r["target_format"], r["cap_gb"], r["draft_format"]): r for r in rows}
    for (t, tf, cap, df), r in by.items():
        assert r["draft_gb"] > 0
        if r["fits"]:
            assert 0 <= r["resident_layers"] <= r["layers"]
            streamed = (r["layers"] - r["resident_layers"]) * r["layer_gb"]
            assert abs(r["streamed_gb_per_pass"] - streamed) < 1e-6
            assert r["floor_s_pcie4"] > r["floor_s_h100"] or r["streamed_gb_per_pass"] == 0
        lighter = {"bf16": "int8", "int8": "nf4"}.get(df)
        if lighter:
            assert resident(by[(t, tf, cap, lighter)]) >= resident(r)
            assert by[(t, tf, cap, lighter)]["draft_gb"] < r["draft_gb"]
        for bigger in mod.CAPS:
            if bigger > cap:
                assert resident(by[(t, tf, bigger, df)]) >= resident(r)
    # a 13.5 GB bf16 7B draft cannot sit under a 12 GB cap; NF4 layers of a 70B: some stay resident at 24 GB
    assert not by[("llama2-70b", "nf4", 12.0, "bf16")]["fits"]
    assert (
        by[("llama2-70b", "nf4", 24.0, "nf4")]["resident_layers"]
        > by[("llama2-70b", "nf4", 24.0, "bf16")]["resident_layers"]
    )


def test_bench_coupling_smoke(tiny_pair, tmp_path):
    """scripts/bench_coupling.py end to end on the tiny pair: rates in [0, 1] per set, score bins that count every
    coupled token, and greedy refused (nothing to couple)."""
    target, draft = tiny_pair
    mod = script("bench_coupling")
    out = tmp_path / "c.json"
    args = ["--smoke", "--target", str(target), "--draft", str(draft), "--sets", "prose,code", "--out", str(out)]
    assert mod.main(args) == 0
    rep = json.loads(out.read_text())
    for d in rep["sets"].values():
        assert d["positions"] > 0
        assert all(0.0 <= d[k] <= 1.0 for k in ("argmax", "coupled", "chain_rule"))
        assert sum(b["tokens"] for b in d["coupled_score_bins"]) == d["positions"] * rep["meta"]["noise_draws"]
    with pytest.raises(SystemExit):
        mod.main(["--smoke", "--target", str(target), "--draft", str(draft), "--temperature", "0"])


def test_bench_gpu_smoke_runs_the_engine_end_to_end(tmp_path, monkeypatch):
    """bench_gpu --smoke: every setting, baseline and growth mode runs the real engine on tiny planted pairs, with
    every target layer streamed; the tokens equal the target's greedy text; PCIe4 figures are named projections."""
    gpu = script("bench_gpu")
    monkeypatch.setattr(gpu, "SHAPES", {k: dict(v) for k, v in gpu.SHAPES.items()})  # --smoke shrinks in place
    monkeypatch.setattr(gpu, "SETTINGS", dict(gpu.SETTINGS))
    out = tmp_path / "gpu.json"
    argv = ["--smoke", "--prompts", "1", "--prompt-tokens", "16", "--new-tokens", "12", "--ar-tokens", "4"]
    argv += ["--budgets", "8", "--budgets-other", "8", "--mode-budget", "8", "--calibrate", "on,off"]
    assert gpu.main([*argv, "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [s["setting"] for s in rep["settings"]] == gpu.DEFAULT_SETTINGS.split(",")
    runs1 = {r["run"] for r in rep["settings"][1]["runs"]}
    assert {"specexec 8", "specexec 8 calibrated"} <= runs1  # raw (the default) and calibrated
    first = rep["settings"][0]
    runs = {r["run"]: r for r in first["runs"]}
    assert {"ar (no draft)", "ar (draft loaded)", "specexec 8", "static 8", "ahead 8", "auto"} <= set(runs)
    assert "ahead+overlap 2 8" in runs and "dynamic+reuse 8" in runs and "ahead+overlap 16 frontier 8" in runs
    assert "ahead+overlap auto 8" in runs and "auto+overlap auto 8" in runs and "ahead+overlap 32+early stop 8" in runs
    assert first["placement"]["streamed_layers"] == 4 and first["ar_no_draft_placement"]["streamed_layers"] == 4
    # each run names the growth it used, "auto" resolved for the device (a CPU here)
    assert runs["specexec 8"]["grow"] == "dynamic" and runs["ahead 8"]["grow"] == "ahead" and runs["auto"]["grow"]
    assert "grow" not in runs["ar (no draft)"]
    for s in rep["settings"]:
        for r in s["runs"]:
            assert r["exact"] and r["tokens"] > 0 and r["step_s"] > 0, r
            assert "projected_pcie4_tok_s" in r and "pcie4_tok_s" not in r
            assert r["projected_pcie4_step_over_verify"] >= 1.0
    assert runs["ar (no draft)"]["speedup_vs_ar"] == 1.0 and runs["ar (no draft)"]["tok_per_step"] == 1.0
    assert "planted" in rep["note"] and 0 <= first["planted"]["agreement"] <= 1
    acc = rep["accelerate"]  # the accelerate device_map baseline runs its calls on the CPU in a smoke run
    assert acc["accelerate_tok_s"] > 0 and acc["ours_ar_tok_s"] > 0 and acc["layers"] == 4
    assert "projected_accelerate_80_layer_tok_s" in acc and "ours_best_70b_nf4_over_projected_accelerate" in acc
    assert gpu.main(["--settings", "70b-nf4@24,nope"]) == 2
    with pytest.raises(SystemExit) as e:
        gpu.main(["--calibrate", "maybe"])
    assert e.value.code == 2


def test_bench_gpu_echo_prompts_are_carried_by_the_ngram_branches(tmp_path, monkeypatch):
    """bench_gpu --echo: prompts that hold their own continuation; the n-gram branches merged into the trees by
    default carry it (tokens counted), the text is still the target's greedy one, and the random prompts of a plain
    run never repeat (no n-gram tokens)."""
    gpu = script("bench_gpu")
    monkeypatch.setattr(gpu, "SHAPES", {k: dict(v) for k, v in gpu.SHAPES.items()})
    monkeypatch.setattr(gpu, "SETTINGS", dict(gpu.SETTINGS))
    out = tmp_path / "gpu.json"
    argv = ["--smoke", "--settings", "70b-nf4@24", "--prompts", "1", "--prompt-tokens", "40", "--new-tokens", "12"]
    argv += ["--ar-tokens", "4", "--budgets", "4", "--modes", "", "--no-auto", "--no-accelerate", "--no-ar-loaded"]
    rows = {}
    for echo in (False, True):
        assert gpu.main([*argv, "--out", str(out), *(["--echo"] if echo else [])]) == 0
        (setting,) = json.loads(out.read_text())["settings"]
        assert setting["echo_prompts"] is echo
        rows[echo] = next(r for r in setting["runs"] if r["run"] == "specexec 4")
    assert rows[False]["exact"] and rows[True]["exact"]
    assert rows[False]["ngram_tokens"] == 0 < rows[True]["ngram_tokens"]
    assert rows[True]["tok_per_step"] > rows[False]["tok_per_step"]
    # growth modes x level widths: one run each per budget, all exact
    assert gpu.main([*argv, "--out", str(out), "--grows", "auto,captured", "--max-beams", "128,4"]) == 0
    (setting,) = json.loads(out.read_text())["settings"]
    runs = {r["run"]: r for r in setting["runs"]}
    assert {"specexec 4", "specexec 4 w4", "specexec 4 captured", "specexec 4 captured w4"} <= set(runs), list(runs)
    assert all(r["exact"] for r in runs.values())
    bad_args = (["--prompt-tokens", "20", "--echo"], ["--ngram-nodes", "-1"], ["--int8-kernel", "fast"])
    more_bad = (["--grows", "fast"], ["--max-beams", "0"], ["--max-beams", "x"])
    for bad in (*bad_args, *more_bad, ["--nf4-kernel", "cutlass"], ["--warmup-tokens", "0"]):
        with pytest.raises(SystemExit) as e:
            gpu.main([*argv, *bad])
        assert e.value.code == 2


def test_bench_level_width_counts_tokens_against_level_rows(tmp_path):
    """bench_level_width on a tiny planted pair: one row per domain, budget and width, every text AR's; a level
    never holds more open rows than its width; bad options exit 2."""
    mod = script("bench_level_width")
    out = tmp_path / "w.json"
    argv = ["--vocab", "512", "--hidden", "256,128", "--prompts", "1", "--prompt-tokens", "8", "--new-tokens", "16"]
    assert mod.main([*argv, "--budgets", "8,24", "--max-beams", "2,8", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["all_exact"] and len(rep["rows"]) == 2 * 2 * 2
    for r in rep["rows"]:
        assert r["tok_per_step"] >= 1.0 and r["passes_per_step"] >= 1.0
        assert 0 < r["mean_rows"] <= r["max_beams"]
        assert all(int(b) <= r["max_beams"] or int(b) == 1 for b in r["row_buckets"]), r
    assert set(rep["planted"]) == {"code", "prose"} and rep["early_stop"]["verify_s"] == 0.524
    for bad in (["--max-beams", "0"], ["--domains", "poetry"], ["--hidden", "64"], ["--pass-ms", "0"]):
        with pytest.raises(SystemExit) as e:
            mod.main([*argv, *bad])
        assert e.value.code == 2


def test_bench_overlap_counts_the_critical_path(tiny_pair, tmp_path):
    """bench_overlap on a tiny pair: every overlap keeps AR's text; background passes run only with overlap; the
    H100 projection is labelled and uses the critical-path passes."""
    target, draft = tiny_pair
    out = tmp_path / "ov.json"
    argv = ["--target", str(target), "--draft", str(draft), "--budget", "16", "--max-beams", "8"]
    argv += ["--overlaps", "0,3", "--max-new-tokens", "16", "--num-prompts", "1", "--aim-rel", "0.5", "--out", str(out)]
    assert script("bench_overlap").main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["aim_rel"] == 0.5
    off, carried, frontier = rep["configs"]
    assert rep["all_exact"] and off["overlap"] == 0 and carried["overlap"] == frontier["overlap"] == 3
    assert (off["aim"], carried["aim"], frontier["aim"]) == (None, "carried", "frontier")
    for on in (carried, frontier):
        assert off["background_passes_per_step"] == 0 < on["background_passes_per_step"]
        assert on["reused_nodes_per_step"] >= off["reused_nodes_per_step"]
    for c in rep["configs"]:
        assert c["projected_step_s"] >= rep["gpu_costs"]["verify_s"] and "projected_tok_s" in c
        assert "tok_s" not in c and "step_s" not in c
    # --early-stop: the levels a step waits for stop by the replayed H100 costs; still AR's text
    argv[argv.index("0,3")] = "3"
    assert script("bench_overlap").main([*argv, "--aims", "carried", "--early-stop"]) == 0
    rep = json.loads(out.read_text())
    (stopped,) = rep["configs"]
    assert rep["all_exact"] and rep["early_stop"] == "replayed H100 costs"
    # (the tiny pair's near-uniform draft ends growth by ties before any stop could: the stop itself is tested in
    # tests/test_fixed_grow.py; here, that the option runs and keeps the text)
    assert all("early_stops" in q for q in stopped["per_prompt"])


def test_plan_self_draft_table(tmp_path):
    """The self-derived draft table: fewer bits never leave fewer target layers resident; a whole 70B in q2 does
    not fit at 24 GB beside a streamed 70B; a 32B in q2 does; every separate NF4 draft fits."""
    mod = script("plan_draft_tradeoff")
    out = tmp_path / "s.json"
    assert mod.main(["--self-draft", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(mod.SELF_CASES) * 2 * (1 + len(mod.SELF_FORMATS))
    by = {(r["target"], r["target_format"], r["draft"], r["draft_format"]): r for r in rows}

    def resident(r):
        return r["resident_layers"] if r["fits"] else -1

    for target, _, other in mod.SELF_CASES:
        for tf in ("nf4", "bf16"):
            assert by[(target, tf, other, "nf4")]["fits"]
            sizes_ = [by[(target, tf, target, f)] for f in ("q4", "q3", "q2")]
            assert sizes_[0]["draft_gb"] > sizes_[1]["draft_gb"] > sizes_[2]["draft_gb"]
            assert resident(sizes_[0]) <= resident(sizes_[1]) <= resident(sizes_[2])
            for r in sizes_:
                assert r["draft_pass_gb_dequant"] > r["draft_pass_gb_fused"] == r["draft_gb"]
    for target in ("llama2-70b", "llama3-70b"):
        r = by[(target, "nf4", target, "q2")]
        assert not r["fits"] and r["short_gb"] > 0
    assert by[("qwen2.5-32b", "nf4", "qwen2.5-32b", "q2")]["fits"]


def test_bench_self_draft_names_and_smoke(tiny_pair, tmp_path, capsys):
    """scripts/bench_self_draft.py: draft names parse (bad ones refused), and a tiny run is exact for every draft."""
    mod = script("bench_self_draft")
    assert mod.parse_draft("self") == (True, "int8", False, None, True)
    assert mod.parse_draft("self-q2") == (True, "q2", False, None, True)
    assert mod.parse_draft("self-q2/own") == (True, "q2", False, None, False)
    assert mod.parse_draft("fp32") == (False, "fp32", False, None, False)
    assert mod.parse_draft("q3r") == (False, "q3", True, None, False)
    assert mod.parse_draft("self-fp32@even:3") == (True, "fp32", False, "even:3", True)
    assert mod.parse_draft("self-q4@0-1,5/own") == (True, "q4", False, "0-1,5", False)
    for bad in ("self-fp32", "q5", "self-", "self-int8r", "int8@0.5", "int8/own", "self-q4/mine"):
        with pytest.raises(ValueError, match="unknown draft"):
            mod.parse_draft(bad)
    target, draft = tiny_pair
    out = tmp_path / "b.json"
    argv = ["--target", str(target), "--draft", str(draft), "--num-prompts", "1", "--max-new-tokens", "8"]
    assert mod.main([*argv, "--budgets", "4", "--drafts", "self-q2,self-nf4/own,q4r", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_exact"] and [c["draft"] for c in report["configs"]][::2] == ["self-q2", "self-nf4/own", "q4r"]
    assert [c.get("shared_prefix") for c in report["configs"]][::2] == [True, False, None]
    # partial self drafts: a layer list (semicolon-separated names), the experiment rules, and the library's count
    spec = "self-fp32@0,;self-q4@even:2;self-int8@tail:2;self-int8@1;self-fp32@agree:1"
    assert mod.main([*argv, "--budgets", "4", "--drafts", spec, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_exact"]
    layers = [c["layers"] for c in report["configs"]][::2]
    assert layers[:3] == [[0], [0, 1], [0, 1]] and len(layers[3]) == len(layers[4]) == 1


def test_bench_draft_pass_names_and_smoke(tmp_path):
    """scripts/bench_draft_pass.py: draft names parse (bad ones refused), and the tiny CPU run covers every format
    path it times on a GPU (dense, int8, group-wise, a partial layer count) and reports each pass."""
    mod = script("bench_draft_pass")
    assert mod.parse_draft("7b-nf4") == ("7b", None, "nf4") and mod.parse_draft("70b20-q3") == ("70b", 20, "q3")
    for bad in ("7b-q5", "13b-bf16", "70b81-q3", "70b0-q3", "7b"):
        with pytest.raises(ValueError):
            mod.parse_draft(bad)
    out = tmp_path / "p.json"
    assert mod.main(["--smoke", "--repeats", "1", "--rows", "1,4", "--prefix", "8", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["draft"], r["rows"]) for r in runs][::2] == [
        ("tiny-bf16", 1),
        ("tiny-int8", 1),
        ("tiny-q3", 1),
        ("tiny2-q2", 1),
    ]
    assert runs[-1]["layers"] == 2 and all(r["pass_s"] > 0 and r["weight_gb"] > 0 for r in runs)
    assert runs[-1]["weight_gb"] < runs[0]["weight_gb"]  # 2 layers at 2 bits weigh less than 4 dense ones


def test_bench_shared_prefix_smoke(tiny_models, tmp_path):
    """scripts/bench_shared_prefix.py: both settings per prompt length, every output equal to the target's AR."""
    out = tmp_path / "sp.json"
    argv = ["--target", str(tiny_models["qwen2"]), "--prompt-tokens", "16,40", "--new-tokens", "6", "--out", str(out)]
    assert script("bench_shared_prefix").main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["all_exact"] and [(r["kind"], r["prompt_tokens"]) for r in rep["rows"]] == [
        ("code-random", 16),  # the test tokenizer reads none of the source: pseudo-random ids
        ("code-random", 40),
        ("prose-random", 16),
        ("prose-random", 40),
    ]
    assert all(r["shared"]["prefill_s"] > 0 and r["own"]["ttft_s"] > 0 for r in rep["rows"])
    with pytest.raises(SystemExit):
        script("bench_shared_prefix").parse_args(["--prompt-tokens", "1,x"])


def test_trace_summary_splits_the_draft_phase_into_host_and_gpu_time(tmp_path):
    """scripts/trace_summary.py on a hand-made chrome trace: a kernel belongs to the range its launch falls in
    (pass or bookkeeping), busy time is the union of kernel intervals inside the draft window (propose start to
    the verify's start), and per-level means divide by the levels."""
    import gzip
    import json

    ts = script("trace_summary")

    def x(name, cat, t, dur, **args):  # noqa: ANN001, ANN003, ANN202
        return {"ph": "X", "name": name, "cat": cat, "ts": t, "dur": dur, "args": args}

    events = [
        x("step.propose", "user_annotation", 0, 90),
        x("step.sync", "user_annotation", 90, 10),
        x("step.verify", "user_annotation", 100, 100),
        x("draft.level", "user_annotation", 10, 10),
        x("draft.level", "user_annotation", 30, 10),
        x("draft.pass", "user_annotation", 12, 3),
        x("draft.pass", "user_annotation", 32, 3),
        x("draft.read", "user_annotation", 22, 4),
        x("cudaGraphLaunch", "cuda_runtime", 13, 1, correlation=1),
        x("cudaLaunchKernel", "cuda_runtime", 25, 1, correlation=2),
        x("cudaGraphLaunch", "cuda_runtime", 33, 1, correlation=3),
        x("k1", "kernel", 14, 36, correlation=1),  # 14..50
        x("k2", "kernel", 40, 20, correlation=2),  # 40..60, overlaps k1 by 10
        x("k3", "kernel", 60, 20, correlation=3),  # 60..80
        x("late", "kernel", 150, 10, correlation=9),  # inside the verify: not the draft's
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = ts.summarize(ts._load(path))
    m = s["mean"]
    assert s["steps"] == 1 and m["levels"] == 2
    assert m["propose_ms"] == pytest.approx(0.1) and m["gpu_busy_ms"] == pytest.approx(0.066)
    assert m["gpu_pass_ms"] == pytest.approx(0.056) and m["gpu_book_ms"] == pytest.approx(0.020)
    assert m["host_level_ms"] == pytest.approx(0.020) and m["host_pass_ms"] == pytest.approx(0.006)
    assert m["host_read_ms"] == pytest.approx(0.004) and m["host_sync_ms"] == pytest.approx(0.010)
    assert m["per_level"]["gpu_pass_ms"] == pytest.approx(0.028)
    assert ts.main([str(path)]) == 0 and ts.main([str(tmp_path / "missing.json")]) == 2


def test_bench_ngram_merge_smoke(tiny_pair, tmp_path):
    """scripts/bench_ngram_merge.py: per prompt the tree alone and with the n-gram branches, both equal to AR
    (counts only); the summary covers every set it ran."""
    target, draft = tiny_pair
    out = tmp_path / "ng.json"
    argv = ["--target", str(target), "--draft", str(draft), "--sets", "code,grounded", "--prompts", "1"]
    argv += ["--new-tokens", "6", "--budget", "4", "--max-depth", "3", "--out", str(out)]
    assert script("bench_ngram_merge").main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["all_exact"] and set(rep["summary"]) == {"code", "grounded"}
    for s in rep["summary"].values():
        assert s["tree"]["tokens_per_step"] >= 1 and s["tree+ngram"]["ngram_tokens"] >= 0
    with pytest.raises(SystemExit):
        script("bench_ngram_merge").main(["--sets", "poetry"])


def test_bench_lowbit_mm_smoke_times_every_kernel(tmp_path):
    """bench_lowbit_mm --smoke: every kernel (16-bit; int8 and NF4 through bitsandbytes and the fused Triton ones,
    interpreted) on every linear and row count, alternative tiles, a layer's sum per row count, a JSON; bad options
    are one line and exit 2."""
    pytest.importorskip("triton")
    mod = script("bench_lowbit_mm")
    out = tmp_path / "lb.json"
    assert mod.main(["--smoke", "--tiles", "32,32,64,4,2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["int8-triton:32x32x64x4x2_us"] > 0 and r["nf4-triton:32x32x64x4x2_us"] > 0 for r in rows)
    linears = {(r["linear"], r["rows"]) for r in rows}
    assert {("w13", 16), ("lm_head", 33), ("layer", 1)} <= linears
    for r in rows:
        assert all(r[f"{k}_us"] > 0 for k in mod.KERNELS), r
    layer = next(r for r in rows if r["linear"] == "layer" and r["rows"] == 16)
    parts = [r for r in rows if r["rows"] == 16 and r["linear"] in mod.LAYER]
    assert layer["nf4-triton_us"] == pytest.approx(sum(r["nf4-triton_us"] for r in parts))
    bad_args = (["--kernels", "cutlass"], ["--rows", "a"], ["--shapes", "13b"], ["--calls", "0"])
    for bad in (*bad_args, ["--tiles", "32,64"], ["--tiles", "a,b,c,d,e"]):
        with pytest.raises(SystemExit) as e:
            mod.main(bad)
        assert e.value.code == 2


def test_bench_calibrate_counts_both_scores(tiny_pair, tmp_path, monkeypatch):
    """bench_calibrate on a tiny pair: a reliability table per kind, raw and calibrated runs per budget, every run
    AR's text; the calibrated runs start from exponents learnt on the warm prompts and report where they ended."""
    ba = script("bench_acceptance")
    monkeypatch.setattr(ba, "make_prompts", fake_prompts(96))
    out = tmp_path / "cal.json"
    argv = ["--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--budgets", "8,16", "--prompts", "1"]
    assert script("bench_calibrate").main([*argv, "--max-new-tokens", "12", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["all_exact"] and len(rep["prompts"]) == 2 and len(rep["warm_prompts"]) == 2
    assert [(c["budget"], c["calibrate"]) for c in rep["configs"]] == [(8, False), (8, True), (16, False), (16, True)]
    for kind in ("code", "prose"):
        first = rep["reliability"][kind]["first"]
        assert sum(r["n"] for r in first) == 12 and all(0 <= r["taken"] <= 1 for r in first)
    for c in rep["configs"]:
        assert c["tokens_per_step_all"] >= 1 and ("tok_s" not in c)
        assert (c["observed"] > 0) == c["calibrate"]
    static = tmp_path / "static.json"
    assert (
        script("bench_calibrate").main([*argv, "--max-new-tokens", "8", "--grow", "static", "--out", str(static)]) == 0
    )
    rep = json.loads(static.read_text())
    assert rep["grow"] == "static" and rep["all_exact"]
    for bad in (["--budgets", "x"], ["--prompts", "0"], ["--grow", "ahead"]):
        with pytest.raises(SystemExit) as e:
            script("bench_calibrate").main([*argv, *bad])
        assert e.value.code == 2
