"""``specexec export vllm|sglang``: the printed command uses only options the engines document, and carries the
models, context and endpoint of ``specexec serve`` over."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from specexec.cli import app

runner = CliRunner()

# The options an export may print, as the engines' own argument parsers define them. vLLM 0.33.0
# (https://docs.vllm.ai/en/v0.33.0/cli/serve.html): EngineArgs.add_cli_args and the frontend's FrontendArgs, built
# from the released wheel; the model is `vllm serve`'s positional argument.
VLLM_SERVE_OPTIONS = frozenset(
    {
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--max-model-len",
        "--speculative-config",
        "--cpu-offload-gb",
        "--quantization",
        "--load-format",
        "--dtype",
        "--tensor-parallel-size",
    }
)
# vllm.config.SpeculativeConfig fields (the --speculative-config JSON keys) and SpeculativeMethod values, 0.33.0
VLLM_SPECULATIVE_KEYS = frozenset(
    {"model", "num_speculative_tokens", "method", "draft_tensor_parallel_size", "quantization", "max_model_len",
     "prompt_lookup_max", "prompt_lookup_min"}
)  # fmt: skip
VLLM_SPECULATIVE_METHODS = frozenset({"draft_model", "ngram", "suffix", "eagle", "eagle3", "mtp"})
# SGLang 0.5.23 (https://docs.sglang.io/advanced_features/server_arguments.html): ServerArgs.add_cli_args of the
# released wheel; the algorithm, quantization and load-format values are from its documented choices.
SGLANG_SERVER_OPTIONS = frozenset(
    {
        "--model-path",
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--context-length",
        "--cpu-offload-gb",
        "--quantization",
        "--load-format",
        "--dtype",
        "--tp-size",
        "--speculative-algorithm",
        "--speculative-draft-model-path",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
    }
)
SGLANG_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"})
SGLANG_QUANTIZATION = frozenset({"awq", "fp8", "gptq", "bitsandbytes", "gguf"})
SGLANG_LOAD_FORMATS = frozenset({"auto", "safetensors", "gguf", "bitsandbytes"})


def export(*args: str) -> tuple[list[str], list[str]]:
    """Run the command; (the printed command as argv, the note lines)."""
    result = runner.invoke(app, ["export", *args])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout  # stdout is the command alone
    notes = [line for line in result.stderr.splitlines() if line.strip()]
    assert all(n.startswith("note: ") for n in notes), notes
    return shlex.split(lines[0]), notes


def flags(argv: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of an argv (every option the exporter prints takes one value)."""
    out = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            assert word not in out, f"{word} twice"
            out[word] = argv[i + 1]
    return out


CASES = [
    (),
    ("--target", "qwen2.5-72b", "--draft", "qwen2.5-0.5b", "--budget", "1024", "--api-key", "k", "--offload", "ram"),
    ("--target", "llama3.1-70b", "--draft", "llama3.2-1b", "--target-dtype", "nf4", "--method", "chain"),
    ("--target", "llama-7b", "--method", "ngram", "--gamma", "5", "--served-model-name", "mine", "--port", "9000"),
    ("--target", "llama-7b", "--draft", "none"),
    ("--target", "llama3-8b", "--draft", "self", "--target-dtype", "nf4"),
]


@pytest.mark.parametrize("args", CASES)
def test_vllm_prints_only_documented_options(args):
    argv, _ = export("vllm", *args)
    assert argv[:2] == ["vllm", "serve"] and not argv[2].startswith("-")
    opts = flags(argv[3:])
    assert set(opts) <= VLLM_SERVE_OPTIONS, set(opts) - VLLM_SERVE_OPTIONS
    if "--speculative-config" in opts:
        text = opts["--speculative-config"]
        spec = json.loads(text)
        assert text == json.dumps(spec, separators=(",", ":"))  # compact JSON
        assert set(spec) <= VLLM_SPECULATIVE_KEYS and spec["method"] in VLLM_SPECULATIVE_METHODS
        assert 1 <= spec["num_speculative_tokens"] <= 8


@pytest.mark.parametrize("args", CASES)
def test_sglang_prints_only_documented_options(args):
    argv, _ = export("sglang", *args)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    opts = flags(argv[3:])
    assert set(opts) <= SGLANG_SERVER_OPTIONS, set(opts) - SGLANG_SERVER_OPTIONS
    assert opts.get("--speculative-algorithm", "NGRAM") in SGLANG_ALGORITHMS
    assert opts.get("--quantization", "fp8") in SGLANG_QUANTIZATION
    assert opts.get("--load-format", "auto") in SGLANG_LOAD_FORMATS


