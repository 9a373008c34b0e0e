"""scripts/bench_cpu.py on the tiny pair (--smoke): every configuration runs on every prompt of every set, the table
prints the ratios, the JSON carries the runs and their exactness against our AR. Measures nothing."""

from __future__ import annotations

import importlib
import json

import pytest


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("scripts.bench_cpu")


def test_prompt_sets_are_built_locally_without_duplicates(bench):
    prompts = bench.build_prompts(bench.SETS, 20)
    assert {s: len(p) for s, p in prompts.items()} == {"code": 20, "prose": 20, "grounded": 20}
    for s, ps in prompts.items():
        assert len({p.name for p in ps}) == 20, s
    for p in prompts["code"]:  # a header and its whole docstring, no body
        quote = '"""' if '"""' in p.text else "'''"
        assert not p.chat and p.text.lstrip().startswith("def ") and p.text.rstrip().endswith(quote), p.name
    grounded = prompts["grounded"]
    assert all(p.chat for p in grounded)
    assert {p.name.split(":")[0] for p in grounded} == {"hints", "rename", "docstring", "translate", "summarize"}
    code_names = {p.name for p in prompts["code"]}
    assert not any(p.name.split(":", 1)[1] in code_names for p in grounded)


@pytest.mark.parametrize(
    "bad",
    [
        ["--methods", "specexec"],
        ["--methods", "chain:x"],
        ["--methods", "ar:3"],
        ["--methods", "chain:auto"],
        ["--methods", "chain:0"],
        ["--sets", "poetry"],
        ["--hf", "hf-beam"],
        ["--temperature", "-1"],
        ["--max-new-tokens", "0"],
    ],
)
def test_bad_options_exit_2(bench, bad):
    with pytest.raises(SystemExit) as e:
        bench.main(bad)
    assert e.value.code == 2


def test_smoke_run_prints_the_ratios_and_writes_every_run(bench, tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["--smoke", "--quiet", "--target", str(target), "--draft", str(draft), "--methods", "specexec:8,chain:2"]
    assert bench.main([*argv, "--out", str(out), "--md", str(md)]) == 0
    rep = json.loads(out.read_text())
    configs = ["ours-ar", "ours-default", "ours-specexec-8", "ours-chain-2", *bench.HF_CONFIGS]
    assert [c["name"] for c in rep["meta"]["configs"]] == configs
    assert rep["meta"]["smoke"] and rep["meta"]["max_new_tokens"] == 8 and rep["meta"]["prompts_per_set"] == 1
    runs = rep["runs"]
    assert len(runs) == len(bench.SETS) * len(configs)
    for r in runs:
        assert 1 <= r["tokens"] <= 8 and r["seconds"] > 0 and r["tok_s"] > 0 and r["tokens_per_step"] > 0
    # greedy: every run of ours reproduces our AR's tokens
    assert all(r["match_ar"] for r in runs if r["config"].startswith("ours-") and r["config"] != "ours-ar")
    # interleaved, the order rotating per prompt: the first configuration differs between the sets' prompts
    assert len({r["config"] for r in runs if r["order"] == 0}) == 3
    for d in rep["sets"].values():
        assert list(d["configs"]) == configs and d["best_hf_speculative"] in bench.HF_SPECULATIVE
        assert d["configs"]["ours-ar"]["vs_our_ar"] == pytest.approx(1.0)
        s = d["configs"]["ours-default"]
        assert s["vs_our_ar"] > 0 and s["vs_best_hf_speculative"] > 0 and s["mismatches"] == 0
    printed = capsys.readouterr().out
    header = "| config | tok/s | × our AR | × best HF spec | min/prompt × our AR | decode tok/s | tokens/step |"
    assert printed.count(header) == 3 and printed.count("| ours-default |") == 3 and "SMOKE RUN" in printed
    assert md.read_text() in printed
