"""The prefix cache across conversations: A, B, then A resumed restores A's snapshot, computes only the new turn,
and gives exactly a fresh engine's tokens and log-probs; eviction keeps the byte budget, least recently used first;
budget 0 disables it."""

from __future__ import annotations

import pytest
import torch

from specexec.config import SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine
from specexec.loading.checkpoint import load_model, load_tokenizer

CPU = torch.device("cpu")
A = [5 + (i * 7) % 80 for i in range(40)]  # a long "system prompt + history"
B = [60, 61, 62, 63, 64, 65, 66]  # the chat window beside it
TURN = [11, 12, 13, 14]
SAMPLINGS = {"greedy": SamplingConfig(), "seeded": SamplingConfig(temperature=1.0, seed=7)}


def _engine(pair, budget: int | None, draft: bool = True) -> Engine:
    target, d = pair
    t = load_model(target, CPU, torch.float32)
    dm = load_model(d, CPU, torch.float32) if draft else None
    return Engine(t, load_tokenizer(target), dm, context=256, prefix_cache_bytes=budget)


@pytest.fixture(scope="module")
def engines(tiny_pair):
    return _engine(tiny_pair, 1 << 24), _engine(tiny_pair, 0)


@pytest.mark.parametrize("samp", list(SAMPLINGS))
@pytest.mark.parametrize("method", ["specexec", "ar"])
def test_resumed_conversation_restores_and_is_exact(engines, samp, method):
    e, fresh = engines
    s = SAMPLINGS[samp]
    kw = dict(method=method, sampling_cfg=s, tree=TreeConfig.fixed(8), logprobs=0)
    e.reset()
    a = e.generate(A, 12, **kw)
    b = e.generate(B, 6, **kw)
    assert b.stats.restored_tokens == 0 and b.stats.prefill_tokens == len(B) - 1
    assert e.prefix_cache_info()["entries"] == 1  # A's state, saved when B's prompt dropped it
    a2 = A + a.tokens + TURN
    r = e.generate(a2, 12, **kw)
    held = len(A) + len(a.tokens) - 1  # A's committed tokens in the cache (its last answer token was pending)
    assert r.stats.restored_tokens == held
    assert r.stats.prefill_tokens == len(a2) - 1 - held == len(TURN)
    info = e.prefix_cache_info()
    assert info["hits"] >= 1 and info["entries"] == 2  # A (restored) and B (saved when A' dropped it)
    fresh.reset()
    ref = fresh.generate(a2, 12, **kw)
    assert ref.stats.prefill_tokens == len(a2) - 1 and ref.stats.restored_tokens == 0
    assert r.tokens == ref.tokens
    assert r.logprobs is not None and ref.logprobs is not None
    assert [x.logprob for x in r.logprobs] == [x.logprob for x in ref.logprobs]  # bit-identical target logits
    n = min(e.state.t_len, fresh.state.t_len)
    assert torch.equal(e.state.cache.k[:, :, :n], fresh.state.cache.k[:, :, :n])  # the restored KV, bit for bit
    assert torch.equal(e.state.cache.v[:, :, :n], fresh.state.cache.v[:, :, :n])


def test_restored_draft_cache_equals_its_own(engines):
    """The draft's committed entries come back with the target's (a draft that keeps its own cache)."""
    e, _ = engines
    e.reset()
    a = e.generate(A, 8, method="specexec", tree=TreeConfig.fixed(8))
    e.generate(B, 4, method="specexec", tree=TreeConfig.fixed(8))
    dm = e.draft_model
    assert dm is not None and dm.prefix is None
    e.generate(A + a.tokens + TURN, 4, method="ar")  # ar leaves the draft alone: what was restored stays
    m = dm.length
    assert m >= len(A)
    pos = torch.arange(m)
    cache = dm.model.new_cache(m)
    dm.model.forward(torch.tensor(dm.tokens), pos, pos, pos[None, :] <= pos[:, None], cache)
    torch.testing.assert_close(dm.cache.k[:, :, :m], cache.k, atol=1e-5, rtol=1e-5)


def test_eviction_keeps_the_budget_lru_first(tiny_pair):
    probe = _engine(tiny_pair, 0, draft=False)
    per_token = 2 * probe.state.cache.k[:, :, :1].numel() * probe.state.cache.k.element_size()
    prompts = [[10 + i] + [20 + j for j in range(19)] for i in range(4)]
    new = 4
    snap = (len(prompts[0]) + new - 1) * per_token  # one saved conversation
    budget = int(2.5 * snap)
    e = _engine(tiny_pair, budget, draft=False)
    store = e.prefix_cache

    def run(p):
        r = e.generate(p, new, method="ar")
        assert store.nbytes <= budget and store.nbytes == sum(s.nbytes for s in store._entries.values())
        return r

    for p in prompts[:3]:
        run(p)
    assert [k[0] for k in store.keys] == [10, 11]  # live: 12
    r = run(prompts[0])  # resumes 10: 12 is saved, 11 (least recently used) goes
    assert r.stats.restored_tokens == len(prompts[0]) - 1
    assert sorted(k[0] for k in store.keys) == [10, 12] and store.keys[-1][0] == 10
    run(prompts[3])  # 10 again gave the answer its snapshot holds: no second copy, only a touch
    assert [k[0] for k in store.keys] == [12, 10]
    run(prompts[1])  # 13 is saved: 12, now the least recently used, goes
    assert [k[0] for k in store.keys] == [10, 13]
    e.reset()
    assert e.prefix_cache_info()["entries"] == 0 and e.prefix_cache_info()["bytes"] == 0


def test_budget_zero_disables(engines):
    _, off = engines
    off.reset()
    a = off.generate(A, 6, method="ar")
    off.generate(B, 4, method="ar")
    a2 = A + a.tokens + TURN
    r = off.generate(a2, 4, method="ar")
    assert r.stats.restored_tokens == 0 and r.stats.prefill_tokens == len(a2) - 1
    assert off.prefix_cache_info() == {"entries": 0, "bytes": 0, "budget_bytes": 0, "hits": 0, "restored_tokens": 0}


def test_negative_budget_refused(tiny_pair):
    from specexec.errors import ConfigError

    with pytest.raises(ConfigError, match="prefix_cache_bytes"):
        _engine(tiny_pair, -1, draft=False)


def test_self_draft_sharing_the_targets_prefix(tiny_models):
    """A self draft that reads the target's KV prefix is not snapshotted itself: after a restore it copies the
    restored entries from the target, entry for entry, and the output is a fresh engine's."""
    from specexec import api

    def load(budget):
        return api.load(
            str(tiny_models["qwen2"]), "self", device="cpu", dtype="fp32", draft_dtype="int8", context=256,
            tree=TreeConfig.fixed(8), prefix_cache_bytes=budget,
        )  # fmt: skip

    e, fresh = load(1 << 24), load(0)
    assert e.draft_model is not None and e.draft_model.prefix is not None
    kw = dict(method="specexec", tree=TreeConfig.fixed(8))
    a = e.generate(A, 10, **kw)
    e.generate(B, 4, **kw)
    a2 = A + a.tokens + TURN
    r = e.generate(a2, 10, **kw)
    assert r.stats.restored_tokens == len(A) + len(a.tokens) - 1
    assert r.tokens == fresh.generate(a2, 10, **kw).tokens
    d, st = e.draft_model, e.state
    n = d.length
    assert n == st.t_len and d.tokens == st.seq[:n]
    torch.testing.assert_close(d.cache.k[:, :, :n], st.cache.k[:, :, :n], rtol=0, atol=0)
