"""One logits → probabilities function for every method, target and draft alike, and the token draws.

Filters follow the usual definitions (transformers' logits warpers, in their order), applied after temperature:

- top-k keeps the k most probable tokens. Ties at the k-th value are all kept (so more than k tokens may
  survive): the kept set depends on the values only, never on token order.
- top-p (nucleus) sorts descending and keeps the smallest prefix whose mass is >= top_p; the top token is
  always kept. Ties with the last kept token are all kept, for the same reason.
- min-p keeps tokens with probability >= min_p x the top probability.

Filtered tokens get probability exactly 0 and the rest is renormalised.

Draws. The target's token at output position ``pos`` is drawn by the Gumbel-max trick: x = argmax_v
(log p(v) + g(seed, pos, v)) with standard Gumbel noise that depends only on (seed, pos, v) (:func:`gumbels`,
SplitMix64 over a counter), an exact draw from p. Draws therefore do not depend on how many tree nodes a step
verified, so the same seed gives the same text for AR and SpecExec at any budget, and a per-step budget chosen
from timings cannot change the output.

Coupled drafts. A draft that knows the seed draws its own token at ``pos`` with the SAME noise,
argmax_v (log q(v) + g(seed, pos, v)) (:func:`coupled_choice`): a draw from q that equals the target's draw from p
whenever the two distributions are close (Gumbel coupling: P(equal) >= (1 - TV) / (1 + TV)). Measured on the demo
pair at temperature 0.7 (``scripts/bench_coupling.py``, engine defaults, docs/bench_coupling.json): the target kept
the draft's coupled token at 0.636 of prose positions and 0.790 of code, against 0.563 / 0.762 for the draft's
argmax and 0.651 / 0.807 for speculative sampling's min(1, p/q) rule. Any draft token is verified by the exact
tree walk, so coupling changes acceptance only, never the output. Chain acceptance (speculative sampling) uses
a sequential ``torch.Generator`` (:func:`choose`).
"""

from __future__ import annotations

from collections import OrderedDict

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


_NOISE: OrderedDict[tuple[int, int, int], Tensor] = OrderedDict()  # (seed, pos, vocab) -> (vocab,) Gumbel row
_NOISE_ROWS = 48  # rows kept (a step needs its tree's depth of positions; rejected positions come back next step)


def gumbels(seed: int | np.ndarray, positions: int | np.ndarray | Tensor, vocab: int) -> Tensor:
    """Standard Gumbel noise g(seed, pos, v) float64 for tokens v < ``vocab``: shape (*broadcast, vocab).

    A pure function of its arguments, identical on every device: output ``v`` of a SplitMix64 stream keyed by
    (seed, pos), mapped through -log(-log(u)) with u in (0, 1). With an int ``seed`` the rows are computed once
    per (seed, pos) and cached (the draft and the target's walk need the same rows, a step after step); an
    array of seeds (the statistical tests: many samples sharing one tree) broadcasts against ``positions``.
    """
    pos = positions.cpu().numpy() if isinstance(positions, Tensor) else positions
    pos = np.asarray(pos, dtype=np.int64)
    if isinstance(seed, int):
        flat = pos.reshape(-1).tolist()
        rows = [_noise_row(seed, int(p), vocab) for p in flat]
        out = torch.stack(rows) if rows else torch.empty(0, vocab, dtype=torch.float64)
        return out.view(*pos.shape, vocab)
    return _gumbel(_stream_keys(np.asarray(seed), pos), vocab)


