"""``Engine.score``: teacher-forced log-probs of a given text are plain decoding's, bit for bit (shape-invariant
passes), whatever the chunk, and its NLL and perplexity are what their names say."""

from __future__ import annotations

import math

import pytest
import torch

from specexec.decoding.engine import Engine
from specexec.errors import ConfigError, InvalidPrompt
from specexec.loading.checkpoint import load_model, load_tokenizer
from tests.conftest import make_tiny

CPU = torch.device("cpu")


@pytest.fixture(
    scope="module", params=[("llama", torch.float32), ("gemma2", torch.bfloat16)], ids=["llama", "gemma2-bf16"]
)
def engine(request, tmp_path_factory) -> Engine:
    family, dtype = request.param
    path = make_tiny(tmp_path_factory.mktemp(f"score-{family}"), family, seed=5)
    return Engine(load_model(path, CPU, dtype), load_tokenizer(path), context=128)


def one_token_logits(model, ids: list[int]) -> torch.Tensor:
    """Plain decoding's logits: one one-token pass per position, each after the ones before it."""
    cache = model.new_cache(len(ids) + 1)
    rows = []
    for i, t in enumerate(ids):
        p = torch.tensor([i])
        rows.append(model.forward(torch.tensor([t]), p, p, torch.ones(1, i + 1, dtype=torch.bool), cache))
    return torch.cat(rows)


def test_scores_are_plain_decodings_log_probs_bit_for_bit(engine):
    ids = torch.randint(3, engine.target.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ar = engine.generate(ids, 24, method="ar", logprobs=0)
    assert ar.logprobs is not None and len(ar.tokens) == 24
    seq = ids + ar.tokens
    want = torch.stack([torch.log_softmax(row[None], -1)[0] for row in one_token_logits(engine.target, seq)[:-1]])
    picked = want.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    for chunk in (1, 5, 512):
        s = engine.score(seq, chunk=chunk)
        assert s.tokens == seq[1:] and s.start == 1 and s.logprobs.dtype == torch.float32
        assert torch.equal(s.logprobs, picked), chunk
        assert s.top1[len(ids) - 1 :] == ar.tokens  # greedy decoding's choices
        answer = engine.score(seq, start=len(ids), chunk=chunk, logits=True)
        assert answer.tokens == ar.tokens and answer.top1 == ar.tokens
        assert answer.logprobs.tolist() == [lp.logprob for lp in ar.logprobs]  # what generate reports
        assert answer.logits is not None and answer.logits.shape == (24, engine.target.cfg.vocab_size)
        assert torch.equal(torch.log_softmax(answer.logits, -1), want[len(ids) - 1 :])
    # the engine generates as before afterwards (its committed sequence was forgotten, not corrupted)
    assert engine.generate(ids, 24, method="ar").tokens == ar.tokens


def test_nll_and_perplexity_follow_from_the_log_probs(engine):
    s = engine.score("the quick brown fox jumps over the lazy dog")
    n = len(s.tokens)
    assert n >= 2 and s.nll == pytest.approx(-sum(s.logprobs.tolist()))
    assert s.mean_nll == pytest.approx(s.nll / n) and s.perplexity == pytest.approx(math.exp(s.nll / n))
    assert s.perplexity == math.exp(s.mean_nll)
    j = s.to_json()
    assert j["perplexity"] == s.perplexity and len(j["logprobs"]) == n and j["tokens"] == s.tokens


def test_bad_score_arguments_are_refused(engine):
    with pytest.raises(ConfigError, match="start"):
        engine.score([5, 6, 7], start=3)
    with pytest.raises(ConfigError, match="start"):
        engine.score([5], start=1)
    with pytest.raises(ConfigError, match="chunk"):
        engine.score([5, 6, 7], chunk=0)
    with pytest.raises(InvalidPrompt):
        engine.score([5] * 200)