def test_same_models_context_and_endpoint_as_serve():
    args = ["--target", "qwen2.5-72b", "--draft", "qwen2.5-0.5b", "--context", "8192", "--port", "8123"]
    args += ["--host", "0.0.0.0", "--api-key", "s3cret key; $(rm)", "--served-model-name", "big model"]
    argv, _ = export("vllm", *args)
    opts = flags(argv[3:])
    assert argv[2] == "Qwen/Qwen2.5-72B-Instruct"  # the alias's HF id
    assert opts["--max-model-len"] == "8192" and opts["--port"] == "8123" and opts["--host"] == "0.0.0.0"
    assert opts["--api-key"] == "s3cret key; $(rm)" and opts["--served-model-name"] == "big model"  # shell-quoted
    assert json.loads(opts["--speculative-config"]) == {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "num_speculative_tokens": 6,  # --budget auto starts at 64: log2 = 6
        "method": "draft_model",
    }
    argv, _ = export("sglang", *args)
    opts = flags(argv[3:])
    assert opts["--model-path"] == "Qwen/Qwen2.5-72B-Instruct" and opts["--context-length"] == "8192"
    assert opts["--api-key"] == "s3cret key; $(rm)" and opts["--served-model-name"] == "big model"
    assert opts["--speculative-algorithm"] == "STANDALONE"
    assert opts["--speculative-draft-model-path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert opts["--speculative-num-steps"] == "6" and opts["--speculative-eagle-topk"] == "1"
    assert opts["--speculative-num-draft-tokens"] == "7"


def test_served_model_name_defaults_to_what_serve_shows():
    argv, _ = export("vllm", "--target", "llama3-8b", "--draft", "none")
    assert flags(argv[3:])["--served-model-name"] == "llama3-8b"  # clients keep the alias they used


@pytest.mark.parametrize("budget, tokens", [("4", 3), ("64", 6), ("256", 8), ("4096", 8)])
def test_tree_budgets_map_to_three_to_eight_tokens_with_a_note(budget, tokens):
    argv, notes = export(
        "vllm", "--target", "llama-70b", "--draft", "llama-7b", "--budget", budget, "--offload", "none"
    )
    assert json.loads(flags(argv[3:])["--speculative-config"])["num_speculative_tokens"] == tokens
    assert len(notes) == 1 and f"--budget {budget} becomes {tokens} speculative tokens" in notes[0]


def test_chain_keeps_gamma():
    argv, _ = export("vllm", "--target", "llama-70b", "--draft", "llama-7b", "--method", "chain", "--gamma", "5")
    assert json.loads(flags(argv[3:])["--speculative-config"])["num_speculative_tokens"] == 5


def test_local_paths_stay_paths(tmp_path):
    target, draft = tmp_path / "big model", tmp_path / "small"
    target.mkdir()
    draft.mkdir()
    argv, _ = export("vllm", "--target", str(target), "--draft", str(draft))
    assert argv[2] == str(target)
    assert json.loads(flags(argv[3:])["--speculative-config"])["model"] == str(draft)
    assert flags(argv[3:])["--served-model-name"] == "big model"


def test_what_does_not_carry_over_is_one_note_each(tmp_path):
    _, notes = export("vllm", "--target", "llama-7b", "--draft", "none", "--offload", "ram")
    assert len(notes) == 2 and "no speculative config" in notes[0] and "synchronously" in notes[1]
    argv, notes = export("vllm", "--target", "llama-7b", "--draft", "self", "--offload", "none")
    assert "--speculative-config" not in argv and len(notes) == 1 and "--draft self" in notes[0]
    argv, notes = export(
        "vllm", "--target", "llama-7b", "--draft", "none", "--target-dtype", "nf4", "--offload", "none"
    )
    assert "--quantization" not in argv and "bitsandbytes" in notes[-1]  # vLLM 0.33 has no bitsandbytes method
    argv, notes = export("sglang", "--target", "llama-7b", "--draft", "none", "--target-dtype", "nf4")
    assert flags(argv[3:])["--quantization"] == "bitsandbytes" and flags(argv[3:])["--load-format"] == "bitsandbytes"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    _, notes = export("vllm", "--target", str(gguf), "--draft", "none", "--offload", "none")
    assert any("GGUF" in n for n in notes)
    argv, _ = export("sglang", "--target", str(gguf), "--draft", "none", "--offload", "none")
    assert flags(argv[3:])["--load-format"] == "gguf"


@pytest.mark.parametrize(
    "args, message",
    [
        (["ollama"], "error: unknown engine 'ollama'; choose one of vllm, sglang"),
        (["vllm", "--target", "nosuchmodel"], "unknown model alias 'nosuchmodel'"),
        (["vllm", "--target", "./no/such/dir"], "model path not found"),
        (["vllm", "--method", "chain", "--draft", "none"], "--method chain needs a draft model"),
        (["vllm", "--budget", "many"], "--budget"),
        (["vllm", "--port", "70000"], "--port must be in 0..65535"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = runner.invoke(app, ["export", *args])
    assert result.exit_code == 2 and not result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_the_api_key_is_never_taken_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPECEXEC_API_KEY", "from-env")  # serve reads it; a printed command would leak it
    argv, _ = export("vllm", "--draft", "none")
    assert "--api-key" not in argv and "from-env" not in argv


def test_store_names_and_gguf_blobs_are_local_gguf_files(tmp_path, monkeypatch):
    from specexec.loading import stores

    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    blob = root / "blobs" / f"sha256-{'cd' * 32}"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"GGUF" + bytes(60))  # an Ollama blob: a GGUF without the suffix
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "qwen3" / "8b"
    manifest.parent.mkdir(parents=True)
    layer = {"mediaType": stores.OLLAMA_MODEL_LAYER, "digest": f"sha256:{'cd' * 32}", "size": 64}
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [layer]}))
    argv, notes = export("vllm", "--target", "ollama:qwen3:8b", "--draft", "none", "--offload", "none")
    assert argv[2] == str(blob.resolve()) and any("GGUF" in n for n in notes)
    argv, _ = export("sglang", "--target", str(blob), "--draft", "none", "--offload", "none")
    assert flags(argv[3:])["--load-format"] == "gguf"
    result = runner.invoke(app, ["export", "vllm", "--target", "ollama:nothing:here"])
    assert result.exit_code == 2 and "no model 'ollama:nothing:here' on this machine" in result.stderr


def test_draft_auto_takes_the_targets_known_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no model of the family on this machine: the pair decides
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "OLLAMA_MODELS", "SPECEXEC_MODEL_DIRS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "home"))
    for target, draft in (("qwen3-32b", "Qwen/Qwen3-0.6B"), ("gemma-2-27b", "google/gemma-2-2b-it")):
        argv, _ = export("vllm", "--target", target)
        assert json.loads(flags(argv[3:])["--speculative-config"])["model"] == draft
