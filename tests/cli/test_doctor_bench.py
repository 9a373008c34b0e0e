"""Smoke tests of ``specexec doctor`` and ``specexec bench`` on tiny models, plus the size arithmetic they use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specexec.cli import app
from specexec.doctor import GpuInfo, SystemInfo, recommend
from specexec.model.sizes import layer_bytes, model_weight_bytes, param_count
from specexec.model.transformer import ModelConfig
from tests.test_chat import make_chat_pair

runner = CliRunner()

LLAMA2_70B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_chat_pair(tmp_path_factory.mktemp("bench"))


def test_sizes_match_design_numbers_and_real_checkpoints(pair):
    cfg = ModelConfig.from_hf(LLAMA2_70B)
    assert layer_bytes(cfg, "bf16") / 1e9 == pytest.approx(1.711, abs=1e-3)  # 855.6M params a layer, 2 bytes each
    assert layer_bytes(cfg, "nf4") / 1e9 == pytest.approx(0.481, abs=1e-3)
    from safetensors.torch import load_file

    tiny = ModelConfig.from_hf(json.loads((pair[0] / "config.json").read_text()))
    assert param_count(tiny) == sum(t.numel() for t in load_file(pair[0] / "model.safetensors").values())


# tiny configs of the families whose layers differ from Llama's: Qwen3's q/k head norms (and a q width that is not
# the hidden size), Gemma 2's four norms a layer, Gemma 3's four norms and q/k head norms, Phi-3's fused tensors
TINY_FAMILIES = {
    "qwen3": dict(head_dim=48, tie_word_embeddings=False),
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=32, tie_word_embeddings=True),
    "gemma3_text": dict(head_dim=32, query_pre_attn_scalar=32, tie_word_embeddings=True),
    "phi3": dict(tie_word_embeddings=False, pad_token_id=0, eos_token_id=1),
}


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_sizes_of_other_families_match_transformers_and_the_loader(model_type, tmp_path):
    """param_count (what doctor and the memory checks plan with) equals the parameters transformers builds, and
    model_weight_bytes what the loader holds, dense, int8 and nf4."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specexec.loading.checkpoint import load_model, read_config
    from tests.loading.test_self_draft import _weight_bytes

    hf = dict(
        model_type=model_type,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **TINY_FAMILIES[model_type],
    )
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    model.save_pretrained(tmp_path)
    cfg = read_config(tmp_path)
    assert cfg.model_type == model_type and cfg.head_dim == hf.get("head_dim", 16)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    for fmt in ("dense", "int8", "nf4"):
        ours = load_model(tmp_path, torch.device("cpu"), torch.float32, int8=fmt == "int8", nf4=fmt == "nf4")
        assert _weight_bytes(ours) == model_weight_bytes(cfg, fmt, 4), fmt


