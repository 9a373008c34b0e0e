"""Planted-agreement model pairs (specexec.loading.synthetic): what the GPU benchmark times the engine with."""

from __future__ import annotations

import pytest
import torch

from specexec.config import SamplingConfig, TreeConfig
from specexec.decoding import loop as decode
from specexec.decoding.engine import Engine
from specexec.loading import synthetic
from specexec.model.transformer import ModelConfig

CPU = torch.device("cpu")
V = 512


def _cfg(hidden: int, layers: int = 2) -> ModelConfig:
    return ModelConfig(
        vocab_size=V,
        hidden_size=hidden,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
    )


@pytest.fixture(scope="module")
def pair():
    t_cfg, d_cfg = _cfg(4096), _cfg(2048)
    planted = synthetic.plant(V, *synthetic.CODE, hidden=(t_cfg.hidden_size, d_cfg.hidden_size))
    tg = synthetic.planted_globals(
        planted, planted.z_target, t_cfg.hidden_size, torch.float32, CPU, seed=1, margin=synthetic.TARGET_MARGIN
    )
    dg = synthetic.planted_globals(planted, planted.z_draft, d_cfg.hidden_size, torch.float32, CPU, seed=2)
    target = synthetic.resident_model(t_cfg, tg, torch.float32, CPU, seed=10)
    draft = synthetic.resident_model(d_cfg, dg, torch.float32, CPU, seed=20, distinct=1)
    return planted, target, draft


def test_plant_checks_its_arguments():
    with pytest.raises(ValueError, match="agreement <= coverage"):
        synthetic.plant(V, agreement=0.9, coverage=0.8)
    with pytest.raises(ValueError, match="successors"):
        synthetic.plant(8, k=8)


def test_planted_tables_have_the_asked_rates_and_one_greedy_cycle():
    for agree, cover in (synthetic.CODE, synthetic.PROSE, (0.3, 0.5)):
        p = synthetic.plant(4000, agree, cover, seed=3)
        assert abs(p.agreement - agree) < 0.03 and abs(p.coverage - cover) < 0.03, (agree, p.agreement, p.coverage)
        assert bool((p.z_target.argmax(-1) == 0).all())  # successor 0 is the target's choice
        assert all(len(set(row)) == p.succ.shape[1] for row in p.succ[:200].tolist())  # distinct successors
    nxt = p.succ[:, 0].tolist()  # the greedy map is one cycle through the whole vocabulary
    x, seen = 0, set()
    for _ in range(4000):
        seen.add(x)
        x = nxt[x]
    assert x == 0 and len(seen) == 4000


def test_layers_add_nothing_visible_and_the_logits_are_planted(pair):
    planted, target, draft = pair
    ids = torch.arange(64)
    for model in (target, draft):  # one-token contexts at several positions: the bigram table, whatever the layer
        cache = model.new_cache(128)
        pos = torch.arange(64) % 7
        logits = model.forward(ids, pos, torch.arange(64), torch.eye(64, dtype=torch.bool), cache)
        ref = synthetic.bigram_logits(model.globals, ids)
        assert torch.allclose(logits, ref, atol=1e-2, rtol=1e-3)
    # the target's logits on its successors are the planted ones, up to the lm_head's cross-talk: noise of std
    # |z| / sqrt(hidden) (a mean absolute deviation of 0.8 of that)
    got = synthetic.bigram_logits(target.globals, torch.arange(V)).gather(1, planted.succ)
    cross = float((planted.z_target**2).sum(-1).mean().sqrt()) / target.cfg.hidden_size**0.5
    assert (got - planted.z_target).abs().mean() < cross


def test_a_target_has_no_near_ties():
    p = synthetic.plant(V, seed=4, hidden=(256,))
    plain = synthetic.planted_globals(p, p.z_target, 256, torch.bfloat16, CPU, seed=1)
    wide = synthetic.planted_globals(p, p.z_target, 256, torch.bfloat16, CPU, seed=1, margin=0.5)

    def gaps(g):
        top = synthetic.bigram_logits(g, torch.arange(V)).topk(2, dim=-1).values
        return top[:, 0] - top[:, 1]

    assert float(gaps(plain).min()) < 0.5  # 256 hidden dims: cross-talk makes plenty of near-ties
    assert float(gaps(wide).min()) >= 0.5 - 1e-3
    assert float((wide.embed.float().norm(dim=-1) / plain.embed.float().norm(dim=-1)).std()) < 0.01  # same norm


def test_realised_agreement_is_near_the_planted_one(pair):
    planted, target, draft = pair
    r = synthetic.realised(target.globals, draft.globals)
    # 4096/2048 hidden dims: the lm_heads' cross-talk is noticeable, and `plant` discounts it
    assert abs(r["agreement"] - synthetic.CODE[0]) < 0.1, r
    assert abs(r["top8"] - synthetic.CODE[1]) < 0.05, r
    assert 0.3 < r["target_top1_p"] < 0.95, r


def test_the_engine_accepts_on_a_planted_pair_and_stays_exact(pair):
    """Unlike random weights (nothing accepted), a planted pair gives real speculative steps, exactly AR's text."""
    planted, target, draft = pair
    eng = Engine(target, synthetic.tokenizer_info(V), draft, context=256)
    prompts = synthetic.prompts(planted, 3, 16)
    for p in prompts:
        ar = eng.generate(p, 40, method="ar")
        walk, x = [], p[-1]  # AR follows the target's greedy walk over its bigram table
        for _ in range(40):
            x = int(synthetic.bigram_logits(target.globals, torch.tensor([x])).argmax())
            walk.append(x)
        assert ar.tokens == walk
        for tree in (TreeConfig.fixed(32), TreeConfig.fixed(32, grow="ahead")):
            r = eng.generate(p, 40, method="specexec", tree=tree)
            assert r.tokens == ar.tokens
            assert r.stats.tokens_per_step > 2.0, r.stats  # random weights would give ~1.0
        s = SamplingConfig(temperature=0.8, seed=5)
        assert (
            eng.generate(p, 24, method="specexec", tree=TreeConfig.fixed(16), sampling_cfg=s).tokens
            == eng.generate(p, 24, method="ar", sampling_cfg=s).tokens
        )
    text = eng.generate(prompts[0], 3, method="ar").text
    assert text.count("<") == 3 and synthetic.SyntheticTokenizer(V).encode(text) == eng.seq[-3:]


def test_low_bit_planted_draft_builds(pair):
    planted, _, draft = pair
    q = synthetic.resident_model(draft.cfg, draft.globals, torch.float32, CPU, seed=20, distinct=1, fmt="int8")
    ids = torch.arange(16)
    a = q.forward(ids, ids * 0, ids, torch.eye(16, dtype=torch.bool), q.new_cache(32)).argmax(-1)
    b = synthetic.bigram_logits(draft.globals, ids).argmax(-1)
    assert (a == b).float().mean() > 0.8  # int8 moves a few near-ties, not the table


def test_decode_sync_waits_for_the_current_stream_only(monkeypatch):
    """A device-wide synchronize in the step loop would wait for the streamer's prefetch of the next pass's first
    layers: the loop waits for its own stream only."""
    waited = []

    class Stream:
        def synchronize(self):
            waited.append("stream")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append("device"))
    decode.sync(torch.device("cuda"))
    decode.sync(CPU)
    assert waited == ["stream"]
