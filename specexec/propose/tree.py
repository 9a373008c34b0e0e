"""SpecExec's best-first draft tree (Svirschevski et al., 2024, arXiv 2406.02532), as a proposer.

The tree holds the ``budget`` most probable continuations under the draft model q: a parallel Dijkstra over
-log q. Each level takes up to ``max_beams`` best unexpanded nodes whose cumulative log-prob can still enter the
top ``budget``, runs ONE draft forward over them (tree mask, draft KV cache by slot), proposes each one's top
``max_branch`` children, and keeps only the best ``budget`` nodes of the whole tree. Growth stops when no
unexpanded node beats the budget-th best (its children could not enter), after ``max_depth`` levels, or -- with
``early_stop`` and known costs (:class:`GrowCost`), once the tree holds ``budget`` nodes -- when one more pass is
expected to add fewer tokens than its time is worth; the result is trimmed to exactly ``budget`` nodes.

Early stop: with E = 1 + sum of the tree's path probabilities (expected tokens emitted; SpecExec §3), a step
costs T = passes * pass_s + target_s. One more pass that adds g expected tokens is worth it iff
(E + g) / (T + pass_s) >= E / T, i.e. g * T >= E * pass_s. g is bounded by U, the path-probability mass of the
nodes the pass would expand (their children's mass can never exceed it), and the rule uses that bound: it stops
only when even the best case is not worth a pass. Any tree is verified exactly, so the rule only moves speed.

With an :class:`~specexec.propose.ngram.NGramDraft` attached, the prompt-lookup continuations are merged into the
grown tree as extra branches (nodes the draft did not propose), so a repeated passage is verified even where the
draft doubts it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from specexec.config import TreeConfig
from specexec.propose.base import Proposal, StepContext
from specexec.propose.draft_model import DraftModel
from specexec.propose.ngram import NGramDraft
from specexec.tree import Tree


def default_logprobs(logits: Tensor) -> Tensor:
    return torch.log_softmax(logits, dim=-1)


@dataclass
class GrowCost:
    """What a step costs, for early stopping (measured by the budget policy; see the module docstring)."""

    pass_s: float  # seconds per draft pass
    target_s: float  # seconds of the target's verification of a tree of this budget
    acc_scale: float = 1.0  # actual / predicted tokens per step (the draft's over- or under-confidence)

    def more(self, expected: float, gain: float, passes: int) -> bool:
        """Run one more draft pass? ``expected``: E[emitted] of the tree now; ``gain``: the pass's predicted
        gain in E; ``passes``: passes run so far."""
        e = 1.0 + self.acc_scale * (expected - 1.0)
        return self.acc_scale * gain * (passes * self.pass_s + self.target_s) >= e * self.pass_s


class TreeDraft:
    """Best-first tree proposals from a draft model (``ctx.budget`` draft tokens per tree)."""

    name = "specexec"

    def __init__(self, draft: DraftModel, cfg: TreeConfig, ngram: NGramDraft | None = None) -> None:
        self.draft, self.cfg, self.ngram = draft, cfg, ngram

    def max_nodes(self) -> int:
        extra = self.ngram.max_nodes() if self.ngram is not None else 0
        return self.cfg.largest + extra

    def begin(self, seq: list[int]) -> None:
        self.draft.prefill(seq)
        if self.ngram is not None:
            self.ngram.begin(seq)

    def reset(self) -> None:
        self.draft.reset()
        if self.ngram is not None:
            self.ngram.reset()

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        if ctx.budget == 0:  # no draft this step: the n-gram trie alone (the root alone without one: an AR step)
            if self.ngram is None:
                return Proposal(Tree(seq[-1], 1, self.draft.device), budget=0, source=self.name)
            prop = self.ngram.propose(seq, replace(ctx, budget=self.ngram.max_nodes()))
            prop.budget = 0
            return prop
        cost = ctx.cost if isinstance(ctx.cost, GrowCost) else None
        tree, passes, beams, early = self.grow(
            seq, replace(self.cfg, budget=ctx.budget), ctx.logprobs or default_logprobs, cost
        )
        if self.ngram is not None:
            self.ngram.merge_into(tree, seq)
        return Proposal(tree, passes=passes, beams=beams, stopped_early=early, budget=ctx.budget, source=self.name)

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        if proposal.passes == 0:  # no draft pass ran: the draft cache catches up at its next proposal
            if self.ngram is not None:
                self.ngram.commit(proposal, path, seq)
            return
        slots = proposal.tree.draft_slot[torch.tensor(path, device=proposal.tree.device)].tolist()
        self.draft.commit(slots, seq)
        if self.ngram is not None:
            self.ngram.commit(proposal, path, seq)

    # -- growth -----------------------------------------------------------------------------------------------------
    def grow(
        self, seq: list[int], cfg: TreeConfig, logprobs=default_logprobs, cost: GrowCost | None = None
    ) -> tuple[Tree, int, list[int], bool]:
        """Grow a best-first tree of exactly ``min(cfg.budget, reachable)`` draft tokens below the root seq[-1].

        ``cost`` enables the early stop (when ``cfg.early_stop``, by default on a CPU only); None grows up to
        ``max_depth`` levels. Returns (tree, draft passes, tokens per pass, stopped early).
        """
        d = self.draft
        dev = d.device
        n = len(seq) - 1
        budget = cfg.budget
        extra = self.ngram.max_nodes() if self.ngram is not None else 0
        tree = Tree(seq[-1], 2 * budget + 1 + extra, dev)  # live nodes + at most budget candidates (+ n-grams)
        beams_log = [len(seq) - d.length]
        root_lq = logprobs(d.catch_up(seq))  # (1, V)
        passes = 1
        tree.draft_slot[0] = n
        next_slot = n + 1
        self._add_children(tree, torch.zeros(1, dtype=torch.long, device=dev), root_lq, cfg, budget)
        early = cfg.early_stop if cfg.early_stop is not None else dev.type == "cpu"
        stop = cost if early else None
        stopped = False
        for _ in range(cfg.max_depth - 1):
            thr = tree.kth_logp(budget)
            live = tree.n_logp
            open_ = (tree.draft_slot[: tree.size] < 0) & (live > thr)
            open_[0] = False
            n_open = int(open_.sum())
            if n_open == 0:
                break
            k = min(n_open, cfg.max_beams, d.usable - next_slot)
            if k <= 0:
                break
            cand = torch.where(open_, live, torch.full_like(live, float("-inf")))
            beams = torch.topk(cand, k).indices.sort().values  # (k,) ascending: ancestors before descendants
            if stop is not None and tree.size - 1 >= budget:  # only a full tree: the budget is the verify size
                e_now, u_next = torch.stack([1.0 + tree.n_logp[1:].exp().sum(), live[beams].exp().sum()]).tolist()
                if not stop.more(e_now, u_next, passes):
                    stopped = True
                    break
            slots = torch.arange(next_slot, next_slot + k, device=dev)
            tree.draft_slot[beams] = slots
            next_slot += k
            mask = self._tree_mask(tree, beams, n, next_slot)
            pos = n + tree.depth[beams]
            lq = logprobs(d.forward(tree.tokens[beams], pos, slots, mask))  # (k, V)
            passes += 1
            beams_log.append(k)
            self._add_children(tree, beams, lq, cfg, budget)
        tree.keep(tree.top_k_mask(budget))
        return tree, passes, beams_log, stopped

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
