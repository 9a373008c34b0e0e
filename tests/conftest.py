"""Shared fixtures: tiny random Llama-family models saved in HF format (safetensors), built in the test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "llama_tied")


def make_tiny(path: Path, family: str = "llama", vocab: int = 96, seed: int = 0, std: float = 0.25,
              layers: int = 2, hidden: int = 64) -> Path:
    """Save a tiny random model of ``family`` (HF format) with a byte-level test tokenizer into ``path``.

    The init std is raised so next-token distributions are peaked (meaningful greedy tests).
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, AutoModelForCausalLM

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 32, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  initializer_range=std, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False)
    elif family == "llama_tied":
        cfg = LlamaConfig(**common, tie_word_embeddings=True)
    elif family == "llama3":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "mistral":
        cfg = MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=False)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if family == "qwen2":  # give the qkv biases some size
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, std)
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path, vocab)
    return path


def _save_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer over ``vocab`` symbols (ids 0..2 special), saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    symbols = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        symbols[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=symbols, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"
    )
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny(root / f, f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A target and a draft with the same tokenizer; the draft is the target with noise (agrees often)."""
    root = tmp_path_factory.mktemp("pair")
    target = make_tiny(root / "target", "llama", seed=11)
    draft = make_tiny(root / "draft", "llama", seed=11, layers=1)
    return target, draft


def make_noisy_copy(src: Path, dst: Path, noise: float, seed: int = 0) -> Path:
    """A draft for ``src``: the same architecture and tokenizer with Gaussian noise added to every weight."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        sd = load_file(f)
        sd = {k: v + noise * torch.randn(v.shape, generator=gen) * v.std().clamp(min=1e-3) for k, v in sd.items()}
        save_file(sd, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def noisy_pairs(tiny_models, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per family: (target, draft) where the draft is the target plus noise (high but imperfect agreement)."""
    root = tmp_path_factory.mktemp("noisy")
    return {f: (p, make_noisy_copy(p, root / f, 0.1)) for f, p in tiny_models.items()}


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny-model tests run fastest (and steadiest on shared cores) on one thread; real-model tests keep all."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
