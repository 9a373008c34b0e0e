"""Our Llama-family model against transformers' AutoModelForCausalLM (the oracle) on tiny random configs."""

from __future__ import annotations

import pytest
import torch

from specexec.loading import load_model
from tests.conftest import FAMILIES


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _causal(n0: int, T: int, L: int) -> torch.Tensor:
    """Mask (T, L): row j attends to slots [0, n0 + j]."""
    return torch.arange(L)[None, :] <= (n0 + torch.arange(T))[:, None]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_models, family):
    path = tiny_models[family]
    ours = load_model(path, torch.device("cpu"), torch.float32)
    hf = _hf(path)
    torch.manual_seed(0)
    ids = torch.randint(3, ours.cfg.vocab_size, (1, 40))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    cache = ours.new_cache(64)
    # prefill 30 tokens, then 3 cached steps of 1, 4 and 5 tokens
    pos = 0
    for n in (30, 1, 4, 5):
        t = torch.arange(pos, pos + n)
        logits = ours.forward(ids[0, pos : pos + n], t, t, _causal(pos, n, pos + n), cache)
        torch.testing.assert_close(logits, ref[pos : pos + n], atol=1e-4, rtol=1e-4)
        pos += n


def test_config_parses_rope_scaling(tiny_models):
    from specexec.loading import read_config

    cfg = read_config(tiny_models["llama3"])
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    assert read_config(tiny_models["qwen2"]).qkv_bias
    assert read_config(tiny_models["llama_tied"]).tie_word_embeddings
