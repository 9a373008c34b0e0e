"""A GGUF target quantized to NF4 straight from the GGUF's blocks: the same NF4 layer cache and logits as through the
fp16 copy, with no 16-bit copy of the layers on disk; and GGUF locations (split parts, a folder of parts, the cache
root) converting where `specexec models pull` converts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from offload import OffloadConfig
from offload.store import CHUNK_BYTES
from specexec.errors import ModelFormatError, SpecexecError
from specexec.loading import checkpoint, convert, hub
from specexec.loading.offloaded import load_offloaded, target_dir
from tests.loading.test_convert import Q, write_gguf
from tests.offload.test_offload import _passes

CPU = torch.device("cpu")
CHUNK = 16 << 10

# llama: q/k rows un-permuted; qwen2: q/k/v biases, K-quants; gemma3: norms stored as w + 1, q/k norms, tied
CASES = {
    "llama": dict(arch="llama", qtypes={"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "ffn_down": Q.Q4_K, "output": Q.Q8_0}),
    "qwen2": dict(
        arch="qwen2",
        qkv_bias=True,
        qtypes={"attn_q": Q.Q5_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0},
    ),
    "gemma3": dict(arch="gemma3", tied=True, head_dim=256, qtypes={"attn_k": Q.Q5_1, "ffn_up": Q.Q8_0}),
}


def _nf4(path: Path, root: Path, device: torch.device = CPU, dtype: str = "fp32"):
    off = OffloadConfig(mode="ram", target_dtype="nf4", resident_layers=0, cache_dir=root)
    return load_offloaded(path, device, dtype, off, chunk_bytes=CHUNK if device.type == "cpu" else CHUNK_BYTES)


def _layer_files(root: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((root / "offload").glob("*/layer_*.bin"))}


def _safetensors_names(path: Path) -> list[str]:
    n = int.from_bytes(path.read_bytes()[:8], "little")
    return [k for k in json.loads(path.read_bytes()[8 : 8 + n]) if k != "__metadata__"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_nf4_cache_from_the_gguf_equals_the_one_from_the_fp16_copy(case, tmp_path):
    """The NF4 layer cache built from the GGUF's blocks is byte for byte the one built from the fp16 conversion,
    the streamed models give the same logits, and nothing but the NF4 cache holds layer weights on disk."""
    gguf_path = tmp_path / "gguf" / f"{case}.gguf"
    gguf_path.parent.mkdir()
    write_gguf(gguf_path, layers=3, **CASES[case])  # type: ignore[arg-type]

    copy = convert.gguf_to_hf_dir(gguf_path, tmp_path / "copy", progress=False)
    want = _passes(_nf4(copy, tmp_path / "via-copy"))
    direct = tmp_path / "direct"
    got = _passes(_nf4(gguf_path, direct))

    assert _layer_files(direct) == _layer_files(tmp_path / "via-copy") and len(_layer_files(direct)) == 3
    assert torch.equal(got, want)
    (meta,) = (direct / "converted").iterdir()
    assert convert.is_complete(meta) and convert.layers_in_gguf(meta)
    files = sorted(p.relative_to(direct).as_posix() for p in direct.rglob("*") if p.is_file())
    holding = [f for f in files if f.endswith(".safetensors")]
    assert holding == [f"converted/{meta.name}/model.safetensors"]
    assert not [n for n in _safetensors_names(direct / holding[0]) if n.startswith("model.layers.")]
    layers_on_disk = sum((direct / f).stat().st_size for f in files if "/layer_" in f)
    copy_layers = sum(os.path.getsize(copy / f) for f in os.listdir(copy) if f.endswith(".safetensors"))
    meta_bytes = sum(p.stat().st_size for p in meta.iterdir())
    globals_bytes = (direct / holding[0]).stat().st_size
    assert meta_bytes - globals_bytes < 100_000  # config, tokenizer, the layer plan: no layer weights
    assert layers_on_disk < copy_layers  # only NF4 layers


def test_layers_read_from_the_gguf_are_those_of_the_fp16_copy(tmp_path):
    """Every layer tensor, the embedding and the lm_head, in the storage dtype, and iter_layers' fused layers at any
    compute dtype."""
    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, **CASES["llama"])  # type: ignore[arg-type]
    copy = convert.gguf_to_hf_dir(gguf_path, tmp_path / "copy", progress=False)
    meta = convert.gguf_to_hf_dir(gguf_path, tmp_path / "meta", progress=False, layers_in_gguf=True)
    reader, shards = convert.GgufLayers(meta), checkpoint._Shards(copy)
    layer_names = [n for n in shards.where if n.startswith("model.layers.")]
    read = layer_names + [n for n in convert.GLOBAL_BLOCKS if n in shards.where]  # embedding and lm_head too
    assert sorted(reader.tensors) == sorted(read)
    for name in read:
        assert torch.equal(reader.get(name), shards.get(name)) and reader.get(name).dtype == torch.float16
    cfg = checkpoint.read_config(meta)
    for dtype in (torch.float32, torch.bfloat16):
        for (i, a), (j, b) in zip(checkpoint.iter_layers(meta, cfg, dtype), checkpoint.iter_layers(copy, cfg, dtype)):
            assert i == j and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(checkpoint._Shards(meta).get(name), shards.get(name))


def test_a_dense_target_keeps_the_fp16_copy(tmp_path):
    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, **CASES["qwen2"])  # type: ignore[arg-type]
    dense = target_dir(gguf_path, OffloadConfig(target_dtype="auto", cache_dir=tmp_path / "home"))
    nf4 = target_dir(gguf_path, OffloadConfig(target_dtype="nf4", cache_dir=tmp_path / "home"))
    assert not convert.layers_in_gguf(dense) and convert.layers_in_gguf(nf4) and dense != nf4
    assert any(n.startswith("model.layers.") for n in _safetensors_names(dense / "model.safetensors"))
    assert dense == hub.converted_gguf_dir(gguf_path, tmp_path / "home")
    assert nf4 == hub.converted_gguf_dir(gguf_path, tmp_path / "home", layers_in_gguf=True)


def test_the_nf4_cache_outlives_a_rebuilt_conversion_and_follows_the_gguf(tmp_path, monkeypatch):
    """The cache key is the GGUF's (paths, sizes, mtimes): converting again reuses the NF4 cache, a changed GGUF
    does not (and its stale conversion refuses to read the changed file)."""
    from offload import packing

    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, **CASES["qwen2"])  # type: ignore[arg-type]
    first = _passes(_nf4(gguf_path, tmp_path / "home"))
    (meta,) = (tmp_path / "home" / "converted").iterdir()
    (meta / convert.COMPLETE_MARKER).unlink()  # as if deleted: converted again
    calls: list[int] = []
    monkeypatch.setattr(packing, "quantize_nf4", lambda *a, **k: calls.append(1))
    assert torch.equal(_passes(_nf4(gguf_path, tmp_path / "home")), first) and calls == []

    st = gguf_path.stat()
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ModelFormatError, match=r"changed since it was converted into .*delete"):
        convert.GgufLayers(meta)


def test_a_failed_conversion_without_layers_leaves_nothing(tmp_path, monkeypatch):
    """Written in a temporary directory and renamed into place, as the full conversion."""
    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, **CASES["qwen2"])  # type: ignore[arg-type]
    out = tmp_path / "out" / "meta"

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(convert, "_write_weights", boom)
    with pytest.raises(OSError, match="disk full"):
        convert.gguf_to_hf_dir(gguf_path, out, progress=False, layers_in_gguf=True)
    assert list(out.parent.iterdir()) == []


# ---------------------------------------------------------------------------------------------- GGUF locations


@pytest.fixture
def split(tmp_path) -> list[Path]:
    path = tmp_path / "models" / "m.gguf"
    path.parent.mkdir()
    write_gguf(path, arch="qwen2", layers=3, qkv_bias=True, split_max_tensors=14)
    return sorted(path.parent.iterdir())


def test_any_part_converts_where_models_pull_does(split, tmp_path, monkeypatch):
    """model_dir on any part of a split GGUF gives the directory `specexec models pull` (hub.pull_gguf) converts
    to, under the cache root it is given (--cache-dir), converting once."""
    home = tmp_path / "home"
    conversions: list[Path] = []
    real = convert.gguf_to_hf_dir
    monkeypatch.setattr(convert, "gguf_to_hf_dir", lambda p, o, **k: conversions.append(p) or real(p, o, **k))
    want = hub.converted_gguf_dir(split[0], home)
    assert [checkpoint.model_dir(part, home=home) for part in split] == [want] * 3
    assert len(conversions) == 1 and convert.is_complete(want)
    assert hub.pull_gguf(split[2], progress=False, home=home) == want and len(conversions) == 1


def test_a_folder_of_split_parts_is_a_model(split, tmp_path):
    home = tmp_path / "home"
    assert checkpoint.model_dir(split[0].parent, home=home) == hub.converted_gguf_dir(split[0], home)
    other = tmp_path / "other"
    other.mkdir()
    for part in split[:2]:  # a part missing: not one whole split GGUF
        (other / part.name).write_bytes(part.read_bytes())
    with pytest.raises(SpecexecError, match="no config.json"):
        checkpoint.model_dir(other, home=home)
    (other / "x.gguf").write_bytes(split[2].read_bytes())
    with pytest.raises(SpecexecError, match="no config.json"):
        checkpoint.model_dir(other, home=home)


@pytest.mark.cuda
def test_nf4_from_the_gguf_on_cuda(tmp_path):
    """On a GPU (bitsandbytes quantizes there): the same NF4 cache and logits as through the fp16 copy."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, layers=3, **CASES["llama"])  # type: ignore[arg-type]
    copy = convert.gguf_to_hf_dir(gguf_path, tmp_path / "copy", progress=False)
    cuda = torch.device("cuda")
    want = _passes(_nf4(copy, tmp_path / "via-copy", cuda, "bf16"))
    got = _passes(_nf4(gguf_path, tmp_path / "direct", cuda, "bf16"))
    assert _layer_files(tmp_path / "direct") == _layer_files(tmp_path / "via-copy")
    assert torch.equal(got, want)


