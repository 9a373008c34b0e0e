"""scripts/bench_cpu.py on the tiny pair (--smoke): every configuration runs on every prompt of every set, the table
prints the ratios, the JSON carries the runs and their exactness against our AR (any difference of our methods is a
bug and exits 1; our fast-kernel AR's and transformers' are reported only). Measures nothing."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

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
        ["--methods", "noheads"],
        ["--sets", "poetry"],
        ["--hf", "hf-beam"],
        ["--temperature", "-1"],
        ["--max-new-tokens", "0"],
        ["--repeats", "0"],
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
    configs = ["ours-ar", "ours-ar-fast", "ours-default", "ours-specexec-8", "ours-chain-2", *bench.HF_CONFIGS]
    assert [c["name"] for c in rep["meta"]["configs"]] == configs
    assert [c["name"] for c in rep["meta"]["configs"] if not c["invariant"]] == ["ours-ar-fast"]
    assert "invariant_tiling" in rep["meta"]
    assert rep["meta"]["smoke"] and rep["meta"]["max_new_tokens"] == 8 and rep["meta"]["prompts_per_set"] == 1
    runs = rep["runs"]
    assert len(runs) == len(bench.SETS) * len(configs)
    for r in runs:
        assert 1 <= r["tokens"] <= 8 and r["seconds"] > 0 and r["tok_s"] > 0 and r["tokens_per_step"] > 0
    # greedy: every run of ours on invariant passes must reproduce our AR's tokens, and does; the fast-kernel AR
    # and transformers' runs are compared for information only
    for r in runs:
        if r["config"] != "ours-ar":
            assert r["must_match_ar"] == (r["config"].startswith("ours-") and r["config"] != "ours-ar-fast"), r
    assert all(r["match_ar"] for r in runs if r.get("must_match_ar"))
    # interleaved, the order rotating per prompt: the first configuration differs between the sets' prompts
    assert len({r["config"] for r in runs if r["order"] == 0}) == 3
    for d in rep["sets"].values():
        assert list(d["configs"]) == configs and d["best_hf_speculative"] in bench.HF_SPECULATIVE
        assert d["configs"]["ours-ar"]["vs_our_ar"] == pytest.approx(1.0)
        assert d["configs"]["ours-ar-fast"]["vs_our_fast_ar"] == pytest.approx(1.0)
        assert d["configs"]["ours-ar-fast"]["must_match_ar"] is False
        s = d["configs"]["ours-default"]
        assert s["vs_our_ar"] > 0 and s["vs_our_fast_ar"] > 0 and s["vs_best_hf_speculative"] > 0
        assert s["mismatches"] == 0 and s["must_match_ar"] is True
    printed = capsys.readouterr().out
    header = (
        "| config | tok/s | × our AR | × fast AR | × best HF spec | min/prompt × our AR | decode tok/s | tokens/step |"
    )
    assert printed.count(header) == 3 and printed.count("| ours-default |") == 3 and "SMOKE RUN" in printed
    assert printed.count("| ours-ar-fast |") == 3 and "(fast kernels: reported, not asserted)" in printed
    assert md.read_text() in printed


def test_the_fast_kernel_ar_is_a_default_configuration_that_can_be_left_out(bench):
    names = [c.name for c in bench.parse_args(["--methods", "ngram", "--hf", ""]).configs]
    assert names == ["ours-ar", "ours-ar-fast", "ours-default", "ours-ngram"]
    names = [c.name for c in bench.parse_args(["--no-fast-ar", "--hf", "hf-ar"]).configs]
    assert names == ["ours-ar", "ours-default", "hf-ar"]


def test_a_fast_kernel_run_leaves_the_engine_invariant_with_what_it_measured(bench, tiny_pair):
    """ours-ar-fast runs on the fastest per-shape kernels; afterwards the target is back on the same invariant tiling
    (the same bits as the runs before it) and the default does not measure its costs again (what it learnt before
    the fast run is kept)."""
    target, draft = tiny_pair
    args = bench.parse_args(["--smoke", "--target", str(target), "--draft", str(draft), "--hf", ""])
    configs = {c.name: c for c in args.configs}
    runner = bench.Runner(args, list(configs.values()))
    engine = runner.engine
    invariant = engine.target.tiling
    tilings = []
    generate = engine.generate

    def spy(*a: Any, **k: Any) -> Any:
        tilings.append(engine.target.tiling)
        return generate(*a, **k)

    engine.generate = spy
    ids = runner.encode(bench.Prompt("p", "def add(a, b):\n", set="code"))
    runner.run(configs["ours-default"], ids, 4, None)  # measures the auto budget's costs
    fast = runner.run(configs["ours-ar-fast"], ids, 4, None)
    again = runner.run(configs["ours-default"], ids, 4, None)
    assert tilings[1] is None and tilings[2] == invariant and engine.target.tiling == invariant
    assert fast["tokens"] > 0 and "costs_s" not in again


class StubRunner:
    """run_all's view of a Runner without models: each configuration's tokens are given."""

    def __init__(self, ids: dict[str, list[int]], temperature: float = 0.0) -> None:
        self.ids = ids
        self.args = argparse.Namespace(temperature=temperature, seed=0)

    def encode(self, p: Any) -> list[int]:
        return [1, 2, 3]

    def run(self, c: Any, ids: list[int], max_new: int, seed: int | None) -> dict[str, Any]:
        out = self.ids[c.name]
        return {
            "tokens": len(out),
            "seconds": 1.0,
            "tok_s": float(len(out)),
            "steps": len(out),
            "tokens_per_step": 1.0,
            "ids": out,
        }

    def tie_check(self, ids: list[int], ref: list[int], i: int, seed: int | None) -> dict[str, Any]:
        return {"first_diff_gap": 3.5}


def stub_run(bench: Any, ids: dict[str, list[int]], methods: str, hf: str, temperature: float = 0.0):
    configs = bench.parse_args(["--methods", methods, "--hf", hf]).configs
    prompts = {"code": [bench.Prompt("p", "x", set="code")]}
    records = bench.run_all(StubRunner(ids, temperature), prompts, configs, 4, lambda s: None)
    return configs, records, bench.summarize(records, configs, temperature == 0)


def test_any_difference_of_our_methods_from_our_ar_is_a_bug_and_exits_1(bench, capsys):
    """Greedy: a method of ours that leaves our AR's tokens, even at a small top-2 gap, is a mismatch that the table
    marks and the verdict names (with its first differing token and the gap) and fails; the fast-kernel AR's and
    transformers' differences are reported, not failed."""
    ar = [5, 6, 7, 8]
    ids = {"ours-ar": ar, "ours-ar-fast": [5, 6, 9, 8], "ours-default": ar, "ours-ngram": [5, 6, 7, 9]}
    configs, records, sets = stub_run(bench, {**ids, "hf-ar": [4, 4, 4, 4]}, "ngram", "hf-ar")
    rows = {r["config"]: r for r in records}
    assert rows["ours-ngram"]["match_ar"] is False and rows["ours-ngram"]["must_match_ar"] is True
    assert rows["ours-ngram"]["first_diff"] == 3 and rows["ours-ngram"]["first_diff_gap"] == 3.5
    assert rows["ours-ar-fast"]["match_ar"] is False and rows["ours-ar-fast"]["must_match_ar"] is False
    assert rows["hf-ar"]["match_ar"] is False and rows["hf-ar"]["must_match_ar"] is False
    summ = sets["code"]["configs"]
    assert summ["ours-ngram"]["mismatches"] == 1 and summ["ours-default"]["mismatches"] == 0
    assert bench._verdict(records) == 1
    err = capsys.readouterr().err
    assert "code p ours-ngram: differs from our AR at token 3, top-2 gap 3.5" in err
    assert "1 runs of our methods differ from our AR" in err and "ours-ar-fast" not in err
    # only the informational ones differ: exit 0
    ok = {**ids, "ours-ngram": ar, "hf-ar": [4, 4, 4, 4]}
    assert bench._verdict(stub_run(bench, ok, "ngram", "hf-ar")[1]) == 0


