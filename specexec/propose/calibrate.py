"""Calibrated tree scores: the draft's log-probs reshaped, online, into the chance that the target takes a child.

SpecExec grows the tree best first by the draft's path probability, prod q(child | parent), as its estimate of the
chance that the target's own path runs through a node. For a greedy target that estimate is off in one consistent
way: the target takes the draft's *first* choice more often than the draft's probability for it says. On the real
demo pair (Qwen2.5-Coder 0.5B drafting for 1.5B, 960 positions along the target's greedy text, code and prose), the
draft's top token was the target's 64% of the time where the draft gave it 0.40-0.50 and 82-89% where it gave it
0.60-0.80, while its second to fourth choices were taken about as often as their probabilities said
(docs/BENCHMARKS.md, "Calibrated tree scores"). A tree scored by q therefore spends its budget on second choices
near the root where a deeper first-choice path is worth more.

The model is one exponent per rank bucket: the chance of a child is q^alpha_0 for the draft's first choice and
q^alpha_1 for the others; a child's score is alpha_r * log q. With alpha_0 <= alpha_1 (enforced) the order among
siblings stays the draft's, so a child's rank is recoverable from the scores and the raw log q is the score divided
by the exponent. alpha is fitted by maximum likelihood on what the verification shows: at each node of the
accepted path the target's next token is known, so each of that node's children in the proposal is one
observation (its log q, whether it was the target's token). The fit moves away from 1 (the draft's own
probabilities) as observations accumulate, over a window of the most recent ones (a conversation that turns from
code to prose refits), and only greedy steps are observed or rescaled: a sampled step's tree holds coupled draws
(:func:`specexec.decoding.sampling.coupled_logprobs`), whose chances are not the target's argmax's.

Any score keeps the output exact: the scores only shape the tree, and the target verifies whatever is proposed.

The exponents live in one small device tensor per draft model (``scale``: alpha_0 then alpha_1 repeated), updated in
place, so captured growth levels (CUDA graphs, :mod:`specexec.propose.captured`) read the current values.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

# the exponents' range: below 0.2 a first choice at q = 0.01 would score as a 40% chance; above 2.5 nothing
# plausible
ALPHA_MIN, ALPHA_MAX = 0.2, 2.5
# the fit is blended with 1 (the draft's own probabilities) as n / (n + PRIOR_OBS) for n observations of a bucket
PRIOR_OBS = 64
WINDOW = (2048, 8192)  # the most recent observations kept per bucket (first choices; the others, ~B per node)
REFIT_EVERY = 16  # first-choice observations between two fits
P_CLAMP = 1e-6


@dataclass
class Snapshot:
    """What a step's proposal tree held before n-gram branches were merged in and any trim: the draft-grown nodes
    (host copies are taken at commit) and the exponents they were scored with."""

    parents: Tensor
    tokens: Tensor
    logp: Tensor
    alpha: tuple[float, float]


class ScoreCalibration:
    """The per-draft exponents, their observations and fit."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.alpha = (1.0, 1.0)
        self.scale = torch.ones(32, device=device)
        self.obs: tuple[deque[tuple[float, int]], deque[tuple[float, int]]] = (
            deque(maxlen=WINDOW[0]),
            deque(maxlen=WINDOW[1]),
        )
        self.observed = 0  # first-choice observations in all
        self._since_fit = 0

    def scales(self, branch: int) -> Tensor:
        """(branch,) the exponent of each rank (a view of the persistent tensor; grown, keeping values, if needed)."""
        if self.scale.shape[0] < branch:
            self.scale = torch.full((branch,), self.alpha[1], device=self.device)
            self.scale[0] = self.alpha[0]
        return self.scale[:branch]

    def apply(self, vals: Tensor) -> Tensor:
        """(k, B) the draft's top-B log-probs per row, best first -> their calibrated scores."""
        return vals * self.scales(vals.shape[-1])

    def snapshot(self, parents: Tensor, tokens: Tensor, logp: Tensor, size: int) -> Snapshot:
        """Copies of a proposal's first ``size`` nodes (device copies: no host wait)."""
        return Snapshot(parents[:size].clone(), tokens[:size].clone(), logp[:size].clone(), self.alpha)

    def observe(self, snap: Snapshot, accepted: list[int]) -> int:
        """Walk the snapshot from its root along ``accepted`` (the tokens the target emitted after the root, bonus
        last): at each node reached, its children are observations. Returns the nodes observed."""
        parents, tokens, logp = (x.tolist() for x in (snap.parents, snap.tokens, snap.logp))
        children: dict[int, list[int]] = {}
        for i in range(1, len(parents)):
            children.setdefault(parents[i], []).append(i)
        a0, a1 = snap.alpha
        node, seen = 0, 0
        for tok in accepted:
            kids = [c for c in children.get(node, ()) if math.isfinite(logp[c])]
            if not kids:
                break
            kids.sort(key=lambda c: logp[c], reverse=True)
            nxt = -1
            for rank, c in enumerate(kids):
                lq = min(0.0, (logp[c] - logp[node]) / (a0 if rank == 0 else a1))
                hit = int(tokens[c] == tok)
                self.obs[0 if rank == 0 else 1].append((lq, hit))
                if hit:
                    nxt = c
            seen += 1
            self._since_fit += 1
            if nxt < 0:
                break
            node = nxt
        self.observed += seen
        if self._since_fit >= REFIT_EVERY:
            self.refit()
        return seen

    def refit(self) -> None:
        """Fit both exponents on the kept observations, blend them with 1, and write the device tensor."""
        self._since_fit = 0
        a = [1.0, 1.0]
        for b in (0, 1):
            obs = self.obs[b]
            if not obs:
                continue
            lq = torch.tensor([o[0] for o in obs], dtype=torch.float64)
            y = torch.tensor([o[1] for o in obs], dtype=torch.float64)
            n = len(obs)
            w = n / (n + PRIOR_OBS * (1 if b == 0 else 8))  # the others: ~8x as many observations per node
            a[b] = 1.0 + (fit_exponent(lq, y) - 1.0) * w
        a[0] = min(a[0], a[1])  # siblings keep the draft's order
        self.alpha = (a[0], a[1])
        self.scale.fill_(a[1])
        self.scale[0] = a[0]


def log_likelihood(alpha: float, lq: Tensor, y: Tensor) -> float:
    """Mean log-likelihood of hits ``y`` under chances q^alpha (``lq``: log q)."""
    p = torch.exp(alpha * lq).clamp(P_CLAMP, 1 - P_CLAMP)
    return float((y * p.log() + (1 - y) * (1 - p).log()).mean())


def fit_exponent(lq: Tensor, y: Tensor, lo: float = ALPHA_MIN, hi: float = ALPHA_MAX, iters: int = 40) -> float:
    """The maximum-likelihood exponent in [lo, hi] (golden-section search; the log-likelihood is unimodal in alpha
    here: each term is concave in alpha)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = log_likelihood(c, lq, y), log_likelihood(d, lq, y)
    for _ in range(iters):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = log_likelihood(c, lq, y)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = log_likelihood(d, lq, y)
    return (a + b) / 2
