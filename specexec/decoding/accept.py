"""Acceptance: which draft tokens the target keeps, and the token it adds after them (p = target, q = draft).

Two exact rules; with either, the emitted tokens are distributed exactly as the target's own sampling
(``sampling.probs`` after temperature / top-k / top-p / min-p), whatever the draft proposed.

- Tree walk (AR, SpecExec at any budget, and every greedy method): at each visited node the target chooses
  its token x ~ p(.|node) (argmax when greedy); if a child carries x the walk moves there, else x is emitted
  as the bonus token and the step ends. Each emitted token is a draw from the target's conditional given the
  emitted prefix. The draw at output position ``pos`` is the Gumbel-max draw with the noise
  ``sampling.gumbels(seed, pos)``, so it does not depend on the tree: same seed, same text for AR and SpecExec
  (and a draft that draws with the same noise proposes the target's own draw whenever p and q are close).
- Speculative sampling along a chain (Leviathan et al. 2023, Alg. 1 / Thm. 1; Chen et al. 2023): draft token
  x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is
  drawn from norm(max(p_i - q_i, 0)); if all gamma are accepted a bonus is drawn from p_{gamma+1}.

A draft with a smaller vocabulary than the target (Qwen2.5-0.5B: 151936 rows, 72B: 152064) gives q fewer
columns than p; q is padded with zeros (the draft never proposes those tokens).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from specexec.config import SamplingConfig
from specexec.decoding.verify import walk
from specexec.steps import sampling
from specexec.steps.proposal import Proposal
from specexec.steps.tree import Tree


def accept(
    proposal: Proposal, logits: Tensor, samp: SamplingConfig, gen: torch.Generator | None, n: int
) -> tuple[list[int], list[int]]:
    """One step's acceptance by the rule the proposal names. Returns (accepted path: tree nodes root first,
    emitted tokens).

    ``logits`` (N, V): the target's logits at every tree node. ``proposal.q`` (gamma, Vq): the draft
    distributions the chain's tokens were drawn from (chain rule only). ``n``: the root's (pending token's)
    position, so node i's choice is the token at position n + 1 + depth(i). ``gen``: the generation's generator;
    its seed keys the tree walk's noise, its stream drives chain acceptance.
    """
    tree, q = proposal.tree, proposal.q
    if proposal.rule == "tree" or samp.greedy:
        key = 0 if gen is None else int(gen.initial_seed())  # gen is None only when greedy
        return walk(tree, tree_choices(tree, logits, samp, key, n))
    assert q is not None
    p = sampling.probs(logits, samp)  # (gamma+1, V)
    toks = tree.n_tokens[1:]  # (gamma,) the chain x_1..x_gamma
    if q.shape[0] != toks.shape[0]:
        raise ValueError(f"chain of {toks.shape[0]} tokens but {q.shape[0]} draft distributions")
    acc, nxt = speculative_accept(p[None], q[None], toks[None], gen)
    k = int(acc)
    return list(range(k + 1)), toks[:k].tolist() + [int(nxt)]


def tree_choices(tree: Tree, logits: Tensor, samp: SamplingConfig, seed: int | np.ndarray, n: int) -> Tensor:
    """The target's choice at every tree node: argmax when greedy, else the Gumbel-max draw from p(.|node) with
    the noise ``sampling.gumbels(seed, n + 1 + depth)`` of the node's output position.

    logits (N, V). ``seed`` an int gives (N,); an array of S seeds gives (S, N): S independent samples that
    share this tree (the statistical tests use that; the engine passes one seed).
    """
    if samp.greedy:
        return logits.argmax(-1)
    pos = n + 1 + tree.n_depth  # (N,)
    lp = sampling.logprobs(logits, samp)  # (N, V), -inf where filtered
    V = lp.shape[-1]
    if isinstance(seed, int):
        return sampling.draw(lp, seed, pos)
    g = sampling.gumbels(np.asarray(seed)[:, None], pos.cpu().numpy()[None, :], V)  # (S, N, V)
    return sampling.gumbel_max(lp[None], g)


def speculative_accept(p: Tensor, q: Tensor, tokens: Tensor, gen: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Speculative sampling for B chains at once (Leviathan et al. 2023, Alg. 1).

    p (B, gamma+1, V) target probabilities at the chain's positions (after the sampling filters); q (B, gamma, Vq)
    the draft distributions the tokens (B, gamma) were drawn from (x_i ~ q_i). Returns (accepted (B,) in
    0..gamma, the next token (B,)): the first ``accepted`` draft tokens are kept and the next token follows them.
    """
    B, g1, V = p.shape
    gamma = g1 - 1
    Vq = q.shape[-1]
    if Vq < V:  # a smaller draft vocabulary: the draft gives the missing tokens probability 0
        q = F.pad(q, (0, V - Vq))
    elif Vq > V:  # a larger one: the target gives the extra tokens probability 0 (never accepted)
        p = F.pad(p, (0, Vq - V))
    rows = torch.arange(B, device=p.device)
    u = torch.rand(B, gamma, generator=gen, device=p.device, dtype=torch.float64)
    px = p[:, :gamma].gather(-1, tokens[..., None]).squeeze(-1).double()  # (B, gamma)
    qx = q.gather(-1, tokens[..., None]).squeeze(-1).double()
    ok = u * qx < px  # u < p/q without dividing by q (q(x) > 0: x was drawn from q)
    k = ok.long().cumprod(-1).sum(-1)  # (B,) leading acceptances
    # At a rejection (k < gamma) the next token comes from norm(max(p_k - q_k, 0)); with q_gamma := 0 the same
    # expression is the bonus draw from p_gamma when everything was accepted.
    q_ext = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # (B, gamma+1, V)
    resid = (p[rows, k] - q_ext[rows, k]).clamp(min=0)  # (B, V)
    mass = resid.sum(-1, keepdim=True)
    # A rejection implies p_k(x) < q_k(x), so the residual has mass; guard against rounding all the same.
    resid = torch.where(mass > 0, resid / mass.clamp(min=torch.finfo(resid.dtype).tiny), p[rows, k])
    nxt = sampling.choose(resid, False, gen)
    return k, nxt
