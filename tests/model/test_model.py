"""Our Llama-family model against transformers' AutoModelForCausalLM (the oracle) on tiny random configs."""

from __future__ import annotations

import pytest
import torch

from specexec.loading.checkpoint import load_model
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
    from specexec.loading.checkpoint import read_config

    cfg = read_config(tiny_models["llama3"])
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    assert read_config(tiny_models["qwen2"]).qkv_bias
    assert read_config(tiny_models["llama_tied"]).tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 48, 49, 64, 65])
def test_linear_orientation_rule_is_numerically_a_linear(dtype, rows):
    """Both orientations compute x @ w.T; the per-row-count table (set by the CPU probe) only picks the kernel."""
    from specexec.formats.dense import ORIENT_MAX_ROWS, cpu_orientation, cpu_transposed, linear, set_cpu_orientation

    torch.manual_seed(0)
    x, w = torch.randn(rows, 64).to(dtype), torch.randn(96, 64).to(dtype)
    ref = x.float() @ w.float().T
    was = cpu_orientation(dtype)
    try:
        for table in ([], [rows], list(range(2, 40)), None):
            set_cpu_orientation(dtype, table)
            if table is None:  # the default rule: fp32 8..48 rows, other dtypes never
                want = dtype == torch.float32 and 8 <= rows <= 48
            else:
                want = rows in table and rows <= ORIENT_MAX_ROWS
            assert cpu_transposed(x) == want
            out = linear(x, w)
            assert out.dtype == dtype and out.shape == (rows, 96)
            tol = 1e-4 if dtype == torch.float32 else 0.1
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    finally:
        set_cpu_orientation(dtype, was)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_logits_track_fp32(tiny_models, family):
    """The bf16 model is the fp32 model up to bf16 rounding (its own exactness reference is itself, in bf16)."""
    path = tiny_models[family]
    a, b = load_model(path, torch.device("cpu"), torch.float32), load_model(path, torch.device("cpu"), torch.bfloat16)
    assert b.globals.embed.dtype == torch.bfloat16
    ids = torch.arange(3, 19)
    t = torch.arange(16)
    la = a.forward(ids, t, t, _causal(0, 16, 16), a.new_cache(16))
    lb = b.forward(ids, t, t, _causal(0, 16, 16), b.new_cache(16))
    assert lb.dtype == torch.float32  # logits always come back in fp32
    assert (la - lb).abs().max() < 0.1 * la.abs().max()


def test_fp32_model_keeps_a_16_bit_untied_embedding(tiny_models, tmp_path):
    """An untied embedding stored in bf16 stays bf16 under an fp32 model (half the table's memory): the rows a
    lookup reads are upcast, so the logits are bit-identical to those of the same model with the table upcast."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "bf16"
    shutil.copytree(tiny_models["llama"], src)
    for f in src.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    m = load_model(src, torch.device("cpu"), torch.float32)
    assert m.globals.embed.dtype == torch.bfloat16 and m.globals.lm_head.dtype == torch.float32
    ref = load_model(src, torch.device("cpu"), torch.float32)
    ref.globals.embed = ref.globals.embed.float()
    toks = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    pos = torch.arange(8)
    mask = pos[None, :] <= pos[:, None]
    a = m.forward(toks, pos, pos, mask, m.new_cache(8))
    b = ref.forward(toks, pos, pos, mask, ref.new_cache(8))
    assert torch.equal(a, b)


def test_rope_with_a_sign_folded_sin_is_the_rotate_half_formula_bit_for_bit():
    """apply_rope swaps halves and folds the rotation's sign into sin (rope_tables): the same arithmetic per
    element as HF's ``x * cos + rotate_half(x) * sin``, so the target's numerics are HF's."""
    from specexec.model.transformer import apply_rope, rope_tables

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 5, 16, dtype=dtype)
        pos, inv = torch.arange(100, 107), 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        cos, sin_signed = rope_tables(pos, inv, dtype)
        freqs = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        c, s = emb.cos().to(dtype), emb.sin().to(dtype)
        rotated = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
        assert torch.equal(apply_rope(x, cos, sin_signed), x * c + rotated * s)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_drafts_fused_norm_only_moves_logits_by_rounding(tiny_models, family):
    """fused_norm=True (a draft's passes on a GPU) runs RMSNorm through F.rms_norm: the logits stay within
    rounding of the default pass, which a target always uses."""
    m = load_model(tiny_models[family], torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(3, m.cfg.vocab_size, (12,))
    t = torch.arange(12)
    a = m.forward(ids, t, t, _causal(0, 12, 12), m.new_cache(16))
    b = m.forward(ids, t, t, _causal(0, 12, 12), m.new_cache(16), fused_norm=True)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["mistral_window", "gemma2", "gemma3"])
def test_sliding_windows_hold_past_the_window_through_the_cache_and_trees(noisy_pairs, family):
    """Prompt and generation run far past the window (8): greedy AR and speculative decoding, on the invariant
    passes and the fast ones, give transformers' own greedy output token for token."""
    from specexec.api import load
    from tests.conftest import WINDOW

    target, draft = noisy_pairs[family]
    ids = torch.randint(3, 96, (3 * WINDOW,), generator=torch.Generator().manual_seed(5)).tolist()
    hf = _hf(target)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, attention_mask=torch.ones(1, 24))
    want = ref[0, len(ids) :].tolist()
    for invariant in (True, False):
        engine = load(str(target), str(draft), device="cpu", context=128, progress=False, invariant=invariant)
        for method in ("ar", "specexec"):
            got = engine.generate(ids, 24, method=method).tokens
            assert got == want[: len(got)] and len(got) == 24, (invariant, method)


def test_qwen2_windows_count_only_when_enabled():
    from specexec.model.transformer import ModelConfig

    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    assert ModelConfig.from_hf({**base, "model_type": "qwen2", "sliding_window": 32768}).sliding_window is None
    on = {**base, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}
    assert ModelConfig.from_hf(on).sliding_window is None  # the one layer is below max_window_layers (28)
    assert ModelConfig.from_hf({**on, "max_window_layers": 0}).sliding_window == 4096
    assert ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": None}).sliding_window is None


def test_a_multimodal_gemma3_checkpoint_runs_its_text_decoder(tiny_models, tmp_path):
    """Gemma 3 4B+ ship as image-text checkpoints: ``model_type: gemma3`` with a ``text_config``, the decoder's
    tensors under ``model.language_model.``. The text decoder loads from it and computes the same logits."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_models["gemma3"]
    dst = tmp_path / "mm"
    shutil.copytree(src, dst)
    text = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    for f in dst.glob("*.safetensors"):
        sd = load_file(f)
        save_file({k.replace("model.", "model.language_model.", 1): v for k, v in sd.items()}, f)
    ref, mm = (load_model(p, torch.device("cpu"), torch.float32) for p in (src, dst))
    assert mm.cfg == ref.cfg
    ids = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(1))
    t = torch.arange(12)
    mask = t[None, :] <= t[:, None]
    assert torch.equal(mm.forward(ids, t, t, mask, mm.new_cache(16)), ref.forward(ids, t, t, mask, ref.new_cache(16)))
