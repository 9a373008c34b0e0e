"""Models already on the machine (specexec.loading.stores) and local GGUF files pulled into the cache.

Fake stores are built in tmp dirs, with HOME and every store's environment variable pointing at them: the real
home is never looked at.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specexec.cli.models import app as models_app
from specexec.errors import SpecexecError
from specexec.loading import checkpoint, convert, hub, stores
from tests.loading.test_convert import CASES, write_gguf

DIGEST = "ab" * 32


@pytest.fixture
def machine(tmp_path, monkeypatch) -> Path:
    """An empty home folder, cache and stores; returns the home folder."""
    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path / "specexec-home"))
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "OLLAMA_MODELS", "SPECEXEC_MODEL_DIRS"):
        monkeypatch.delenv(name, raising=False)
    return user


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf"
    write_gguf(path, **CASES["qwen2"])  # type: ignore[arg-type]
    return path


def _hf_snapshot(root: Path, repo_id: str, model_type: str = "qwen2", main: bool = True) -> Path:
    """A cached HF snapshot (config.json + one safetensors file) the way huggingface_hub lays it out."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": model_type}))
    (snap / "model.safetensors").write_bytes(b"x" * 100)
    if main:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")
    return snap


def _ollama_model(root: Path, gguf: Path, name: str, tag: str, namespace: str = "library") -> Path:
    """An Ollama manifest for ``namespace/name:tag`` whose model layer is a copy of ``gguf``."""
    digest = f"{abs(hash((name, tag))):064x}"[-64:]
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(gguf, blob)
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{DIGEST}", "size": 10},
        {"mediaType": stores.OLLAMA_MODEL_LAYER, "digest": f"sha256:{digest}", "size": blob.stat().st_size},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