def test_sampled_runs_compare_the_tree_walk_methods_and_our_fast_ar_but_not_chains(bench):
    """Sampling: the tree-walk methods (default, specexec, ngram) must equal our AR with the same seed, our fast AR
    is compared for information; chain runs (the speculative sampling rule) and transformers' are not compared."""
    ar = [5, 6, 7, 8]
    names = ["ours-ar", "ours-ar-fast", "ours-default", "ours-specexec-8", "ours-ngram", "ours-chain-2", "hf-ar"]
    ids = {n: ar for n in names} | {"ours-chain-2": [1, 1, 1, 1], "hf-ar": [2, 2, 2, 2]}
    configs, records, sets = stub_run(bench, ids, "specexec:8,ngram,chain:2", "hf-ar", temperature=0.7)
    rows = {r["config"]: r for r in records}
    assert {n for n, r in rows.items() if "match_ar" in r} == {
        "ours-ar-fast",
        "ours-default",
        "ours-specexec-8",
        "ours-ngram",
    }
    assert all(r["match_ar"] for r in rows.values() if "match_ar" in r)
    assert bench._verdict(records) == 0
    report = {"meta": {**META, "temperature": 0.7}, "sets": sets}
    table = bench.markdown(report)
    assert "| ours-chain-2 |" in table and table.count("0/1 |") == 3 and "0/1 (fast kernels" in table


