"""Smoke tests of the benchmark scripts in scripts/: each answers --help, refuses bad options with exit code 2, and
runs end to end on tiny random models on the CPU where it can (their numbers mean nothing; the flow, the table and
the JSON fields are what is checked). bench_cpu.py has its own file, tests/test_bench_cpu.py; its llama.cpp
comparison (output parsing against recorded output of the real binaries, stand-in binaries) is tested here."""

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
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))


def script(name: str) -> Any:
    return importlib.import_module(f"scripts.{name}")


def test_the_scripts_are_the_kept_ones():
    assert SCRIPTS == [
        "bench_before_after.py",
        "bench_cpu.py",
        "bench_gpu.py",
        "bench_offload.py",
        "bench_server.py",
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


def test_bench_gpu_projects_measured_acceptance_onto_24_gb_cards(tmp_path, capsys):
    """--acceptance --smoke measures tokens/step per fixed budget (a planted tiny pair, the same text at every
    budget); --project joins them with the recorded H100 profile, or a bench_offload.py one, into a table labelled a
    projection, with an AR row and the published anchors."""
    mod, acc = script("bench_gpu"), tmp_path / "acc.json"
    argv = ["--acceptance", str(acc), "--smoke", "--budgets", "4,8", "--prompts", "1", "--max-new-tokens", "6"]
    assert mod.main(argv) == 0
    rep = json.loads(acc.read_text())
    assert list(rep["budgets"]) == ["4", "8"] and rep["same_tokens_across_budgets"] and rep["smoke"]
    for r in rep["budgets"].values():
        assert r["prompts"] == 1 and r["steps"] >= 1 and r["tokens_per_step"] >= 1 and r["verify_tokens"] > 1
        assert r["draft_passes_per_step"] > 0 and list(r["per_set_tokens_per_step"]) == ["planted"]
    assert mod.main(["--project", "--acceptance", str(acc)]) == 0
    printed = capsys.readouterr().out
    proj = json.loads(acc.with_suffix(".projection.json").read_text())
    assert [r["budget"] for r in proj["rows"]] == ["AR", "4", "8"] and proj["note"] == "projection, not a measurement"
    assert proj["rows"][0]["PCIe 4.0"]["step_s"] == pytest.approx(80 * 0.481 / 24)  # AR: 80 NF4 layers' copies
    assert "### Projection, not a measurement" in printed and "| PCIe 4.0 tok/s, projection |" in printed
    assert "| PCIe 5.0 (56 GB/s) step s, projection |" in printed and "| AR | 1.00 | 1 | 0.0 |" in printed
    for row in ("| 4 |", "| 8 |", "| 8.6 chat / 11.4 code |", "| 5.66 |", "| ~2–3 |", "recorded in shared/GPU.md"):
        assert row in printed
    # a bench_offload.py --profile-out profile: nf4, invariant passes, the smallest prefix >= 1024
    passes = [
        dict(format=f, tokens=t, prefix=p, mode=m, compute_s_per_layer=c, forward_s_per_layer=c)
        for f, p, m, c in [
            ("nf4", 1024, "invariant", 0.01),
            ("nf4", 1024, "fast", 0.5),
            ("nf4", 4096, "invariant", 0.5),
        ]
        + [("bf16", 1024, "invariant", 0.5), ("nf4", 512, "invariant", 0.5)]
        for t in (1, 4096)
    ]
    profile = {"device": "Fake GPU", "h2d_pinned_gbps": 50.0, "layer_bytes": {"nf4": 0.5e9}, "layers": {}}
    (tmp_path / "p.json").write_text(json.dumps({**profile, "passes": passes}))
    argv = ["--project", "--acceptance", str(acc), "--profile", str(tmp_path / "p.json"), "--out", str(tmp_path / "o")]
    assert mod.main([*argv, "--consumer-factor", "3"]) == 0
    assert "Fake GPU, profile p.json (nf4, invariant, prefix 1024)" in capsys.readouterr().out
    rows = json.loads((tmp_path / "o").read_text())["rows"]
    assert rows[0]["PCIe 5.0"]["step_s"] == pytest.approx(80 * 0.03)  # compute-bound: 3 x 10 ms > 0.5 GB / 56 GB/s


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
        ["--project"],
        ["--profile", "p.json"],
        ["--project", "--acceptance", "a.json", "--resident-layers", "81"],
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


def test_bench_server_smoke_drives_a_served_tiny_pair_with_concurrent_openai_clients(json_tiny_pair, tmp_path, capsys,
                                                                                   monkeypatch):  # fmt: skip
    """bench_server.py starts ``specexec serve`` at each --parallel, drives it at each client count, checks every
    greedy answer against the 1-client ones and reports the resent conversation; exit 0."""
    target, draft = json_tiny_pair
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "home"))
    out, md = tmp_path / "server.json", tmp_path / "server.md"
    argv = ["--smoke", "--target", str(target), "--draft", str(draft), "--context", "1024", "--parallel", "1,3"]
    argv += ["--clients", "1,3", "--requests", "3", "--max-tokens", "12", "--out", str(out), "--md", str(md)]
    assert script("bench_server").main(argv) == 0
    rep = json.loads(out.read_text())
    assert [r["parallel"] for r in rep["runs"]] == [1, 3] and rep["mismatches"] == 0
    assert all([row["clients"] for row in r["rows"]] == [1, 3] for r in rep["runs"])
    assert rep["runs"][1]["health"]["parallel"] == 3 and rep["resend"]["first_ttft_s"] > 0
    assert "| 3 | 3 |" in md.read_text()