def test_discovers_every_store(machine, tiny_gguf, tmp_path, monkeypatch):
    """HF-cache checkpoints of supported families, GGUFs of --dir / $SPECEXEC_MODEL_DIRS folders, Ollama models and
    LM Studio files are listed with names; unsupported families, projectors and later split parts are not."""
    hf = machine / ".cache" / "huggingface" / "hub"
    qwen = _hf_snapshot(hf, "Qwen/Qwen2.5-7B-Instruct")
    _hf_snapshot(hf, "openai/whisper-tiny", model_type="whisper")
    ollama = machine / ".ollama" / "models"
    blob = _ollama_model(ollama, tiny_gguf, "qwen2.5", "7b")
    studio = machine / ".lmstudio" / "models" / "lmstudio-community" / "Qwen2.5-GGUF"
    studio.mkdir(parents=True)
    shutil.copyfile(tiny_gguf, studio / "Qwen2.5-Q8_0.gguf")
    (studio / "mmproj-Qwen2.5-F16.gguf").write_bytes(b"GGUF")
    given, env_dir = tmp_path / "given", tmp_path / "env"
    (given / "sub").mkdir(parents=True)
    env_dir.mkdir()
    shutil.copyfile(tiny_gguf, given / "sub" / "a.gguf")
    for i in (1, 2):
        (env_dir / f"big-0000{i}-of-00002.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    monkeypatch.setenv("SPECEXEC_MODEL_DIRS", os.pathsep.join([str(env_dir), str(tmp_path / "absent")]))

    found = {f.name: f for f in stores.discover([given])}
    assert sorted(found) == sorted(
        [
            "Qwen/Qwen2.5-7B-Instruct",
            "ollama:qwen2.5:7b",
            "lmstudio:lmstudio-community/Qwen2.5-GGUF",
            str((given / "sub" / "a.gguf").resolve()),
            str((env_dir / "big-00001-of-00002.gguf").resolve()),
        ]
    )
    assert found["Qwen/Qwen2.5-7B-Instruct"].path == qwen and found["Qwen/Qwen2.5-7B-Instruct"].format == "safetensors"
    assert found["ollama:qwen2.5:7b"].path == blob and found["ollama:qwen2.5:7b"].store == "Ollama"
    assert found[str((env_dir / "big-00001-of-00002.gguf").resolve())].size == 28  # both parts


def test_store_roots_follow_the_environment(machine, tiny_gguf, tmp_path, monkeypatch):
    """$HF_HUB_CACHE, $HF_HOME and $OLLAMA_MODELS move the stores; other Ollama namespaces keep theirs."""
    _hf_snapshot(tmp_path / "hf-home" / "hub", "meta-llama/Llama-3.2-1B", model_type="llama", main=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    _ollama_model(tmp_path / "ollama", tiny_gguf, "coder", "latest", namespace="someone")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    assert [f.name for f in stores.discover()] == ["meta-llama/Llama-3.2-1B", "ollama:someone/coder:latest"]
    _hf_snapshot(tmp_path / "hub-cache", "google/gemma-2-2b", model_type="gemma2")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert [f.name for f in stores.discover()] == ["google/gemma-2-2b", "ollama:someone/coder:latest"]


def test_resolve_store_names(machine, tiny_gguf):
    """Each listed name works as --target: an HF id from the HF cache without any download, an LM Studio name as its
    GGUF file, an Ollama name (tag defaulting to latest) as its blob converted into the cache once."""
    snap = _hf_snapshot(machine / ".cache" / "huggingface" / "hub", "Qwen/Qwen2.5-7B-Instruct")
    assert hub.resolve("Qwen/Qwen2.5-7B-Instruct", pull_missing=False) == snap

    studio = machine / ".cache" / "lm-studio" / "models" / "pub" / "repo"
    studio.mkdir(parents=True)
    shutil.copyfile(tiny_gguf, studio / "m.gguf")
    assert hub.resolve("lmstudio:pub/repo", pull_missing=False) == (studio / "m.gguf").resolve()  # loader converts
    converted = hub.resolve("lmstudio:pub/repo", progress=False)
    assert converted == hub.converted_gguf_dir(studio / "m.gguf") and convert.is_complete(converted)

    blob = _ollama_model(machine / ".ollama" / "models", tiny_gguf, "tiny", "latest")
    with pytest.raises(SpecexecError, match="is not converted yet; run `specexec models pull"):
        hub.resolve("ollama:tiny", pull_missing=False)
    out = hub.resolve("ollama:tiny", progress=False)
    assert convert.is_complete(out) and out == hub.converted_gguf_dir(blob)
    assert hub.resolve("ollama:tiny:latest", pull_missing=False) == out  # converted once
    assert hub.resolve(str(blob), pull_missing=False) == out  # by path too

    with pytest.raises(SpecexecError, match=r"no model 'ollama:absent:7b' on this machine; `specexec models list`"):
        hub.resolve("ollama:absent:7b")


def test_cli_list_shows_found_models(machine, tiny_gguf, tmp_path):
    given = tmp_path / "mine"
    given.mkdir()
    shutil.copyfile(tiny_gguf, given / "tiny.gguf")
    _ollama_model(machine / ".ollama" / "models", tiny_gguf, "qwen2.5", "7b")
    result = CliRunner().invoke(models_app, ["list", "--dir", str(given)], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "ollama:qwen2.5:7b" in result.stdout and str((given / "tiny.gguf").resolve()) in result.stdout
    assert "qwen2.5-coder-1.5b" in result.stdout  # the aliases are still listed


def test_pull_gguf_is_what_target_uses(machine, tiny_gguf, tmp_path, monkeypatch):
    """`specexec models pull FILE.gguf` converts into the cache; `--target FILE.gguf` (checkpoint.model_dir) then
    finds that conversion and converts nothing."""
    gguf = tmp_path / "mine" / "tiny.gguf"
    gguf.parent.mkdir()
    shutil.copyfile(tiny_gguf, gguf)
    result = CliRunner().invoke(models_app, ["pull", str(gguf), "-q"])
    assert result.exit_code == 0, result.output
    out = Path(result.stdout.strip().split(": ", 1)[1])
    assert convert.is_complete(out) and out.parent == Path(os.environ["SPECEXEC_HOME"]) / "converted"

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(convert, "gguf_to_hf_dir", no_conversion)
    assert checkpoint.model_dir(gguf) == out
    again = CliRunner().invoke(models_app, ["pull", str(gguf), "-q"])
    assert again.exit_code == 0 and again.stdout.strip() == result.stdout.strip()


def test_pull_split_gguf_by_any_part(machine, tmp_path):
    write_gguf(tmp_path / "m.gguf", layers=3, qkv_bias=True, split_max_tensors=14)
    first = hub.pull_gguf(tmp_path / "m-00003-of-00003.gguf", progress=False)
    assert first == hub.converted_gguf_dir(tmp_path / "m-00001-of-00003.gguf") and convert.is_complete(first)
    assert hub.resolve(str(tmp_path / "m-00002-of-00003.gguf")) == first


def test_target_gguf_with_cache_dir_uses_the_pulled_conversion(machine, tiny_gguf, tmp_path, monkeypatch):
    """`models pull FILE.gguf --cache-dir DIR` and `--target FILE.gguf --cache-dir DIR` (hub.resolve with home=DIR,
    as the engine resolves its target) share one conversion under DIR."""
    home = tmp_path / "elsewhere"
    result = CliRunner().invoke(models_app, ["pull", str(tiny_gguf), "-q", "--cache-dir", str(home)])
    assert result.exit_code == 0, result.output
    out = hub.converted_gguf_dir(tiny_gguf, home)
    assert out.parent == home / "converted" and convert.is_complete(out)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(convert, "gguf_to_hf_dir", no_conversion)
    assert hub.resolve(str(tiny_gguf), home=home) == out
    assert checkpoint.model_dir(out) == out


def test_split_gguf_in_the_hf_cache(machine, tmp_path):
    """A split GGUF in the HF cache, whose part names are links to blobs named by hash, is listed by its first part
    and converts from it."""
    write_gguf(tmp_path / "m.gguf", layers=3, qkv_bias=True, split_max_tensors=14)
    repo = machine / ".cache" / "huggingface" / "hub" / "models--someone--m-GGUF"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i in (1, 2, 3):
        blob = repo / "blobs" / f"{i:064x}"
        shutil.move(tmp_path / f"m-0000{i}-of-00003.gguf", blob)
        (snap / f"m-0000{i}-of-00003.gguf").symlink_to(blob)
    found = stores.discover()
    assert [(f.name, f.format) for f in found] == [(str(snap / "m-00001-of-00003.gguf"), "gguf")]
    out = hub.resolve(found[0].name, progress=False)
    assert convert.is_complete(out) and (out / "config.json").is_file()


@pytest.mark.parametrize(
    "make,message",
    [
        ("truncated", r"truncated GGUF file .*bad\.gguf: tensor output\.weight ends"),
        ("no-tokenizer", r"bad\.gguf has no tokenizer metadata"),
        ("architecture", r"bad\.gguf: GGUF architecture 'falcon' is not supported"),
        ("quant-type", r"stored as ggml type Q8_1, which is not converted; supported types: F32"),
        ("not-gguf", r"bad\.gguf is not a GGUF file"),
    ],
)
def test_cli_pull_bad_gguf_is_one_line_and_leaves_nothing(machine, tiny_gguf, tmp_path, make, message):
    """Each bad GGUF: exit 2, one `error:` line, no traceback, nothing in the cache."""
    import re

    import gguf
    import numpy as np

    bad = tmp_path / "bad.gguf"
    if make == "truncated":
        bad.write_bytes(tiny_gguf.read_bytes()[:-100])
    elif make == "no-tokenizer":
        write_gguf(bad, tokenizer=False)
    elif make == "not-gguf":
        bad.write_text("a text file\n")
    else:
        writer = gguf.GGUFWriter(str(bad), "falcon" if make == "architecture" else "llama")
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b"])
        if make == "quant-type":
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            raw = np.zeros((4, nbytes * 2), dtype=np.uint8)
            writer.add_tensor("token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            writer.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    result = CliRunner().invoke(models_app, ["pull", str(bad), "-q"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output
    assert re.search(message, lines[0]), lines[0]
    home = Path(os.environ["SPECEXEC_HOME"])
    assert not (home / "converted").exists() or list((home / "converted").iterdir()) == []


def test_pull_help_lists_quant_types():
    result = CliRunner().invoke(models_app, ["pull", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    for name in ("Q4_K", "Q8_0", "IQ4_XS", "qwen3", "gemma3", "phi3"):
        assert name in text