def test_load_an_nf4_gguf_target_writes_no_fp16_copy(tmp_path):
    """specexec.load (what `specexec generate --target FILE.gguf --target-dtype nf4` calls): the conversion without
    layers plus the NF4 cache, and the same greedy tokens as the target loaded through the fp16 copy."""
    from specexec import api

    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, **CASES["qwen2"])  # type: ignore[arg-type]
    off = OffloadConfig(mode="ram", target_dtype="nf4")
    kw = dict(device="cpu", dtype="fp32", context=64, offload=off, progress=False)
    got = api.load(str(gguf_path), cache_dir=tmp_path / "home", **kw).generate([5, 6, 7], max_new_tokens=8)  # type: ignore[arg-type]
    copy = convert.gguf_to_hf_dir(gguf_path, tmp_path / "copy", progress=False)
    want = api.load(str(copy), cache_dir=tmp_path / "other", **kw).generate([5, 6, 7], max_new_tokens=8)  # type: ignore[arg-type]
    assert got.tokens == want.tokens
    (meta,) = (tmp_path / "home" / "converted").iterdir()
    assert convert.layers_in_gguf(meta)
    assert [p.name for p in (tmp_path / "home").rglob("*.safetensors")] == ["model.safetensors"]
    assert not [n for n in _safetensors_names(meta / "model.safetensors") if n.startswith("model.layers.")]


def test_the_command_line_writes_no_fp16_copy(tmp_path):
    """`specexec generate --target FILE.gguf --target-dtype nf4` (the command line resolves the target before
    loading): only the conversion without layers and the NF4 cache are written."""
    from typer.testing import CliRunner

    from specexec.cli import app

    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, **CASES["qwen2"])  # type: ignore[arg-type]
    home = tmp_path / "home"
    args = ["generate", "--target", str(gguf_path), "--draft", "none", "--offload", "ram", "--device", "cpu"]
    args += ["--dtype", "fp32", "--cache-dir", str(home), "-n", "3", "-p", "hello"]
    r = CliRunner().invoke(app, [*args, "--target-dtype", "nf4"])
    assert r.exit_code == 0, r.output
    (meta,) = (home / "converted").iterdir()
    assert convert.layers_in_gguf(meta) and meta == hub.converted_gguf_dir(gguf_path, home, layers_in_gguf=True)
    assert [p.name for p in home.rglob("*.safetensors")] == ["model.safetensors"]
    assert not [n for n in _safetensors_names(meta / "model.safetensors") if n.startswith("model.layers.")]
    assert len(list((home / "offload").glob("*/layer_*.bin"))) == 2