@pytest.mark.parametrize("bad", [["--clients", "2,4"], ["--parallel", "0"], ["--requests", "99"], ["--clients", "x"]])
def test_bench_server_refuses_bad_options_with_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        script("bench_server").main(bad)
    assert e.value.code == 2


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


# ---------------------------------------------------------------------------------------------- bench_cpu: llama.cpp
# What llama.cpp's binaries wrote (build 0.3.36's vendored llama.cpp, CPU, 2 threads) for the prompt
# 'def add(a, b):\n    """Return a + b."""\n' with -n 4, greedy: llama-completion (-no-cnv --no-display-prompt) and
# llama-speculative-simple (--spec-type draft-simple, the 1.5B target and 0.5B draft).

LLAMA_AR_STDERR = """\
0.00.002.228 I llama_completion: llama backend init
0.00.005.251 I llama_completion: load the model and apply lora adapter, if any
0.00.935.873 W load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model. its type will be overridden
0.02.283.240 I cmn          init: llama threadpool init, n_threads = 2
0.02.403.988 I\x20
0.02.404.179 I system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |\x20
0.02.404.204 I\x20
0.02.404.373 I sampler seed: 0
0.02.404.412 I sampler params:\x20
\trepeat_last_n = 64, repeat_penalty = 1.000, frequency_penalty = 0.000, presence_penalty = 0.000
\tdry_multiplier = 0.000, dry_base = 1.750, dry_allowed_length = 2, dry_penalty_last_n = 64
\ttop_k = 1, top_p = 0.950, min_p = 0.050, xtc_probability = 0.000, xtc_threshold = 0.100, typical_p = 1.000, top_n_sigma = -1.000, temp = 0.000
\tmirostat = 0, mirostat_lr = 0.100, mirostat_ent = 5.000, adaptive_target = -1.000, adaptive_decay = 0.900
0.02.404.494 I sampler chain: logits -> logit-bias -> ?penalties -> ?dry -> ?top-n-sigma -> top-k -> ?typical -> top-p -> min-p -> ?xtc -> temp-ext -> dist\x20
0.02.404.496 I generate: n_ctx = 4096, n_batch = 2048, n_predict = 4, n_keep = 0
0.02.404.496 I\x20
0.03.150.241 I common_perf_print:    sampling time =       1.78 ms
0.03.150.246 I common_perf_print:    samplers time =       0.60 ms /    17 tokens
0.03.150.253 I common_perf_print:        load time =    1675.27 ms
0.03.150.255 I common_perf_print: prompt eval time =     540.98 ms /    13 tokens (   41.61 ms per token,    24.03 tokens per second)
0.03.150.257 I common_perf_print:        eval time =     202.51 ms /     3 runs   (   67.50 ms per token,    14.81 tokens per second)
0.03.150.258 I common_perf_print:       total time =     746.28 ms /    16 tokens
0.03.150.259 I common_perf_print: unaccounted time =       1.01 ms /   0.1 %      (total - sampling - prompt eval - eval) / (total)
0.03.150.260 I common_perf_print:    graphs reused =          2
"""  # noqa: E501

