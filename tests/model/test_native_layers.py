"""A pass's decoder layers in one C call (specexec.formats.layers) for CPU models with 4-bit weights."""

from __future__ import annotations

import pytest
import torch

from specexec.formats import native, q4
from specexec.loading.checkpoint import load_model

CPU = torch.device("cpu")
PLAIN = ("llama", "llama3", "mistral", "qwen2", "llama_tied", "phi3")  # pre-norm, fused q/k/v, rotate-half RoPE, SwiGLU
OTHERS = ("mistral_window", "qwen3", "gemma2", "gemma3")  # a sliding window, q/k norms, Gemma's norms and GeGLU

pytestmark = pytest.mark.skipif(native.available() is not None, reason="no C compiler here")


def _prefill(model, ids):
    pos = torch.arange(len(ids))
    return model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(len(ids) + 8))


@pytest.mark.parametrize("family", PLAIN + OTHERS)
def test_the_plain_layer_shape_runs_natively_and_the_others_keep_torch(tiny_models, family):
    model = load_model(tiny_models[family], CPU, torch.float32, fmt="q4")
    ids = torch.randint(3, model.cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(0))
    _prefill(model, ids)
    assert bool(model.native_layers) == (family in PLAIN)
    dense = load_model(tiny_models[family], CPU, torch.float32)
    _prefill(dense, ids)
    assert not dense.native_layers  # dense weights: the torch layers


@pytest.mark.parametrize("family", PLAIN)
def test_native_layers_compute_what_the_torch_layers_compute(tiny_models, family):
    model = load_model(tiny_models[family], CPU, torch.float32, fmt="q4")
    ids = torch.randint(3, model.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    fast = _prefill(model, ids)
    assert model.native_layers, "the pass did not take the native layers"
    model.native_layers = False  # the torch layers, the same weights
    slow = _prefill(model, ids)
    cos = torch.nn.functional.cosine_similarity(fast, slow, dim=-1)
    assert cos.min() > 0.999, cos
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("family", ("llama", "qwen2"))
def test_a_native_pass_gives_a_row_the_same_bits_whatever_rows_are_beside_it(tiny_models, family):
    model = load_model(tiny_models[family], CPU, torch.float32, fmt="q4")
    ids = torch.randint(3, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    whole = _prefill(model, ids)
    assert model.native_layers
    cache = model.new_cache(28)
    rows = []
    for a, b in ((0, 7), (7, 8), (8, 20)):  # passes of 7, 1 and 12 rows
        pos = torch.arange(a, b)
        mask = torch.arange(28)[None, :] <= pos[:, None]
        rows.append(model.forward(ids[a:b], pos, pos, mask, cache))
    assert torch.equal(torch.cat(rows), whole)
    assert isinstance(model.globals.lm_head, q4.Q4Linear)