def _stream_keys(seed: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The SplitMix64 stream key of each (seed, pos) pair (numpy broadcasting; int64 seeds wrap modulo 2**64)."""
    s, p = np.broadcast_arrays(seed.astype(np.uint64), pos.astype(np.uint64))
    shape = s.shape
    s, p = np.ascontiguousarray(s).reshape(-1), np.ascontiguousarray(p).reshape(-1)  # 1-d: wrapping, no warnings
    return _mix64(_mix64(s) + (p + np.uint64(1)) * _GOLDEN).reshape(shape)


def _noise_row(seed: int, pos: int, vocab: int) -> Tensor:
    k = (seed & _M64, pos, vocab)
    row = _NOISE.get(k)
    if row is None:
        row = _gumbel(_stream_keys(np.array([seed & _M64], dtype=np.uint64), np.array([pos])), vocab)[0]
        _NOISE[k] = row
        while len(_NOISE) > _NOISE_ROWS:
            _NOISE.popitem(last=False)
    else:
        _NOISE.move_to_end(k)
    return row


_TOKENS: dict[int, np.ndarray] = {}


def _gumbel(kp: np.ndarray, vocab: int) -> Tensor:
    """-log(-log(u)) for u from the SplitMix64 streams keyed ``kp`` (any shape), outputs 0..vocab-1:
    shape (*kp.shape, vocab)."""
    steps = _TOKENS.get(vocab)
    if steps is None:
        steps = _TOKENS[vocab] = (np.arange(vocab, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
    z = _mix64((kp.reshape(-1, 1) + steps).reshape(-1)).reshape(*kp.shape, vocab)
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # in (0, 1): both logs finite
    return torch.from_numpy(-np.log(-np.log(u)))


def gumbel_max(logp: Tensor, noise: Tensor, index: Tensor | None = None, chunk: int = 256) -> Tensor:
    """argmax over the last dim of log-probabilities ``logp`` (..., V) (-inf: never chosen) plus Gumbel noise (its
    last dim may be longer: only the first V tokens are used). ``index`` (R,): row r of a 2-d ``logp`` (R, V) uses
    noise row index[r] (positions shared by many tree nodes are drawn once); without it the shapes broadcast.
    Rows are done ``chunk`` at a time (bounded memory for big trees and vocabularies)."""
    V = logp.shape[-1]
    noise = noise[..., :V].to(logp.device)
    if index is None:
        return (logp.double() + noise).argmax(-1)
    out = torch.empty(logp.shape[0], dtype=torch.long, device=logp.device)
    for s in range(0, logp.shape[0], chunk):
        out[s : s + chunk] = (logp[s : s + chunk].double() + noise[index[s : s + chunk]]).argmax(-1)
    return out


def noise_at(seed: int, positions: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """The walk's noise for output ``positions`` (T,): (rows (D, vocab) float64 on the positions' device, one per
    distinct position; index (T,) of each position's row)."""
    uniq, inv = torch.unique(positions, return_inverse=True)
    return gumbels(seed, uniq.cpu().numpy(), vocab).to(positions.device), inv


def coupled_logprobs(lq: Tensor, seed: int, positions: Tensor | list[int]) -> Tensor:
    """A draft's log-probs ``lq`` (T, V) (after the sampling filters) perturbed by the walk's noise at output
    ``positions`` (T,) and renormalised: log softmax(log q + g). Its argmax is the coupled draw; as a score it
    predicts the target's agreement (``scripts/bench_coupling.py``, demo pair, temperature 0.7, prose: the coupled
    token was the target's draw at 0.28 / 0.29 / 0.47 / 0.58 / 0.88 of positions where this probability fell in
    [0, .2) / [.2, .4) / [.4, .6) / [.6, .8) / [.8, 1]), so best-first trees and chain stops use it as their draft
    log-probabilities."""
    pos = positions if isinstance(positions, Tensor) else torch.tensor(positions, dtype=torch.long)
    rows, inv = noise_at(seed, pos.to(lq.device), lq.shape[-1])
    return torch.log_softmax(lq.double() + rows[inv], dim=-1).float()


def coupled_choice(logits: Tensor, cfg: SamplingConfig, seed: int, positions: Tensor | list[int]) -> Tensor:
    """The draft's tokens (T,) for rows of ``logits`` (T, V) at output ``positions`` (T,), drawn from
    q = :func:`probs` with the noise the target's walk will use there (greedy: the argmax)."""
    if cfg.greedy:
        return logits.argmax(-1)
    pos = positions if isinstance(positions, Tensor) else torch.tensor(positions, dtype=torch.long)
    rows, inv = noise_at(seed, pos.to(logits.device), logits.shape[-1])
    return gumbel_max(logprobs(logits, cfg), rows, inv)


def _mix64(z: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))
