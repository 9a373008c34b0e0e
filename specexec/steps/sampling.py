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
pair at temperature 0.7 (engine defaults, docs/BENCHMARKS.md): the target kept the draft's coupled token at 0.636
of prose positions and 0.790 of code, against 0.563 / 0.762 for the draft's argmax and 0.651 / 0.807 for
speculative sampling's min(1, p/q) rule. Any draft token is verified by the exact tree walk, so coupling changes
acceptance only, never the output. Chain acceptance (speculative sampling) uses a sequential ``torch.Generator``
(:func:`choose`).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import Tensor

from specexec.config import SamplingConfig

_M64 = (1 << 64) - 1


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


_NOISE: OrderedDict[tuple[int, int, int], Tensor] = OrderedDict()  # (seed, pos, vocab) -> (vocab,) Gumbel row (CPU)
_NOISE_ROWS = 48  # rows kept (a step needs its tree's depth of positions; rejected positions come back next step)
DEVICE_CHUNK = 64  # rows of noise made at once on an accelerator (int64 + float64 temporaries: 64 x V x 16 bytes)


def gumbels(seed: int | np.ndarray, positions: int | np.ndarray | list[int] | Tensor, vocab: int) -> Tensor:
    """Standard Gumbel noise g(seed, pos, v) float64 for tokens v < ``vocab``: shape (*broadcast, vocab), on the
    device of ``positions`` (a tensor) or the CPU.

    A pure function of its arguments: output ``v`` of a SplitMix64 stream keyed by (seed, pos) -- the same integer
    bits on every device (wrapping int64 tensor arithmetic) -- mapped through -log(-log(u)) with u in (0, 1). With
    an int ``seed`` on the CPU the rows are computed once per (seed, pos) and cached (the draft and the target's
    walk need the same rows, step after step); on an accelerator they are made where they are used, with no host
    work or copy. An array of seeds (the statistical tests: many samples sharing one tree) broadcasts against
    ``positions``.
    """
    if isinstance(positions, Tensor):
        pos = positions.long()
    else:
        pos = torch.from_numpy(np.asarray(positions, dtype=np.int64))
    if isinstance(seed, int):
        if pos.device.type == "cpu":
            flat = pos.reshape(-1).tolist()
            rows = [_noise_row(seed, int(p), vocab) for p in flat]
            out = torch.stack(rows) if rows else torch.empty(0, vocab, dtype=torch.float64)
            return out.view(*pos.shape, vocab)
        return _rows(seed, pos, vocab)
    s = torch.from_numpy(np.asarray(seed).astype(np.int64)).to(pos.device)  # uint64 bit patterns, wrapped
    s, pos = torch.broadcast_tensors(s, pos)
    return _gumbel(_stream_keys(s, pos), vocab)