def test_doctor_json_with_a_local_target(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))  # the disk test writes its temp file there
    result = runner.invoke(app, ["doctor", "--json", "--disk-mb", "4", "--target", str(pair[0])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    system, rec = report["system"], report["recommendation"]
    assert system["ram_total"] > 0 and system["cpu_threads"] >= 1 and system["versions"]["torch"]
    assert system["disk"]["read_gbps"] > 0 and not list(tmp_path.glob(".doctor-*"))
    if not torch.cuda.is_available():
        assert system["gpu"] is None and system["cuda_note"] == "no CUDA GPU: CPU-only mode"
        assert rec["tier"] == "cpu" and rec["dtype"] == "fp32"
    assert rec["present"] and rec["num_layers"] == 2 and rec["floor_s_per_pass"] >= 0
    from specexec.formats import native

    assert system["cpu_kernels"].startswith("built") == (native.available() is None), system["cpu_kernels"]


def test_doctor_text_and_missing_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    result = runner.invoke(app, ["doctor", "--disk-mb", "0", "-q", "--target", "nobody-xyz/not-a-model"])
    assert result.exit_code == 0, result.output
    assert "not present locally" in result.stdout and "CPU kernels" in result.stdout
    if not torch.cuda.is_available():
        assert "CPU-only" in result.stdout


def test_doctor_bad_disk_mb_is_one_error_line():
    result = runner.invoke(app, ["doctor", "--disk-mb", "-1", "-q"])
    assert result.exit_code == 2 and result.output.strip() == "error: --disk-mb must be >= 0, got -1"


def _system(vram_gb: float, ram_gb: float) -> SystemInfo:
    gpu = GpuInfo(
        name="fake 24GB",
        vram_total=int(vram_gb * 1e9),
        vram_free=int(vram_gb * 1e9),
        pinned_h2d_gbps=25.0,
        pageable_h2d_gbps=7.0,
    )
    return SystemInfo(
        cpu_model="x",
        cpu_cores=8,
        cpu_threads=16,
        ram_total=int(ram_gb * 1e9),
        ram_available=int(ram_gb * 1e9),
        gpu=gpu,
        cuda_note="",
        disk=None,
    )


def _llama2_pair(tmp_path: Path) -> tuple[Path, Path]:
    """Directories holding only the configs of Llama-2-70B (target) and 7B (draft): what doctor plans from."""
    t, d = tmp_path / "t", tmp_path / "d"
    t.mkdir()
    d.mkdir()
    (t / "config.json").write_text(json.dumps(LLAMA2_70B))
    (d / "config.json").write_text(json.dumps(LLAMA2_7B_CFG))
    return t, d


def test_recommendation_for_70b_on_a_24gb_gpu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_70B))
    rec = recommend(str(tmp_path), _system(24, 128), context=4096)
    assert rec.dtype == "nf4" and rec.tier == "ram"
    assert 0 < rec.resident_layers < 80 and rec.resident_layers + rec.streamed_layers == 80
    assert rec.floor_s_per_pass == pytest.approx(rec.streamed_layers * 0.481e9 / 25e9, rel=1e-2)
    small_ram = recommend(str(tmp_path), _system(24, 16), context=4096)
    assert small_ram.tier == "ssd"
    big = recommend(str(tmp_path), _system(200, 256), context=4096)
    assert big.dtype == "bf16" and big.tier == "none" and big.streamed_layers == 0