LLAMA_AR_STDOUT = "\n    return a\n\n"
LLAMA_SPEC_STDERR = """\
0.01.469.469 W load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model. its type will be overridden
0.02.635.879 I cmn          init: llama threadpool init, n_threads = 2
0.02.739.518 I common_speculative_init_result: loading draft model '/work/cache/gguf/qwen2.5-coder-0.5b.gguf'
0.03.099.008 W load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model. its type will be overridden
0.06.342.508 I encoded   13 tokens in    0.528 seconds, speed:   24.627 t/s
0.06.342.535 I decoded    8 tokens in    0.855 seconds, speed:    9.356 t/s
0.06.342.554 I\x20
0.06.342.572 I n_draft   = 3
0.06.342.591 I n_predict = 8
0.06.342.609 I n_drafted = 8
0.06.342.628 I n_accept  = 5
0.06.342.647 I accept    = 62.500%
0.06.342.665 I\x20
0.06.342.684 I draft:

0.06.342.756 I\x20
0.06.342.776 I target:

0.06.342.801 I common_perf_print:    sampling time =       3.40 ms
0.06.342.821 I common_perf_print:    samplers time =       0.82 ms /     8 tokens
0.06.342.845 I common_perf_print:        load time =    1466.39 ms
0.06.342.865 I common_perf_print: prompt eval time =    1085.84 ms /    25 tokens (   43.43 ms per token,    23.02 tokens per second)
0.06.342.885 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
0.06.342.904 I common_perf_print:       total time =    3603.40 ms /    26 tokens
0.06.342.924 I common_perf_print: unaccounted time =    2514.15 ms /  69.8 %      (total - sampling - prompt eval - eval) / (total)
0.06.342.943 I common_perf_print:    graphs reused =          1
"""  # noqa: E501

LLAMA_SPEC_STDOUT = '\n\ndef add(a, b):\n    """Return a + b."""\n    return a + b\n\ndef\n\n\n\n'
LLAMA_PROMPT = 'def add(a, b):\n    """Return a + b."""\n'


def test_bench_cpu_reads_llama_cpp_decode_speed_and_acceptance_from_its_output():
    bench = script("bench_cpu")
    ar = bench.llama_record(bench.LLAMA_AR, LLAMA_AR_STDOUT, LLAMA_AR_STDERR, LLAMA_PROMPT, 3.3)
    # decode only: 3 eval runs in 202.51 ms (the first of the 4 tokens comes from the prompt pass)
    assert ar["tokens"] == 4 and ar["decode_tokens"] == 3 and ar["decode_s"] == pytest.approx(0.20251)
    assert ar["decode_tok_s"] == pytest.approx(14.81, abs=0.01) and ar["prefill_s"] == pytest.approx(0.54098)
    assert ar["llama_prompt_tokens"] == 13 and ar["load_s"] == pytest.approx(1.67527)
    assert ar["tok_s"] == pytest.approx(4 / 3.3) and ar["text80"] == LLAMA_AR_STDOUT
    spec = bench.llama_record(bench.LLAMA_SPEC, LLAMA_SPEC_STDOUT, LLAMA_SPEC_STDERR, LLAMA_PROMPT, 6.5)
    # its own count (past -n 4) and clock; the prompt it echoes is not its text
    assert spec["tokens"] == 8 and spec["decode_tok_s"] == pytest.approx(8 / 0.855)
    assert spec["prefill_s"] == pytest.approx(0.528) and spec["llama_prompt_tokens"] == 13
    assert (spec["n_draft"], spec["n_drafted"], spec["n_accept"], spec["accept_pct"]) == (3, 8, 5, 62.5)
    assert spec["text80"].startswith("    return a + b") and spec["steps"] is None
    with pytest.raises(ValueError, match="eval time"):
        bench.llama_record(bench.LLAMA_AR, "", LLAMA_SPEC_STDERR.replace("eval time", "x"), LLAMA_PROMPT, 1.0)
    with pytest.raises(ValueError, match="decoded"):
        bench.llama_record(bench.LLAMA_SPEC, "", LLAMA_AR_STDERR, LLAMA_PROMPT, 1.0)


