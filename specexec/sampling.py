"""One logits → probabilities function for every method, target and draft alike.

Filters follow the usual definitions (as in transformers' logits warpers), applied after temperature:
top-k keeps the k most probable tokens; top-p keeps the smallest set of most probable tokens whose mass is
>= top_p (sorted descending; the top token is always kept); min-p keeps tokens with prob >= min_p * max prob.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specexec.config import SamplingConfig


def probs(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """logits (T, V) → probabilities (T, V) fp32 after temperature, top-k, top-p and min-p.

    Greedy (temperature 0) gives a one-hot distribution on the argmax.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    V = logits.shape[-1]
    if 0 < cfg.top_k < V:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        before = sp.cumsum(-1) - sp  # mass strictly before each token in descending order
        drop_sorted = before >= cfg.top_p  # keep while the mass before is < top_p (top token always kept)
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        p = p.masked_fill(drop, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if cfg.min_p > 0:
        p = p.masked_fill(p < cfg.min_p * p.max(-1, keepdim=True).values, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def logprobs(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """log of :func:`probs` (-inf for filtered tokens); for greedy, plain log-softmax (a tree heuristic)."""
    if cfg.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return probs(logits, cfg).log()


def choose(p: Tensor, greedy: bool, gen: torch.Generator | None) -> Tensor:
    """One token per row of p (T, V): argmax when greedy, else a draw."""
    if greedy:
        return p.argmax(-1)
    return torch.multinomial(p, 1, generator=gen).squeeze(-1)