def test_bench_smoke(pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t10 t11 t12"}\n\n{"prompt": "t20 t21", "chat": true}\n')
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    result = runner.invoke(
        app,
        [
            "bench",
            "--target",
            str(pair[0]),
            "--draft",
            str(pair[1]),
            "--device",
            "cpu",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--budgets",
            "4,16",
            "--gammas",
            "2",
            "--out",
            str(out),
            "--plot",
            str(png),
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [(r["method"], r["param"]) for r in report["rows"]] == [
        ("ar", None),
        ("chain", 2),
        ("specexec", 4),
        ("specexec", 16),
    ]
    assert all(r["mismatches"] == 0 and r["new_tokens"] == 16 for r in report["rows"])
    assert report["rows"][0]["speedup"] == 1.0 and len(report["per_prompt"]) == 8
    assert png.stat().st_size > 1000
    assert "specexec" in result.stdout and "tok/s" in result.stdout


def test_builtin_prompts():
    from specexec.bench import builtin_prompts

    prompts = builtin_prompts(8)
    assert len(prompts) == 8 and len({p.name for p in prompts}) == 8
    assert any(p.text.startswith("def ") for p in prompts) and any(p.name.startswith("pydoc:") for p in prompts)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "0,16"], "budget must be >= 1"),
        (["--budgets", "a,b"], "comma-separated integers"),
        (["--methods", "ar,beam"], "unknown method"),
        (["--prompts", "/nonexistent/p.jsonl"], "cannot read prompts file"),
        (["--draft", "none", "--methods", "specexec"], "need a draft"),
    ],
)
def test_bench_errors(pair, args, message):
    cmd = ["bench", "--target", str(pair[0]), "--device", "cpu", "-q", "--max-new-tokens", "2"]
    if "--draft" not in args:
        cmd += ["--draft", str(pair[1])]
    result = runner.invoke(app, cmd + args)
    assert result.exit_code != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_doctor_unknown_model_exits_nonzero(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    for spec, msg in (("nosuchmodel", "unknown model alias 'nosuchmodel'"), ("./no/such/dir", "model path not found")):
        result = runner.invoke(app, ["doctor", "--disk-mb", "0", "-q", "--target", spec])
        assert result.exit_code != 0 and result.output.startswith("error: ") and msg in result.output
        assert "Traceback" not in result.output


def test_doctor_plans_an_alias_that_is_not_downloaded(tmp_path, monkeypatch):
    """llama-70b (the README's example) with empty caches and no network: planned from configs/models.toml."""
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from specexec.loading import hub

    assert not hub.is_present("llama-70b")
    rec = recommend("llama-70b", _system(24, 128), context=4096)
    assert rec.present and rec.params == pytest.approx(68.98e9, rel=1e-3) and rec.num_layers == 80
    assert rec.dtype == "nf4" and rec.tier == "ram" and 0 < rec.resident_layers < 80
    assert any("configs/models.toml" in n for n in rec.notes)
    assert recommend("llama-70b", _system(24, 16), context=4096).tier == "ssd"
    result = runner.invoke(app, ["doctor", "--json", "--disk-mb", "0", "--target", "llama-70b"])
    assert result.exit_code == 0, result.output
    cli_rec = json.loads(result.stdout)["recommendation"]
    assert cli_rec["params"] == rec.params and cli_rec["tier"] is not None and not list((tmp_path / "hf").glob("*"))


@pytest.mark.parametrize(
    "alias, published",
    [
        ("llama-70b", 68.98e9),
        ("llama-13b", 13.02e9),
        ("llama-7b", 6.74e9),
        ("llama3-70b", 70.55e9),
        ("llama3-8b", 8.03e9),
        ("llama3.1-70b", 70.55e9),
        ("llama3.1-8b", 8.03e9),
        ("llama3.2-1b", 1.236e9),
        ("mistral-7b", 7.248e9),
        ("qwen2.5-72b", 72.71e9),
        ("qwen2.5-7b", 7.616e9),
        ("qwen2.5-0.5b", 0.494e9),
        # the demo/test aliases: the converted GGUF keeps a separate lm_head (untied), so its published size + V x D
        ("qwen2.5-coder-0.5b", 0.494e9 + 151936 * 896),
        ("qwen2.5-coder-1.5b", 1.544e9 + 151936 * 1536),
        ("smollm2-135m", 0.1345e9),
    ],
)
def test_alias_architectures_match_published_sizes(alias, published):
    """configs/models.toml's architecture data gives each model's published parameter count."""
    from specexec.loading import hub

    cfg = ModelConfig.from_hf(hub.known_config(alias))
    assert param_count(cfg) == pytest.approx(published, rel=2e-3)
    assert hub.known_config(alias)["torch_dtype"] in ("float16", "bfloat16")


# Published sizes in billions, to the digits their source gives (a count passes within half a unit of the last
# digit): the model cards' totals for Qwen3 (0.6B ... 32.8B); the Hub's safetensors counts for Gemma 2, Phi-3, Llama and
# Mistral (Gemma-2-2B 2.61B ... Phi-3-medium 13.96B); the Gemma 3 technical report's table 1 (embedding +
# non-embedding parameters, e.g. 12B: 1,012M + 10,759M; the multimodal checkpoints' 417M vision encoder not counted)
FAMILY_SIZES = [
    ("qwen3-0.6b", "0.6"),
    ("qwen3-1.7b", "1.7"),
    ("qwen3-4b", "4.0"),
    ("qwen3-8b", "8.2"),
    ("qwen3-14b", "14.8"),
    ("qwen3-32b", "32.8"),
    ("gemma-2-2b", "2.61"),
    ("gemma-2-9b", "9.24"),
    ("gemma-2-27b", "27.2"),
    ("gemma-3-1b", "1.000"),
    ("gemma-3-4b", "3.88"),
    ("gemma-3-12b", "11.77"),
    ("gemma-3-27b", "27.0"),
    ("phi-3-mini", "3.82"),
    ("phi-3.5-mini", "3.82"),
    ("phi-3-medium", "13.96"),
    ("llama3.3-70b", "70.55"),
    ("deepseek-r1-distill-llama-70b", "70.55"),
    ("llama3.2-3b", "3.21"),
    ("mistral-7b-v0.1", "7.24"),
]


@pytest.mark.parametrize("alias, billions", FAMILY_SIZES)
def test_family_architectures_match_published_sizes(alias, billions):
    """The Qwen3, Gemma 2/3, Phi-3, Llama 3.x and Mistral aliases plan with their published parameter counts."""
    from specexec.loading import hub

    cfg = ModelConfig.from_hf(hub.known_config(alias))
    digits = len(billions.partition(".")[2])
    assert param_count(cfg) / 1e9 == pytest.approx(float(billions), abs=0.5 * 10**-digits)
    assert hub.known_config(alias)["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("pair_name", ["qwen3", "gemma2", "gemma3", "phi3", "llama3.3"])
def test_doctor_plans_the_new_pairs_without_a_download(pair_name, tmp_path, monkeypatch):
    """Each new [pairs] entry plans from configs/models.toml alone: no cache, no network, no file written."""
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from specexec.loading import hub

    pair = hub.pairs()[pair_name]
    assert not hub.is_present(pair.target) and not hub.is_present(pair.draft)
    rec = recommend(pair.target, _system(24, 128), context=4096, draft=pair.draft)
    assert rec.present and rec.params == param_count(ModelConfig.from_hf(hub.known_config(pair.target)))
    assert rec.tier in ("none", "ram") and any("configs/models.toml" in n for n in rec.notes)
    result = runner.invoke(app, ["doctor", "--json", "--disk-mb", "0", "--target", pair.target, "--draft", pair.draft])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["recommendation"]["params"] == rec.params
    assert not list((tmp_path / "hf").glob("*"))


LLAMA2_7B_CFG = dict(
    LLAMA2_70B,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
)


@pytest.mark.parametrize(
    "vram, want, resident_order",
    [(24, "int8", True), (16, "int8", False), (12, "nf4", False), (200, "16-bit", None)],
)
def test_doctor_weighs_the_draft_precision(tmp_path, vram, want, resident_order):
    """doctor --draft: the plan per draft precision, and --draft-dtype auto's pick (specexec.loading.draft_choice): at
    24 GB all three fit and a lighter draft leaves more target layers resident; at PCIe4's 25 GB/s and a consumer
    card's assumed 1 TB/s the int8 draft is modelled fastest; under 16 / 12 GB only the lighter ones fit; where
    nothing streams (200 GB) the 16-bit draft stays."""
    t, d = _llama2_pair(tmp_path)
    # a 1024-token context: with the CLI's default trees (auto, up to 2048 nodes) all three still fit at 24 GB
    rec = recommend(str(t), _system(vram, 256), context=1024, draft=str(d))
    opts = {o["draft_dtype"]: o for o in rec.draft_options}
    assert list(opts) == ["16-bit", "int8", "nf4"] and rec.draft_dtype == want
    assert opts["16-bit"]["draft_gb"] == pytest.approx(13.48, abs=0.05)  # a bf16 7B takes 13.5 GB
    chosen = opts[want]
    assert rec.resident_layers == chosen["resident_layers"] and chosen["fits"]
    if resident_order:  # all three fit at 24 GB: lighter drafts buy resident layers
        assert opts["16-bit"]["resident_layers"] < opts["int8"]["resident_layers"] < opts["nf4"]["resident_layers"]
    if vram < 24:
        assert not opts["16-bit"]["fits"]
    fit = {k: o for k, o in opts.items() if o["fits"]}
    if len(fit) > 1:  # the pick is the least modelled time a token, and every fitting option says it
        assert min(fit, key=lambda k: fit[k]["modelled_ms_per_token"]) == want or vram == 200
        assert all(o["keep_prior"] <= 1.0 for o in fit.values())
    if vram == 24:  # the 16-bit draft fits: each lighter one says at which keep it would only tie it
        assert 0 < opts["int8"]["break_even_keep"] < 1 and 0 < opts["nf4"]["break_even_keep"] < 1
    assert any(f"in {want} (what --draft-dtype auto loads" in n for n in rec.notes)
    plain = recommend(str(t), _system(vram, 256), context=1024)
    assert plain.draft_options == [] and plain.draft_dtype is None
    assert plain.resident_layers >= rec.resident_layers  # charging a draft never adds resident layers


def test_doctor_offers_int8_only_where_the_gpu_runs_it(tmp_path):
    """bitsandbytes' int8 matmul needs compute capability 7.5+: on an older GPU doctor weighs the 16-bit and NF4
    drafts only, as load's --draft-dtype auto does (draft_choice.lighter_formats)."""
    t, d = _llama2_pair(tmp_path)
    for cap, want in (((7, 0), ["16-bit", "nf4"]), ((8, 9), ["16-bit", "int8", "nf4"])):
        system = _system(24, 256)
        assert system.gpu is not None
        system.gpu.capability = cap
        rec = recommend(str(t), system, context=4096, draft=str(d))
        assert [o["draft_dtype"] for o in rec.draft_options] == want


def test_doctor_lowers_the_max_budget_as_load_does(tmp_path):
    """70B NF4 + 7B at 12 GB with a 4096-token context: the default trees' reservation (auto, up to 2048 nodes)
    leaves no room for the streamed target beside any draft format, so doctor -- like load -- halves --max-budget
    until one fits, and says so; at 24 GB nothing is lowered."""
    t, d = _llama2_pair(tmp_path)
    rec = recommend(str(t), _system(12, 256), context=4096, draft=str(d))
    assert rec.max_budget is not None and 64 <= rec.max_budget < 2048 and rec.draft_dtype == "nf4"
    assert any(n.startswith(f"--max-budget lowered to {rec.max_budget}") for n in rec.notes)
    assert recommend(str(t), _system(24, 256), context=4096, draft=str(d)).max_budget is None


def test_doctor_draft_that_never_fits(tmp_path):
    t, d = _llama2_pair(tmp_path)
    rec = recommend(str(t), _system(8, 256), context=4096, draft=str(d))
    assert rec.tier == "does-not-fit" and rec.draft_dtype is None
    assert not any(o["fits"] for o in rec.draft_options)
    assert "VRAM too small" in rec.notes[-1] and rec.notes[-1].endswith("(the draft in 16-bit, int8, nf4)")


def test_doctor_draft_needs_a_target():
    result = CliRunner().invoke(app, ["doctor", "--draft", "x", "--disk-mb", "0"])
    assert result.exit_code == 2 and "--draft needs --target" in result.output


def test_doctor_plans_a_self_derived_draft(tmp_path):
    """doctor --draft self: the target's own weights planned in nf4, what --draft self loads on a GPU (never
    16-bit); a 70B self draft does not fit at 24 GB (docs/BENCHMARKS.md), and on an 80 GB GPU it leaves fewer of
    the target's layers resident than no draft does."""
    t = tmp_path / "t"
    t.mkdir()
    (t / "config.json").write_text(json.dumps(LLAMA2_70B))
    small = recommend(str(t), _system(24, 256), context=4096, draft="self")
    assert [o["draft_dtype"] for o in small.draft_options] == ["nf4"]
    assert small.tier == "does-not-fit" and not small.draft_options[0]["fits"]
    big = recommend(str(t), _system(80, 256), context=4096, draft="self")
    assert big.draft_options[0]["fits"] and big.draft_dtype == "nf4"
    assert big.draft_options[0]["draft_gb"] == pytest.approx(
        model_weight_bytes(ModelConfig.from_hf(LLAMA2_70B), "nf4", 2) / 1e9
    )
    assert any("self-derived draft (the target's own weights) in nf4" in n for n in big.notes), big.notes
    alone = recommend(str(t), _system(80, 256), context=4096)
    assert 0 < big.resident_layers < alone.resident_layers


def test_doctor_shows_the_cached_probes_and_remeasures_them(tmp_path, monkeypatch):
    from specexec import doctor, quiet
    from specexec.loading import cpu_probe

    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    busy = {"now": True}
    monkeypatch.setattr(quiet, "sample", quiet.simulated(lambda: busy["now"]))
    runs: list[str] = []

    def fake(kind: str, ms: dict):  # a probe's figures without timing anything
        return lambda *a, **kw: runs.append(kind) or ms

    one = {"1": 4.0, "32": 8.0}
    monkeypatch.setattr(cpu_probe, "measure", fake("dtype", {"fp32": one, "bf16": one, "bf16_transposed": {}}))
    monkeypatch.setattr(
        cpu_probe, "measure_orientation", fake("orient", {"linear": {"2": 1.0}, "transposed": {"2": 2.0}})
    )
    formats = {"dense": {"1": 4.0, "8": 8.0}, "q4": {"1": 1.0, "8": 3.0}}
    monkeypatch.setattr(cpu_probe, "measure_target", fake("target", formats))
    monkeypatch.setattr(cpu_probe, "measure_formats", fake("draft", formats))
    monkeypatch.setattr(cpu_probe, "target_formats", lambda: ("q4",))
    monkeypatch.setattr(cpu_probe, "draft_formats", lambda: ("q4",))
    cpu_probe.choose_target(ModelConfig.from_hf(LLAMA2_70B))
    assert runs == ["dtype", "target"]

    result = runner.invoke(app, ["doctor", "--disk-mb", "0", "-q"])
    assert result.exit_code == 0, result.output
    assert (
        "cached measurements" in result.stdout
        and "target format (provisional)" in result.stdout
        and "busy" in result.stdout
    )
    report = json.loads(runner.invoke(app, ["doctor", "--disk-mb", "0", "--json"]).stdout)
    kinds = {p["kind"]: p for p in report["probes"]}
    assert set(kinds) == {"cpu dtype", "cpu target format"} and kinds["cpu target format"]["provisional"]
    assert kinds["cpu target format"]["measured_at"] > 0 and kinds["cpu target format"]["load"]["busy"]

    (tmp_path / "costs").mkdir()
    (tmp_path / "costs" / "abc.json").write_text("{}")
    assert "pass costs" in {p.kind for p in doctor.probes()}
    busy["now"] = False
    result = runner.invoke(app, ["doctor", "--disk-mb", "0", "-q", "--remeasure"])  # no target: dropped
    assert result.exit_code == 0, result.output
    assert "dropped 2 cached CPU probe(s) and 1 pass-cost file(s)" in result.stdout.replace("\n", " ")
    assert doctor.probes() == [] and runs == ["dtype", "target"]

    # with a target on a CPU: its probes (and its auto draft's) measured right away, on the quiet machine
    line = doctor.remeasure("qwen2.5-coder-1.5b", gpu=False)  # not downloaded: configs/models.toml's shapes
    assert "measured now: target q4, draft q4" in line and "provisional" not in line, line
    assert runs[2:] == ["dtype", "target", "orient", "dtype", "draft", "orient"]
    fresh = doctor.probes()
    assert {p.kind for p in fresh} == {"cpu dtype", "cpu matmuls", "cpu target format", "cpu draft format"}
    assert not any(p.provisional for p in fresh)


def test_doctor_remeasure_of_an_unknown_model_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    result = runner.invoke(app, ["doctor", "--disk-mb", "0", "-q", "--remeasure", "--target", "no-such-alias"])
    assert result.exit_code != 0 and result.output.strip().startswith("error:"), result.output
    assert len(result.output.strip().splitlines()) == 1