def test_bench_cpu_reads_llama_perf_lines_whatever_their_prefix_and_skips_the_drafts():
    log = (
        "llama_perf_context_print:        load time =     100.00 ms\n"
        "llama_perf_context_print: prompt eval time =      50.00 ms /    10 tokens (5 ms per token, 200 t/s)\n"
        "llama_perf_context_print:        eval time =     400.00 ms /    20 runs   (20 ms per token, 50 t/s)\n"
        "draft:\n"
        "llama_perf_context_print:        eval time =      10.00 ms /    99 runs   (0.1 ms per token, 9900 t/s)\n"
    )
    got = script("bench_cpu").parse_llama(log)
    assert got == {"load_ms": 100.0, "prompt_ms": 50.0, "prompt_tokens": 10, "eval_ms": 400.0, "eval_runs": 20}


def test_bench_cpu_without_the_llama_cpp_binaries_is_one_line_and_exit_2_before_loading(tmp_path, capsys):
    bench = script("bench_cpu")
    absent = str(tmp_path / "no-such-model")  # loading it would fail otherwise
    argv = ["--smoke", "--target", absent, "--draft", absent, "--llama-cpp", str(tmp_path)]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama-completion" in err[0] and "llama-speculative-simple" in err[0]
    fake_llama_cpp(tmp_path / "bin", tmp_path / "calls.jsonl")  # the binaries, but no GGUF files
    argv = ["--smoke", "--target", absent, "--draft", absent, "--llama-cpp", str(tmp_path / "bin")]
    assert bench.main([*argv, "--gguf-target", str(tmp_path / "t.gguf"), "--gguf-draft", absent]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "t.gguf" in err[0] and "llama-completion" not in err[0]


def test_bench_cpu_target_dtype_sets_how_our_target_loads(capsys):
    bench = script("bench_cpu")
    assert bench.target_load("int8", "auto") == ("int8", "auto")
    assert bench.target_load("auto", "auto") == ("auto", "auto")
    assert bench.target_load("bf16", "auto") == ("bf16", "bf16")
    assert bench.target_load("fp32", "auto") == ("auto", "fp32")
    for bad in (["--target-dtype", "int8", "--dtype", "fp32"], ["--target-dtype", "bf16", "--dtype", "fp32"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(bad)
        assert e.value.code == 2
    assert "--dtype" in capsys.readouterr().err


def fake_llama_cpp(bin_dir: Path, calls: Path) -> None:
    """llama-completion and llama-speculative-simple stand-ins: each writes the recorded output of the real binary
    (the speculative one echoing its prompt first, as the real one does) and logs its arguments and prompt."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    outputs = {
        "llama-completion": ("", LLAMA_AR_STDOUT, LLAMA_AR_STDERR),
        "llama-speculative-simple": ("\n\n", "    return a + b\n\ndef\n", LLAMA_SPEC_STDERR),
    }
    for name, (before, after, err) in outputs.items():
        f = bin_dir / name
        f.write_text(
            f"#!{sys.executable}\n"
            "import json, pathlib, sys\n"
            "argv = sys.argv[1:]\n"
            "if argv == ['--version']:\n"
            "    print('version: 1 (fake)', file=sys.stderr)\n"
            "    sys.exit(0)\n"
            "prompt = pathlib.Path(argv[argv.index('-f') + 1]).read_text(encoding='utf-8')\n"
            f"with open({str(calls)!r}, 'a') as log:\n"
            f"    log.write(json.dumps({{'bin': {name!r}, 'argv': argv, 'prompt': prompt}}) + '\\n')\n"
            f"sys.stdout.write({before!r} + ({'prompt' if before else repr('')}) + {after!r})\n"
            f"sys.stderr.write({err!r})\n"
        )
        f.chmod(0o755)


def test_bench_cpu_smoke_runs_llama_cpp_in_the_rotation_and_tables_its_decode_speed(tiny_pair, tmp_path, capsys):
    """With --llama-cpp (stand-ins giving the real binaries' recorded output), llama.cpp AR and spec run on every
    prompt beside ours, get the text ours tokenizes, greedy, -n, our thread count, no EOS stop; the per-set table
    puts our decode tok/s beside theirs; their tokens are not compared with ours."""
    bench = script("bench_cpu")
    target, draft = tiny_pair
    calls, out = tmp_path / "calls.jsonl", tmp_path / "cpu.json"
    fake_llama_cpp(tmp_path / "bin", calls)
    gguf = tmp_path / "t.gguf", tmp_path / "d.gguf"
    for g in gguf:
        g.write_bytes(b"GGUF")
    argv = ["--smoke", "--quiet", "--target", str(target), "--draft", str(draft), "--hf", "", "--no-fast-ar"]
    argv += ["--sets", "code,grounded", "--target-dtype", "fp32", "--out", str(out)]
    argv += ["--llama-cpp", str(tmp_path / "bin")]
    assert bench.main([*argv, "--gguf-target", str(gguf[0]), "--gguf-draft", str(gguf[1])]) == 0
    rep = json.loads(out.read_text())
    m = rep["meta"]
    assert m["target_weights"] == "dense" and m["dtype"] == "float32" and m["target_dtype"] == "fp32"
    assert m["llama_cpp"]["version"] == "version: 1 (fake)"
    names = [c["name"] for c in m["configs"]]
    assert names == ["ours-ar", "ours-default", "llama.cpp-ar", "llama.cpp-spec"]
    runs = {(r["set"], r["config"]): r for r in rep["runs"]}
    assert len(runs) == 2 * len(names)
    for s in ("code", "grounded"):
        ar, spec = runs[(s, "llama.cpp-ar")], runs[(s, "llama.cpp-spec")]
        assert ar["decode_tok_s"] == pytest.approx(3 / 0.20251) and spec["decode_tok_s"] == pytest.approx(8 / 0.855)
        assert spec["text80"] == "    return a + b\n\ndef\n" and "match_ar" not in ar and "match_ar" not in spec
        d = rep["sets"][s]["decode"]
        assert d["llama_ar"] == pytest.approx(3 / 0.20251) and d["llama_spec_accept"] == pytest.approx(5 / 8)
        assert d["default_vs_llama_ar"] == pytest.approx(d["ours_default"] / d["llama_ar"])
        assert d["default_vs_our_ar"] == pytest.approx(d["ours_default"] / d["ours_ar"])
    # the calls: warm-up, then one per prompt (code, grounded) for each binary
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [c["bin"] for c in logged].count("llama-completion") == 3
    threads = str(torch.get_num_threads())
    for c in logged:
        a = c["argv"]
        assert a[a.index("-n") + 1] in ("2", "8") and a[a.index("-t") + 1] == threads
        assert a[a.index("--temp") + 1] == "0" and a[a.index("--top-k") + 1] == "1" and "--ignore-eos" in a
        assert a[a.index("-m") + 1] == str(gguf[0]) and "--no-escape" in a
        if c["bin"] == "llama-completion":
            assert "-no-cnv" in a and "--no-display-prompt" in a
        else:
            assert a[a.index("--spec-type") + 1] == "draft-simple" and a[a.index("-md") + 1] == str(gguf[1])
    # the text our engine tokenizes: raw for the code prompt, the chat template's rendering for the grounded one
    prompts = {p.set: p for ps in bench.build_prompts(("code", "grounded"), 1).values() for p in ps}
    given = {c["prompt"] for c in logged[2:]}
    assert prompts["code"].text in given
    chat = [t for t in given if t != prompts["code"].text]
    assert chat and all(t.startswith("t3 ") and t.endswith("t5") and prompts["grounded"].text in t for t in chat)
    printed = capsys.readouterr().out
    assert "| llama.cpp AR | llama.cpp spec |" in printed and "| llama.cpp-spec |" in printed
    row = next(ln for ln in printed.splitlines() if ln.startswith("| code |"))
    assert f"| {3 / 0.20251:.2f} | {8 / 0.855:.2f} | 62.5% |" in row


def test_the_device_check_runs_its_steps_and_writes_a_device_profile_in_smoke_mode(tmp_path, capsys):
    """The prepared device call on the CPU at tiny shapes: each step exits 0 and leaves its log; the pass table
    holds both kernels' passes at every tree size and prefix, with launches counted, and its device profile is
    what ``bench_gpu.py --project`` reads."""
    assert script("bench_offload").main(["--device-check", str(tmp_path), "--smoke"]) == 0
    printed = capsys.readouterr().out
    for step in ("compile", "passes", "70b-nf4@24"):
        assert f"== {step}: exit 0" in printed and (tmp_path / f"{step}.log").exists()
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof["h2d_pinned_gbps"] > 0 and prof["layer_bytes"]["nf4"] > 0
    seen = {(p["mode"], p["tokens"], p["prefix"]) for p in prof["passes"]}
    assert seen == {(m, t, p) for m in ("fast", "invariant") for t in (1, 16) for p in (16, 64)}
    for p in prof["passes"]:
        assert p["forward_s_per_layer"] > 0 and p["compute_s_per_layer"] > 0 and p["launches_per_layer"] > 0
