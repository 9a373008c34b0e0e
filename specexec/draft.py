"""Draft side: grows the SpecExec tree (batched best-first search) and the chain of chain-speculative decoding.

SpecExec (Svirschevski et al., 2024, arXiv 2406.02532) builds the draft tree that contains the ``budget`` most
probable continuations under the draft model q: a parallel Dijkstra over -log q. Each level takes up to
``max_beams`` best unexpanded nodes whose cumulative log-prob can still enter the top ``budget``, runs ONE draft
forward over them (tree mask, draft KV cache by slot), proposes each one's top ``max_branch`` children, and keeps
only the best ``budget`` nodes of the whole tree. Growth stops when no unexpanded node beats the budget-th best
(its children could not enter), after ``max_depth`` levels, or -- with ``early_stop`` and known costs
(:class:`GrowCost`), once the tree holds ``budget`` nodes -- when one more pass is expected to add fewer tokens
than its time is worth; the result is trimmed to exactly ``budget`` nodes.

Early stop: with E = 1 + sum of the tree's path probabilities (expected tokens emitted; SpecExec §3), a step
costs T = passes * pass_s + target_s. One more pass that adds g expected tokens is worth it iff
(E + g) / (T + pass_s) >= E / T, i.e. g * T >= E * pass_s. g is bounded by U, the path-probability mass of the
nodes the pass would expand (their children's mass can never exceed it), and the rule uses that bound: it stops
only when even the best case is not worth a pass. (Predicting g from the last pass's gain stopped too early:
on GPU costs it cost code prompts a quarter of their tokens per step.) Any tree is verified exactly, so the rule
only moves speed.

Cache slots: the committed sequence occupies draft slots [0, n); the root (pending token) sits at slot n; the
nodes expanded during growth get slots n+1, n+2, ... in expansion order (pruned nodes leave unused slots behind,
harmless: no mask row points at them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from specexec.config import TreeConfig
from specexec.kv_cache import KVCache
from specexec.graphs import StaticPasses
from specexec.model import Transformer
from specexec.tree import Tree

LogProbFn = Callable[[Tensor], Tensor]  # logits (T, V) fp32 -> log-probabilities (T, V)


def default_logprobs(logits: Tensor) -> Tensor:
    return torch.log_softmax(logits, dim=-1)


@dataclass
class GrowStats:
    """What one tree growth did (recorded per step; the e2e benchmark replays these shapes)."""

    passes: int = 0  # draft forwards, the catch-up/root pass included
    beams: list[int] = field(default_factory=list)  # tokens per draft pass
    tree_size: int = 0  # final non-root nodes
    stopped_early: bool = False  # growth ended by the early-stop rule (not by max_depth or an empty frontier)


@dataclass
class GrowCost:
    """What a step costs, for early stopping (measured by the engine; see the module docstring)."""

    pass_s: float  # seconds per draft pass
    target_s: float  # seconds of the target's verification of a tree of this budget
    acc_scale: float = 1.0  # actual / predicted tokens per step (the draft's over- or under-confidence)

    def more(self, expected: float, gain: float, passes: int) -> bool:
        """Run one more draft pass? ``expected``: E[emitted] of the tree now; ``gain``: the pass's predicted
        gain in E; ``passes``: passes run so far."""
        e = 1.0 + self.acc_scale * (expected - 1.0)
        return self.acc_scale * gain * (passes * self.pass_s + self.target_s) >= e * self.pass_s


class Drafter:
    """Owns the draft model's KV cache; ``length`` committed tokens (a prefix of the sequence) are in it.

    ``static``: run passes of up to ``static_rows`` tokens with padded static shapes (CUDA graphs on a GPU; see
    :mod:`specexec.graphs`); None = only on CUDA. The cache's last slot is reserved as the padding scratch slot.
    """

    def __init__(self, model: Transformer, capacity: int, static: bool | None = None, static_rows: int = 128,
                 ) -> None:
        self.model = model
        self.cache: KVCache = model.new_cache(capacity + 1)
        self.usable = capacity  # slots [0, capacity) hold real entries; slot ``capacity`` is scratch
        self.length = 0
        use = model.device.type == "cuda" if static is None else static
        self.static = StaticPasses(model, self.cache, static_rows) if use else None

    def _forward(self, tokens: Tensor, pos: Tensor, slots: Tensor, mask: Tensor, last_only: bool = False) -> Tensor:
        """One draft pass (static/graphed when it fits a bucket, else eager)."""
        tokens = self._in_vocab(tokens)
        if self.static is not None and tokens.shape[0] <= self.static.max_rows:
            out = self.static.forward(tokens, pos, slots, mask)
            return out[-1:] if last_only else out
        return self.model.forward(tokens, pos, slots, mask, self.cache,
                                  logits_rows=slice(-1, None) if last_only else None)

    def _in_vocab(self, tokens: Tensor) -> Tensor:
        """Target tokens the draft's vocabulary lacks (e.g. a 72B target's padding rows) become token 0.

        The draft only proposes; what it is fed changes its guesses, never the output.
        """
        V = self.model.cfg.vocab_size
        return torch.where(tokens < V, tokens, torch.zeros_like(tokens))

    def reset(self, keep: int = 0) -> None:
        """Forget all but the first ``keep`` committed tokens."""
        self.length = min(self.length, keep)

    def _catch_up(self, seq: list[int]) -> Tensor:
        """One pass over the committed tokens the cache lacks plus the root; returns the root's logits (1, V)."""
        m, n = self.length, len(seq) - 1
        dev = self.model.device
        toks = torch.tensor(seq[m:], dtype=torch.long, device=dev)
        pos = torch.arange(m, n + 1, device=dev)
        mask = torch.arange(n + 1, device=dev)[None, :] <= pos[:, None]
        logits = self._forward(toks, pos, pos, mask, last_only=True)
        self.length = n  # seq[:n] committed; the root sits at slot n
        return logits

    def prefill(self, seq: list[int]) -> None:
        """Process every committed token except the pending last one (done before the first step)."""
        n = len(seq) - 1
        if self.length >= n:
            return
        dev = self.model.device
        pos = torch.arange(self.length, n, device=dev)
        mask = torch.arange(n, device=dev)[None, :] <= pos[:, None]
        self.model.forward(self._in_vocab(torch.tensor(seq[self.length : n], device=dev)), pos, pos, mask,
                           self.cache, logits_rows=slice(-1, None))
        self.length = n

    def grow(self, seq: list[int], cfg: TreeConfig, logprobs: LogProbFn = default_logprobs,
             cost: GrowCost | None = None) -> tuple[Tree, GrowStats]:
        """Grow a best-first tree of exactly ``min(cfg.budget, reachable)`` draft tokens below the root seq[-1].

        ``cost``: enables the early stop (when ``cfg.early_stop``, by default on a CPU only); None grows up to
        ``max_depth`` levels.
        """
        dev = self.model.device
        n = len(seq) - 1
        budget = cfg.budget
        tree = Tree(seq[-1], 2 * budget + 1, dev)  # live nodes + at most budget candidates
        stats = GrowStats(passes=1, beams=[len(seq) - self.length])
        root_lq = logprobs(self._catch_up(seq))  # (1, V)
        tree.draft_slot[0] = n
        next_slot = n + 1
        self._add_children(tree, torch.zeros(1, dtype=torch.long, device=dev), root_lq, cfg, budget)
        early = cfg.early_stop if cfg.early_stop is not None else dev.type == "cpu"
        stop = cost if early else None
        for _ in range(cfg.max_depth - 1):
            thr = tree.kth_logp(budget)
            live = tree.n_logp
            open_ = (tree.draft_slot[: tree.size] < 0) & (live > thr)
            open_[0] = False
            n_open = int(open_.sum())
            if n_open == 0:
                break
            k = min(n_open, cfg.max_beams, self.usable - next_slot)
            if k <= 0:
                break
            cand = torch.where(open_, live, torch.full_like(live, float("-inf")))
            beams = torch.topk(cand, k).indices.sort().values  # (k,) ascending: ancestors before descendants
            if stop is not None and tree.size - 1 >= budget:  # only a full tree: the budget is the verify size
                e_now, u_next = torch.stack([1.0 + tree.n_logp[1:].exp().sum(), live[beams].exp().sum()]).tolist()
                if not stop.more(e_now, u_next, stats.passes):
                    stats.stopped_early = True
                    break
            slots = torch.arange(next_slot, next_slot + k, device=dev)
            tree.draft_slot[beams] = slots
            next_slot += k
            mask = self._tree_mask(tree, beams, n, next_slot)
            pos = n + tree.depth[beams]
            lq = logprobs(self._forward(tree.tokens[beams], pos, slots, mask))  # (k, V)
            stats.passes += 1
            stats.beams.append(k)
            self._add_children(tree, beams, lq, cfg, budget)
        tree.keep(tree.top_k_mask(budget))
        stats.tree_size = tree.size - 1
        return tree, stats

    @staticmethod
    def _tree_mask(tree: Tree, rows: Tensor, n: int, length: int) -> Tensor:
        """(k, length) bool: the committed prefix plus each row's expanded ancestors (itself included)."""
        mask = torch.zeros(rows.shape[0], length, dtype=torch.bool, device=tree.device)
        mask[:, :n] = True
        return tree.ancestor_slots(rows, length, base=mask)

    @staticmethod
    def _add_children(tree: Tree, parents: Tensor, lq: Tensor, cfg: TreeConfig, budget: int) -> None:
        """Propose each parent's top ``max_branch`` children; add those that can enter the top ``budget``; prune."""
        branch = min(cfg.max_branch, lq.shape[-1])
        vals, toks = torch.topk(lq, branch, dim=-1)  # (k, B)
        cum = tree.logp[parents][:, None] + vals  # (k, B)
        par = parents[:, None].expand_as(toks)
        cum, toks, par = cum.reshape(-1), toks.reshape(-1), par.reshape(-1)
        ok = cum > float("-inf")
        thr = tree.kth_logp(budget)
        ok &= cum > thr
        cum, toks, par = cum[ok], toks[ok], par[ok]
        if cum.numel() > budget:  # only the best ``budget`` candidates can survive the pruning anyway
            best = torch.topk(cum, budget).indices.sort().values
            cum, toks, par = cum[best], toks[best], par[best]
        if cum.numel():
            tree.add(par, toks, cum)
        if tree.size - 1 > budget:
            tree.keep(tree.top_k_mask(budget))

    def commit(self, tree: Tree, path: list[int], n: int) -> None:
        """After acceptance of ``path`` (tree nodes, root first): keep the draft KV of its expanded prefix.

        The root is at slot n already; the accepted nodes that were expanded move to slots n+1, n+2, ...
        """
        slots = tree.draft_slot[torch.tensor(path, device=tree.device)].tolist()
        kept = []
        for s in slots:
            if s < 0:
                break
            kept.append(s)
        self.cache.compact(torch.tensor(kept[1:], dtype=torch.long), n + 1)
        self.length = n + len(kept)

    def chain(self, seq: list[int], gamma: int, pick: Callable[[Tensor], tuple[Tensor, Tensor | None]]
              ) -> tuple[Tree, Tensor | None, GrowStats]:
        """Draft ``gamma`` tokens one at a time (``pick``: logits (1, V) -> (token (1,), q-probs (1, V))).

        Returns the chain as a tree (node i+1 is the i-th draft token), the draft distributions q (gamma, V)
        the tokens were drawn from (None when greedy), and stats. The chain's nodes occupy draft slots n .. n+gamma-1.
        """
        dev = self.model.device
        n = len(seq) - 1
        tree = Tree(seq[-1], gamma + 1, dev)
        stats = GrowStats(passes=1, beams=[len(seq) - self.length])
        logits = self._catch_up(seq)
        tree.draft_slot[0] = n
        qs = []
        for i in range(gamma):
            tok, q = pick(logits)
            qs.append(q)
            tree.add(torch.tensor([i], device=dev), tok, torch.zeros(1, device=dev))
            if i == gamma - 1:
                break
            slot = n + 1 + i
            tree.draft_slot[i + 1] = slot
            pos = torch.tensor([slot], device=dev)
            mask = torch.ones(1, slot + 1, dtype=torch.bool, device=dev)
            logits = self._forward(tok.view(1), pos, pos, mask)
            stats.passes += 1
            stats.beams.append(1)
        stats.tree_size = gamma
        return tree, (torch.cat(qs) if qs[0] is not None else None), stats
