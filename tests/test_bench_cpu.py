"""scripts/bench_cpu.py end to end on the tiny pair (--smoke): the JSON's shape and the exactness bookkeeping.

Measures nothing: it checks that every configuration runs on every prompt of every set, interleaved, and that the
summary, goals and markdown are built from those runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cpu", ROOT / "scripts" / "bench_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_cpu"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_prompt_sets_are_built_locally(bench):
    prompts = bench.build_prompts(bench.SETS, 20)
    assert {s: len(p) for s, p in prompts.items()} == {"code": 20, "prose": 20, "grounded": 20}
    for s, ps in prompts.items():
        assert len({p.name for p in ps}) == 20, s  # no duplicates
    for p in prompts["code"]:  # a header and its whole docstring, no body
        quote = '"""' if '"""' in p.text else "'''"
        assert not p.chat and p.text.lstrip().startswith("def ") and p.text.count(quote) in (1, 2), p.name
        assert p.text.rstrip().endswith(quote), p.name
    g = prompts["grounded"]
    assert all(p.chat for p in g)
    kinds = {p.name.split(":")[0] for p in g}
    assert kinds == {"hints", "rename", "docstring", "translate", "summarize"}
    code_names = {p.name for p in prompts["code"]}
    assert not any(p.name.split(":", 1)[1] in code_names for p in g)
    assert all("```python\ndef " in p.text for p in g if not p.name.startswith("summarize"))


def test_method_parsing(bench):
    names = [c.name for c in bench.our_configs("specexec:16, chain:2,ngram,specexec:16")]
    assert names == ["ours-ar", "ours-default", "ours-specexec-16", "ours-chain-2", "ours-ngram"]
    for bad in ("specexec", "chain:x", "ar:3", "chain:auto"):
        with pytest.raises(SystemExit):
            bench.our_configs(bad)


def test_smoke_run_json_shape(bench, tiny_pair, tmp_path):
    target, draft = tiny_pair
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    rc = bench.main(
        [
            "--smoke",
            "--quiet",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--methods",
            "specexec:8,chain:2,default-calibrated",
            "--out",
            str(out),
            "--md",
            str(md),
        ]
    )
    assert rc == 0
    rep = json.loads(out.read_text())
    configs = [
        "ours-ar",
        "ours-default",
        "ours-specexec-8",
        "ours-chain-2",
        "ours-default-calibrated",
        *bench.HF_CONFIGS,
    ]
    assert [c["name"] for c in rep["meta"]["configs"]] == configs
    assert rep["meta"]["smoke"] and rep["meta"]["max_new_tokens"] == 8 and rep["meta"]["prompts_per_set"] == 1
    assert set(rep["sets"]) == set(bench.SETS)
    runs = rep["runs"]
    assert len(runs) == 3 * len(configs)
    for r in runs:
        assert 1 <= r["tokens"] <= 8 and r["seconds"] > 0 and r["tok_s"] > 0 and r["tokens_per_step"] > 0
        if r["config"] != "ours-ar":
            assert isinstance(r["match_ar"], bool)
    # interleaved and rotated: each prompt saw every config once, and the first config differs between prompts
    firsts = {r["set"]: r["config"] for r in runs if r["order"] == 0}
    assert len(set(firsts.values())) == 3
    # our methods are exact (greedy): the same tokens as our AR on every prompt
    assert all(r["match_ar"] for r in runs if r["config"].startswith("ours-") and r["config"] != "ours-ar")
    for set_name, d in rep["sets"].items():
        assert set(d["configs"]) == set(configs)
        s = d["configs"]["ours-default"]
        assert s["vs_our_ar"] > 0 and s["vs_best_hf_speculative"] > 0 and s["mismatches"] == 0
        assert d["configs"]["ours-ar"]["vs_our_ar"] == pytest.approx(1.0)
        assert d["best_hf_speculative"] in bench.HF_SPECULATIVE
        assert set(rep["goals"][set_name]) == {"vs_our_ar", "vs_best_hf_speculative", "min_prompt_vs_our_ar"}
    text = md.read_text()
    assert "SMOKE RUN" in text and text.count("| ours-default |") == 3 and "hf-assisted-bf16" in text


def test_smoke_run_sampling(bench, tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "bench.json"
    rc = bench.main(
        [
            "--smoke",
            "--quiet",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--sets",
            "grounded",
            "--temperature",
            "0.7",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["meta"]["temperature"] == 0.7 and list(rep["sets"]) == ["grounded"]
    assert len(rep["runs"]) == 2 + len(bench.HF_CONFIGS)
    # sampling: our tree-walk methods are compared with our AR for the same seed (fp32 here: the same tokens);
    # transformers' sampled runs are not comparable
    runs = {r["config"]: r for r in rep["runs"]}
    assert runs["ours-default"]["match_ar"] is True
    assert not any("match_ar" in r for r in rep["runs"] if r["config"].startswith("hf-"))
    assert rep["sets"]["grounded"]["configs"]["ours-default"]["mismatches"] == 0


def test_a_long_run_leaves_a_partial_report_after_each_prompt(bench, tiny_pair, tmp_path, monkeypatch):
    """After every prompt the report so far is written (marked partial, so a run stopped by a session's end keeps
    its finished prompts); the finished report replaces it, unmarked; the commit is the one the run started on."""
    target, draft = tiny_pair
    out = tmp_path / "bench.json"
    writes: list[dict] = []
    real = bench._write_report

    def spy(path, report):
        writes.append(json.loads(json.dumps(report)))
        real(path, report)

    monkeypatch.setattr(bench, "_write_report", spy)
    argv = ["--smoke", "--quiet", "--target", str(target), "--draft", str(draft), "--sets", "code,prose"]
    assert bench.main([*argv, "--hf", "hf-lookup", "--out", str(out)]) == 0
    assert [w["meta"].get("partial") for w in writes] == ["1 of 2 prompts", "2 of 2 prompts", None]
    assert [len(w["runs"]) for w in writes] == [3, 6, 6]  # ours-ar, ours-default, hf-lookup per prompt
    assert "sets" not in writes[0] and "sets" in writes[-1]
    assert writes[0]["meta"]["commit"] == writes[-1]["meta"]["commit"]
    final = json.loads(out.read_text())
    assert "partial" not in final["meta"] and not list(tmp_path.glob("*.tmp"))
    partial = {
        **writes[0],
        "sets": bench.summarize(writes[0]["runs"], [bench.Config(**c) for c in writes[0]["meta"]["configs"]], True),
    }
    assert "PARTIAL: the run stopped after 1 of 2 prompts" in bench.markdown(partial)


def test_recheck_adds_the_near_tie_check(bench, tiny_pair, tmp_path):
    """--recheck adds the near-tie check to the mismatched runs of an earlier report (here a made-up divergence),
    re-summarises and gives the verdict: 0 only when every divergence is a near-tie."""
    target, draft = tiny_pair
    out = tmp_path / "bench.json"
    common = ["--smoke", "--quiet", "--target", str(target), "--draft", str(draft), "--sets", "code", "--dtype", "fp32"]
    assert bench.main([*common, "--max-new-tokens", "6", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    row = next(r for r in rep["runs"] if r["config"] == "ours-default")
    assert row["match_ar"] is True
    row["match_ar"], row["first_diff"] = False, 2
    out.write_text(json.dumps(rep))
    rc = bench.main(["--quiet", "--recheck", str(out)])
    got = json.loads(out.read_text())
    checked = next(r for r in got["runs"] if r["config"] == "ours-default")
    assert checked["near_tie"] == (checked["first_diff_gap"] < bench.NEAR_TIE["float32"])
    assert rc == (0 if checked["near_tie"] else 1)
    s = got["sets"]["code"]["configs"]["ours-default"]
    assert s["mismatches"] == 1 and s["near_ties"] == int(checked["near_tie"])
    assert got["meta"]["near_tie_recheck"].startswith("1 mismatched run")


def test_tie_check_tells_a_real_choice_from_a_tie(bench, tiny_pair):
    """The target's top-2 gap at a divergence: a real choice of the tiny fp32 target is far above the tolerance
    (a divergence there would be a bug); two equal scores are a tie."""
    target, draft = tiny_pair
    args = bench.parse_args(["--smoke", "--target", str(target), "--draft", str(draft), "--dtype", "fp32"])
    runner = bench.Runner(args, bench.our_configs(""))
    ids = [5, 6, 7]
    ref = runner.run(bench.Config("ours-ar", "ours", "ar"), ids, 6, None)["ids"]
    checks = [runner.tie_check(ids, ref, i, None) for i in range(6)]
    assert any(not c["near_tie"] and c["first_diff_gap"] > 10 * bench.NEAR_TIE["float32"] for c in checks), checks
    assert all(c["near_tie"] == (c["first_diff_gap"] < bench.NEAR_TIE["float32"]) for c in checks)
