"""SpecExec's best-first draft tree (Svirschevski et al., 2024, arXiv 2406.02532), as a proposer.

The tree holds the ``budget`` most probable continuations under the draft model q: a parallel Dijkstra over
-log q. Each level takes up to ``max_beams`` best unexpanded nodes whose cumulative log-prob can still enter the
top ``budget``, runs ONE draft forward over them (tree mask, draft KV cache by slot), proposes each one's top
``max_branch`` children, and keeps only the best ``budget`` nodes of the whole tree. Growth stops when no
unexpanded node beats the budget-th best (its children could not enter), after ``max_depth`` levels, or -- with
``early_stop`` and known costs (:class:`~specexec.steps.rules.GrowCost`), once the tree holds ``budget`` nodes --
when one more pass is expected to add fewer tokens than its time is worth; the result is cut to exactly ``budget``
nodes. Any tree is verified exactly, so the early stop only moves speed.

With an :class:`~specexec.propose.ngram.NGramDraft` attached, the prompt-lookup continuations are merged into the
grown tree as extra branches (nodes the draft did not propose), so a repeated passage is verified even where the
draft doubts it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specexec.config import TreeConfig
from specexec.propose.captured import capturable
from specexec.propose.chain import ChainDraft
from specexec.propose.draft_model import DraftModel
from specexec.propose.fixed_grow import finish, grow_fixed
from specexec.propose.ngram import NGramDraft
from specexec.steps import sampling
from specexec.steps.proposal import Proposal, StepContext
from specexec.steps.record import PLAIN, Arm
from specexec.steps.rules import GrowCost
from specexec.steps.tree import Tree

if TYPE_CHECKING:
    from specexec.steps.proposal import Grammar


def default_logprobs(logits: Tensor) -> Tensor:
    return torch.log_softmax(logits, dim=-1)


def _paths(tree: Tree, nodes: Tensor) -> list[list[int]]:
    """The tokens below the root on the path to each of ``nodes`` (root excluded, the node included)."""
    tokens, parents = tree.n_tokens.tolist(), tree.n_parents.tolist()
    out = []
    for i in nodes.tolist():
        path = []
        while i > 0:
            path.append(tokens[i])
            i = parents[i]
        out.append(path[::-1])
    return out


class TreeDraft:
    """Best-first tree proposals from a draft model (``ctx.arm.size`` draft tokens per tree).

    With a :class:`~specexec.propose.chain.ChainDraft` attached, a chain arm of size g asks for a chain of
    g draft tokens instead (what a compute-bound verifier's policy picks when a tree's siblings and extra draft
    passes cost more than they add; the chain's own acceptance rule applies), and a plain arm for no draft pass.
    """

    name = "specexec"

    def __init__(
        self,
        draft: DraftModel,
        cfg: TreeConfig,
        ngram: NGramDraft | None = None,
        chain: ChainDraft | None = None,
        lazy: bool = False,
    ) -> None:
        self.draft, self.cfg, self.ngram, self.chain = draft, cfg, ngram, chain
        # lazy: the draft reads the prompt at its first proposal, not at :meth:`begin` (a policy that may never
        # ask for a draft pass, e.g. on a CPU where the draft does not pay, then never pays for its prefill)
        self.lazy = lazy

    def lag(self, seq: list[int]) -> int:
        """Committed tokens the draft must still read before its next proposal (what a draft step would pay for
        the steps and the prompt it did not see)."""
        return self.draft.lag(seq)

    def begin(self, seq: list[int]) -> None:
        if not self.lazy:
            self.draft.prefill(seq)
        if self.ngram is not None:
            self.ngram.begin(seq)

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        if ctx.arm.kind == "chain":  # a chain of arm.size draft tokens
            if self.chain is None:
                raise ValueError(f"arm {ctx.arm} asks for a chain, but this tree proposer has none")
            # verified by the tree walk also when sampling (the draft's tokens are then coupled draws): exact for
            # any tree, and the walk draws from the target as AR does, so a seed gives the same text whichever arm
            # each step takes
            prop = self.chain.propose(seq, replace(ctx, walk=True))
            prop.arm = ctx.arm
            return prop
        if ctx.arm.size == 0:  # no draft this step: the n-gram trie alone (the root alone without one: an AR step)
            if self.ngram is None:
                return Proposal(Tree(seq[-1], 1, self.draft.device), arm=PLAIN, source=self.name)
            prop = self.ngram.propose(seq, replace(ctx, arm=Arm.nodes(self.ngram.max_nodes())))
            prop.arm = PLAIN
            return prop
        cost = ctx.cost if isinstance(ctx.cost, GrowCost) else None
        cfg = replace(self.cfg, budget=ctx.arm.size)
        if ctx.constraint is not None:  # the grammar's masks are the host's per node: levels of any width
            cfg = replace(cfg, grow="dynamic")
        tree, passes, beams, early = self.grow(
            seq,
            cfg,
            ctx.logprobs or default_logprobs,
            cost,
            seed=None if ctx.samp.greedy else ctx.seed,
            constraint=ctx.constraint,
        )
        merged_at = tree.size
        if self.ngram is None or not self.ngram.merge_into(tree, seq):
            merged_at = 0
        prop = Proposal(
            tree,
            passes=passes,
            beams=beams,
            stopped_early=early,
            arm=ctx.arm,
            source=self.name,
            merged_at=merged_at,
            catch_up_s=self.draft.caught_up_s,
        )
        prop.trim(ctx.trim)
        return prop

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        if proposal.source == "chain" and self.chain is not None:
            self.chain.commit(proposal, path, seq)
        elif int(proposal.tree.draft_slot[0]) >= 0:  # else no draft pass ran: the cache catches up next proposal
            tree = proposal.tree
            self.draft.commit(tree.draft_slot[torch.tensor(path, device=tree.device)].tolist(), seq)
        if self.ngram is not None:
            self.ngram.commit(proposal, path, seq)

    # -- growth -----------------------------------------------------------------------------------------------------
    def grow(
        self,
        seq: list[int],
        cfg: TreeConfig,
        logprobs=default_logprobs,
        cost: GrowCost | None = None,
        seed: int | None = None,
        constraint: Grammar | None = None,
    ) -> tuple[Tree, int, list[int], bool]:
        """Grow a best-first tree of exactly ``min(cfg.budget, reachable)`` draft tokens below the root seq[-1].

        ``seed`` (sampling): children are ranked and scored by the draft's log-probs perturbed by the walk's noise
        (:func:`specexec.steps.sampling.coupled_logprobs`), so the most probable path is the draft's coupled draw,
        the token the target's walk draws wherever p is close to q. ``cost`` enables the early stop (when
        ``cfg.early_stop``; by default on a CPU, and for fixed-width growth on a GPU); None grows up to
        ``max_depth`` levels. ``constraint``: a grammar whose masks apply to the draft's logits at every expanded
        node (dynamic growth only). Returns (tree, draft passes, tokens per pass, stopped early).
        """
        d = self.draft
        dev = d.device
        stop = cost if cfg.stops_early(dev) else None
        if cfg.grow_mode(dev) != "dynamic":
            return self._grow_fixed(seq, cfg, logprobs, seed, stop)
        n = len(seq) - 1
        budget = cfg.budget
        extra = self.ngram.max_nodes() if self.ngram is not None else 0
        tree = Tree(seq[-1], 2 * budget + 1 + extra, dev)  # live nodes + at most budget candidates (+ n-grams)
        beams_log = [len(seq) - d.length]
        root_logits = d.catch_up(seq)
        if constraint is not None:
            root_logits = constraint.mask_logits(root_logits, [[]])
        root_lq = logprobs(root_logits)  # (1, V)
        if seed is not None:
            root_lq = sampling.coupled_logprobs(root_lq, seed, [n + 1])
        passes = 1
        tree.draft_slot[0] = n
        next_slot = n + 1
        self._expand(tree, torch.zeros(1, dtype=torch.long, device=dev), root_lq, cfg, budget)
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
            logits = d.forward(tree.tokens[beams], pos, slots, mask)
            if constraint is not None:
                logits = constraint.mask_logits(logits, _paths(tree, beams))
            lq = logprobs(logits)  # (k, V)
            if seed is not None:  # the children's output positions
                lq = sampling.coupled_logprobs(lq, seed, pos + 1)
            passes += 1
            beams_log.append(k)
            self._expand(tree, beams, lq, cfg, budget)
        tree.keep(tree.top_k_mask(budget))
        return tree, passes, beams_log, stopped

    def _grow_fixed(
        self, seq: list[int], cfg: TreeConfig, logprobs, seed: int | None, stop: GrowCost | None
    ) -> tuple[Tree, int, list[int], bool]:
        """:meth:`grow` in fixed-width levels (``cfg.grow`` "ahead" / "captured"; :mod:`.fixed_grow`,
        :mod:`.captured`); ``stop``: the early stop's costs (None: off)."""
        budget = cfg.budget
        extra = self.ngram.max_nodes() if self.ngram is not None else 0
        mode = cfg.grow_mode(self.draft.device, graphs=capturable(self.draft.static, cfg.max_beams))
        g = grow_fixed(self.draft, seq, cfg, logprobs, seed, stop, captured=mode == "captured")
        return finish(g.tree, budget, budget + 1 + extra), g.passes, g.tokens_per_pass(), g.stopped

    @staticmethod
    def _tree_mask(tree: Tree, rows: Tensor, n: int, length: int) -> Tensor:
        """(k, length) bool: the committed prefix plus each row's expanded ancestors (itself included)."""
        mask = torch.zeros(rows.shape[0], length, dtype=torch.bool, device=tree.device)
        mask[:, :n] = True
        return tree.ancestor_slots(rows, length, base=mask)

    def _expand(self, tree: Tree, parents: Tensor, lq: Tensor, cfg: TreeConfig, budget: int) -> None:
        """The draft's log-probs ``lq`` (k, V) at the just-expanded ``parents``: propose each one's top
        ``max_branch`` children."""
        branch = min(cfg.max_branch, lq.shape[-1])
        vals, toks = torch.topk(lq, branch, dim=-1)  # (k, B)
        self._add_children(tree, parents, vals, toks, budget)

    @staticmethod
    def _add_children(tree: Tree, parents: Tensor, vals: Tensor, toks: Tensor, budget: int) -> None:
        """Add the proposed children (k, B) of ``parents`` (their draft log-probs ``vals``, tokens ``toks``) that
        can enter the top ``budget``; drop the other nodes outside the top ``budget``."""
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