META = {
    "target": "t",
    "draft": "d",
    "date": "now",
    "machine": "m",
    "torch": "x",
    "threads": 1,
    "transformers": "y",
    "dtype": "float32",
    "max_new_tokens": 4,
    "prompts_per_set": 1,
    "commit": "c",
}


def test_no_invariant_runs_all_of_ours_on_fast_kernels_and_reports_differences(bench):
    args = bench.parse_args(["--no-invariant", "--hf", ""])
    ours = [c for c in args.configs if c.side == "ours"]
    assert [c.name for c in ours] == ["ours-ar", "ours-default"] and not any(c.invariant for c in ours)
    assert args.invariant is False


class NoisyRunner(StubRunner):
    """A StubRunner whose our-side runs take the seconds a list gives, in call order."""

    def __init__(self, ids: dict[str, list[int]], seconds: dict[str, list[float]]) -> None:
        super().__init__(ids)
        self.seconds = {k: list(v) for k, v in seconds.items()}
        self.calls: list[str] = []

    def run(self, c: Any, ids: list[int], max_new: int, seed: int | None) -> dict[str, Any]:
        rec = super().run(c, ids, max_new, seed)
        self.calls.append(c.name)
        sec = self.seconds[c.name].pop(0) if c.name in self.seconds else 1.0
        return {**rec, "seconds": sec, "tok_s": rec["tokens"] / sec}


def test_repeats_run_ours_again_and_compare_each_prompt_at_its_median(bench):
    """--repeats 3: our configurations run three times on the prompt (transformers' once), every run is compared
    with our AR's tokens, a prompt's ratio is taken at the medians (one slow run of the default does not set the
    lowest prompt), the set's tok/s over all runs, and our AR's second run against its first is the noise shown."""
    ar = [5, 6, 7, 8]
    configs = bench.parse_args(["--hf", "hf-ar", "--no-fast-ar", "--repeats", "3"]).configs
    runner = NoisyRunner(
        {"ours-ar": ar, "ours-default": ar, "hf-ar": ar},
        {"ours-ar": [1.0, 1.1, 1.0], "ours-default": [2.0, 0.8, 0.8]},
    )
    prompts = {"code": [bench.Prompt("p", "x", set="code")]}
    records = bench.run_all(runner, prompts, configs, 4, lambda s: None, repeats=3)
    assert sorted(runner.calls) == ["hf-ar", *["ours-ar"] * 3, *["ours-default"] * 3]
    assert [r["repeat"] for r in records if r["config"] == "ours-default"] == [0, 1, 2]
    assert all(r["match_ar"] for r in records if r["config"] == "ours-default")
    s = bench.summarize(records, configs, True)["code"]["configs"]
    assert s["ours-default"]["prompts"] == 1 and s["ours-default"]["runs"] == 3
    assert s["ours-default"]["min_prompt_vs_our_ar"] == pytest.approx(1.25)  # 5 tok/s against 4
    assert s["ours-default"]["tok_s"] == pytest.approx(12 / 3.6)
    assert s["ours-ar"]["min_prompt_rerun_vs_first"] == pytest.approx(1 / 1.1)
    once = NoisyRunner({"ours-ar": ar, "ours-default": ar, "hf-ar": ar}, {})
    one = bench.run_all(once, prompts, configs, 4, lambda s: None)
    assert bench.summarize(one, configs, True)["code"]["configs"]["ours-ar"]["min_prompt_rerun_vs_first"] is None
