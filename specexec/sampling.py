"""One logits → probabilities function for every method, target and draft alike, and the token draws.

Filters follow the usual definitions (transformers' logits warpers, in their order), applied after temperature:

- top-k keeps the k most probable tokens. Ties at the k-th value are all kept (so more than k tokens may
  survive): the kept set depends on the values only, never on token order.
- top-p (nucleus) sorts descending and keeps the smallest prefix whose mass is >= top_p; the top token is
  always kept. Ties with the last kept token are all kept, for the same reason.
- min-p keeps tokens with probability >= min_p x the top probability.

Filtered tokens get probability exactly 0 and the rest is renormalised.

Draws. The target's token at output position ``pos`` is drawn by inverse-CDF sampling with a uniform that
depends only on (seed, pos) (:func:`uniforms`, SplitMix64 over a counter). Draws therefore do not depend on
how many tree nodes a step verified, so the same seed gives the same text for AR and SpecExec at any budget,
and a per-step budget chosen from timings cannot change the output. Chain drafting and chain acceptance use a
sequential ``torch.Generator`` (:func:`choose`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specexec.config import SamplingConfig

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def probs(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """logits (..., V) → probabilities (..., V) fp32 after temperature, top-k, top-p and min-p.

    Greedy (temperature 0) gives a one-hot distribution on the argmax (the first one on ties).
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
        sp = torch.sort(p, dim=-1, descending=True).values
        before = sp.cumsum(-1) - sp  # mass strictly before each token in descending order
        n_keep = (before < cfg.top_p).sum(-1, keepdim=True)  # >= 1: the top token has nothing before it
        cut = sp.gather(-1, n_keep - 1)  # the smallest kept probability
        p = p.masked_fill(p < cut, 0.0)
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
    """One token per row of p (T, V): argmax when greedy, else a draw from the generator's stream."""
    if greedy:
        return p.argmax(-1)
    return torch.multinomial(p, 1, generator=gen).squeeze(-1)


def uniforms(seed: int | np.ndarray, positions: int | np.ndarray | Tensor) -> Tensor:
    """Uniforms in [0, 1) float64, one per (seed, position) pair (numpy broadcasting): u(seed, pos).

    SplitMix64 (Steele et al. 2014): output ``pos`` of the stream keyed by the mixed seed. A pure function,
    identical on every device, of its arguments; distinct seeds give independent-looking streams.
    """
    pos = positions.cpu().numpy() if isinstance(positions, Tensor) else positions
    pos = np.atleast_1d(np.asarray(pos, dtype=np.int64)).astype(np.uint64)
    s = np.uint64(seed & _M64) if isinstance(seed, int) else seed  # int64 arrays wrap modulo 2**64 below
    key = _mix64(np.atleast_1d(np.asarray(s)).astype(np.uint64))
    z = _mix64(key + (pos + np.uint64(1)) * _GOLDEN)
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def _mix64(z: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def inverse_cdf(p: Tensor, u: Tensor, chunk: int = 256) -> Tensor:
    """The token x of each row of p (R, V) with CDF(x-1) <= u * total < CDF(x): a draw from p when u ~ U[0, 1).

    u (R,) float64. The CDF is accumulated in float64, ``chunk`` rows at a time (bounded memory for large
    vocabularies). Zero-probability tokens are never returned.
    """
    out = torch.empty(p.shape[0], dtype=torch.long, device=p.device)
    u = u.to(device=p.device, dtype=torch.float64)
    idx = torch.arange(p.shape[-1], device=p.device)
    for s in range(0, p.shape[0], chunk):
        rows = p[s : s + chunk]
        cdf = rows.cumsum(-1, dtype=torch.float64)  # (r, V)
        target = (u[s : s + chunk] * cdf[:, -1]).unsqueeze(-1)  # (r, 1)
        x = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        last = torch.where(rows > 0, idx, -1).max(-1).values  # guards u * total rounding up to total
        out[s : s + chunk] = torch.minimum(x, last)
    return out