def _signed(x: int) -> int:
    """The int64 whose bits are ``x`` modulo 2**64."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _srl(z: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 tensors read as uint64 (torch's ``>>`` on int64 is arithmetic)."""
    return (z >> k).bitwise_and_((1 << (64 - k)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """The SplitMix64 finaliser on int64 tensors holding uint64 bits (two's-complement wrapping arithmetic)."""
    z = (z ^ _srl(z, 30)).mul_(_MIX1)  # a new tensor (``z`` may be a broadcast view); in place from here on
    z.bitwise_xor_(_srl(z, 27)).mul_(_MIX2)
    return z.bitwise_xor_(_srl(z, 31))


def _rows(seed: int, pos: Tensor, vocab: int) -> Tensor:
    """Uncached noise (*pos.shape, vocab) for one int seed, made on the positions' device."""
    return _gumbel(_stream_keys(torch.full_like(pos, _signed(seed)), pos), vocab)


def _stream_keys(seed: Tensor, pos: Tensor) -> Tensor:
    """The SplitMix64 stream key of each (seed, pos) pair (int64 tensors of one shape)."""
    return _mix64(_mix64(seed) + (pos + 1) * _GOLDEN)


def _noise_row(seed: int, pos: int, vocab: int) -> Tensor:
    k = (seed & _M64, pos, vocab)
    row = _NOISE.get(k)
    if row is None:
        row = _gumbel(_stream_keys(torch.tensor([_signed(seed)]), torch.tensor([pos])), vocab)[0]
        _NOISE[k] = row
        while len(_NOISE) > _NOISE_ROWS:
            _NOISE.popitem(last=False)
    else:
        _NOISE.move_to_end(k)
    return row


_TOKENS: dict[tuple[int, torch.device], Tensor] = {}


def _gumbel(keys: Tensor, vocab: int) -> Tensor:
    """-log(-log(u)) for u from the SplitMix64 streams keyed ``keys`` (int64, any shape), outputs 0..vocab-1:
    shape (*keys.shape, vocab) float64 on the keys' device."""
    steps = _TOKENS.get((vocab, keys.device))
    if steps is None:
        steps = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device).mul_(_GOLDEN)
        _TOKENS[vocab, keys.device] = steps
    u = _srl(_mix64(keys.unsqueeze(-1) + steps), 11).double().add_(0.5).mul_(2.0**-53)  # in (0, 1): logs finite
    return u.log_().neg_().log_().neg_()


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


def draw(logp: Tensor, seed: int, positions: Tensor, cache: bool | None = None) -> Tensor:
    """The Gumbel-max draws (R,) for rows of log-probabilities ``logp`` (R, V) at output ``positions`` (R,) with
    the walk's noise for ``seed``: what ``gumbel_max(logp, gumbels(seed, positions, V))`` gives, in bounded memory.

    ``cache`` (default: on a CPU): one cached noise row per distinct position (:func:`noise_at`). Otherwise (an
    accelerator) the noise of :data:`DEVICE_CHUNK` rows at a time is made on the device next to its logits: no
    ``torch.unique``, no host work, no host synchronisation.
    """
    pos = positions.to(logp.device)
    if cache is None:
        cache = logp.device.type == "cpu"
    if cache:
        return gumbel_max(logp, *noise_at(seed, pos, logp.shape[-1]))
    V = logp.shape[-1]
    out = torch.empty(logp.shape[0], dtype=torch.long, device=logp.device)
    for a in range(0, logp.shape[0], DEVICE_CHUNK):
        g = _rows(seed, pos[a : a + DEVICE_CHUNK], V)
        out[a : a + DEVICE_CHUNK] = g.add_(logp[a : a + DEVICE_CHUNK]).argmax(-1)
    return out


def noise_at(seed: int, positions: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """The walk's noise for output ``positions`` (T,): (rows (D, vocab) float64 on the positions' device, one per
    distinct position; index (T,) of each position's row). ``torch.unique`` synchronises with an accelerator:
    the engine's paths there use :func:`draw` and :func:`coupled_logprobs`, which make the rows in place."""
    uniq, inv = torch.unique(positions, return_inverse=True)
    return gumbels(seed, uniq.cpu(), vocab).to(positions.device), inv


def coupled_logprobs(lq: Tensor, seed: int, positions: Tensor | list[int]) -> Tensor:
    """A draft's log-probs ``lq`` (T, V) (after the sampling filters) perturbed by the walk's noise at output
    ``positions`` (T,) and renormalised: log softmax(log q + g). Its argmax is the coupled draw; as a score it
    predicts the target's agreement (demo pair, temperature 0.7, prose: the coupled
    token was the target's draw at 0.28 / 0.29 / 0.47 / 0.58 / 0.88 of positions where this probability fell in
    [0, .2) / [.2, .4) / [.4, .6) / [.6, .8) / [.8, 1]), so best-first trees and chain stops use it as their draft
    log-probabilities. On a CPU one cached row per distinct position; on an accelerator a row per draft row, made
    on the device (T is one level of draft rows: no host synchronisation)."""
    pos = positions if isinstance(positions, Tensor) else torch.tensor(positions, dtype=torch.long)
    pos = pos.to(lq.device)
    if lq.device.type == "cpu":
        rows, inv = noise_at(seed, pos, lq.shape[-1])
        g = rows[inv]
    else:
        g = _rows(seed, pos, lq.shape[-1])
    return torch.log_softmax(g.add_(lq), dim=-1).float()


def coupled_choice(logits: Tensor, cfg: SamplingConfig, seed: int, positions: Tensor | list[int]) -> Tensor:
    """The draft's tokens (T,) for rows of ``logits`` (T, V) at output ``positions`` (T,), drawn from
    q = :func:`probs` with the noise the target's walk will use there (greedy: the argmax)."""
    if cfg.greedy:
        return logits.argmax(-1)
    pos = positions if isinstance(positions, Tensor) else torch.tensor(positions, dtype=torch.long)
    return draw(logprobs(logits, cfg), seed, pos)
