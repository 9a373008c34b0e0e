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

Subtree reuse (``TreeConfig.reuse``, on by default). When the target accepts the path root→...→a and adds its
own bonus token b, and the draft had grown and expanded a child c of a carrying b, the subtree under c is a
best-first tree below the next pending token already: ``commit`` keeps it (re-based: c becomes the root with
depth 0 and log-prob 0; n-gram nodes dropped, they are merged afresh each step) and moves its draft keys/values
right behind the new committed prefix (c at slot n', its expanded descendants at n'+1, ...; see
:meth:`DraftModel.commit`). The next ``propose`` starts growth from it, skipping the root's catch-up pass: the
top children every expanded node proposed are remembered (by draft slot), so those the old budget pruned can
enter the new tree, which is then exactly what best-first growth with the same expansions would hold. A tree
that is already full may need no draft pass at all. Any tree is verified exactly, so reuse only moves speed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from specexec.config import CAPTURED, OVERLAP_AUTO, OVERLAP_AUTO_MAX, SamplingConfig, TreeConfig
from specexec.decoding import sampling
from specexec.decoding.tree import Tree
from specexec.propose.base import Proposal, StepContext
from specexec.propose.calibrate import ScoreCalibration, Snapshot
from specexec.propose.captured import capturable
from specexec.propose.chain import ChainDraft
from specexec.propose.draft_model import DraftModel
from specexec.propose.fixed_grow import FixedGrowth, finish, grow_fixed, regrown
from specexec.propose.ngram import NGramDraft

GREEDY = SamplingConfig()
OVERLAP_BUDGET = 4  # "frontier" aim: the best (this x budget) nodes, those just outside the verified tree
# a host thread queuing overlapped levels on a GPU keeps at most this many of them queued ahead of the side stream,
# and queues no more once the target's pass has ended (:meth:`TreeDraft.target_queued`): the step's commit then
# waits for at most this many levels. Without the bound the levels were queued all at once, and 32 of them (~0.4 s
# of int8 7B passes, slowed by the target's kernels beside them) outlasted a 0.6 s streamed 70B pass: the commit
# waited for the rest (H200: verify 0.60 -> 0.77 s a step)
AHEAD_LEVELS = 2
OVERLAP_AUTO_START = 4  # ``--overlap auto``: the first step's levels (then +2 a step while they finish beside the
# target's pass, x3/4 when they did not)


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
    """Best-first tree proposals from a draft model (``ctx.budget`` draft tokens per tree).

    With a :class:`~specexec.propose.chain.ChainDraft` attached, a negative ``ctx.budget`` -g asks for a chain of
    g draft tokens instead (what a compute-bound verifier's policy picks when a tree's siblings and extra draft
    passes cost more than they add; the chain's own acceptance rule applies), and 0 for no draft pass.
    """

    name = "specexec"
    # queue the overlapped levels from a host thread (None: on a GPU). Queuing a level costs the host ~7 ms of
    # launches (H200, 7B-shaped draft): inline, 16 levels held the target's pass back by 0.11 s a step
    threaded: bool | None = None

    def __init__(
        self, draft: DraftModel, cfg: TreeConfig, ngram: NGramDraft | None = None, chain: ChainDraft | None = None
    ) -> None:
        self.draft, self.cfg, self.ngram, self.chain = draft, cfg, ngram, chain
        self._next: Tree | None = None  # the subtree carried to the next step (root = its pending token)
        self._next_epoch = -1  # the draft cache's epoch right after the carried entries were placed
        # the last proposal: (its tree, k: its nodes [0, k) were grown (the rest merged in), the full grown tree
        # including what the budget pruned, (k,) index of each grown proposal node in the full tree)
        self._grown: tuple[Tree, int, Tree, Tensor] | None = None
        # per draft slot of an expanded node: its top ``max_branch`` children (draft log-prob, token)
        self._cand_v: Tensor | None = None
        self._cand_t: Tensor | None = None
        self._full: tuple[Tree, Tensor] | None = None  # set by grow with reuse: (full tree, index of kept nodes)
        # overlap: (growth, its kept nodes, budget of the "frontier" aim, levels to grow)
        self._growth: tuple[FixedGrowth, Tensor, int, int] | None = None
        self._side: torch.cuda.Stream | None = None  # overlap on a GPU: the draft's side stream
        self._bg_done: torch.cuda.Event | None = None  # auto: recorded on the side stream after the levels
        self._bg_auto = False  # the levels in flight were grown by ``--overlap auto`` (commit adapts the count)
        self._bg_thread: threading.Thread | None = None
        self._bg_error: BaseException | None = None
        self._target_done: torch.cuda.Event | None = None  # set by target_queued: completes with the target's pass
        self.background_passes = 0  # draft passes run by :meth:`background` (all steps)
        self.reused_nodes = 0  # of the last grow: nodes in the tree before its first draft pass (0: fresh tree)
        self.reused_passes = 0  # of the last grow: the draft passes the carried part stood for
        # calibrated scores (specexec.propose.calibrate): on for this step's growth (a greedy step with
        # ``cfg.calibrate``), and the last proposal's draft-grown nodes with the root's position, observed at commit
        self.calibrating = False
        self._snap: tuple[Snapshot, int] | None = None

    def max_nodes(self) -> int:
        extra = self.ngram.max_nodes() if self.ngram is not None else 0
        return max(self.cfg.largest + extra, self.chain.max_nodes() if self.chain is not None else 0)

    def begin(self, seq: list[int]) -> None:
        self._next = None
        self._join()
        self.draft.prefill(seq)
        if self.ngram is not None:
            self.ngram.begin(seq)

    def reset(self) -> None:
        self._next = None
        self._join()
        self.draft.reset()
        if self.ngram is not None:
            self.ngram.reset()

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        self._join()  # a proposal that was never committed: its background levels end here
        self._bg_done, self._bg_auto = None, False  # (and say nothing about how many levels fit)
        start = self._take(seq)  # the subtree the last step carried over, if it still applies
        self._grown = None
        if ctx.budget < 0:  # a chain of -budget draft tokens
            if self.chain is None:
                raise ValueError(f"budget {ctx.budget} asks for a chain, but this tree proposer has none")
            # verified by the tree walk also when sampling (the draft's tokens are then coupled draws): exact for
            # any tree, and the walk draws from the target as AR does, so a seed gives the same text whichever arm
            # each step takes
            prop = self.chain.propose(seq, replace(ctx, budget=-ctx.budget, walk=True))
            prop.budget = ctx.budget
            return prop
        if ctx.budget == 0:  # no draft this step: the n-gram trie alone (the root alone without one: an AR step)
            if self.ngram is None:
                return Proposal(Tree(seq[-1], 1, self.draft.device), budget=0, source=self.name)
            prop = self.ngram.propose(seq, replace(ctx, budget=self.ngram.max_nodes()))
            prop.budget = 0
            return prop
        cost = ctx.cost if isinstance(ctx.cost, GrowCost) else None
        tree, passes, beams, early = self.grow(
            seq,
            replace(self.cfg, budget=ctx.budget),
            ctx.logprobs or default_logprobs,
            cost,
            start=start,
            seed=None if ctx.samp.greedy else ctx.seed,
        )
        if self._full is not None:
            self._grown = (tree, tree.size, *self._full)
        self._full = None
        self._snap = None
        if self.calibrating:  # what verification will show is observed at commit (before n-grams merge in)
            self._snap = (self.calibration.snapshot(tree.parents, tree.tokens, tree.logp, tree.size), len(seq) - 1)
        merged_at = tree.size
        if self.ngram is None or not self.ngram.merge_into(tree, seq):
            merged_at = 0
        return Proposal(
            tree,
            passes=passes,
            beams=beams,
            stopped_early=early,
            budget=ctx.budget,
            source=self.name,
            reused=self.reused_nodes,
            reused_passes=self.reused_passes,
            merged_at=merged_at,
        )

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        self._next = None
        snap, self._snap = self._snap, None
        if snap is not None and proposal.source == self.name:  # the target's tokens after the root: its path
            self.calibration.observe(snap[0], seq[snap[1] + 1 :])
        if self._bg_auto:  # auto overlap: did the levels finish while the target's pass ran? (queued and run)
            t, ev = self._bg_thread, self._bg_done
            self.adapt((t is None or not t.is_alive()) and ev is not None and ev.query())
            self._bg_done, self._bg_auto = None, False
        self._join()
        if proposal.source == "chain" and self.chain is not None:
            self.chain.commit(proposal, path, seq)
            if self.ngram is not None:
                self.ngram.commit(proposal, path, seq)
            return
        tree = proposal.tree
        if int(tree.draft_slot[0]) < 0:  # no draft pass ran: the draft cache catches up at its next proposal
            if self.ngram is not None:
                self.ngram.commit(proposal, path, seq)
            return
        at = torch.tensor(path, device=tree.device)
        slots_t = tree.draft_slot[at]
        if self._grown is not None and self._grown[0] is tree:  # the grown tree's slots: background levels may have
            _, k, full, index = self._grown  # expanded path nodes (a verified leaf) after the proposal was copied
            grown = at < k
            slots_t = torch.where(grown, full.draft_slot[index[at.clamp(max=k - 1)]], slots_t)
        slots = slots_t.tolist()
        c = self._carried_child(tree, path, seq)
        sub, carry = None, None
        if c is not None and self._grown is not None:
            sub = self._grown[2].subtree(c)
            carry = sub.draft_slot[: sub.size][sub.draft_slot[: sub.size] >= 0]  # (m,) root first: it was expanded
        moved = self.draft.commit(slots, seq, carry.tolist() if carry is not None else None)
        if moved and sub is not None and carry is not None:
            n1 = len(seq) - 1
            new = torch.arange(n1, n1 + carry.shape[0], device=carry.device)
            if self._cand_v is not None and self._cand_t is not None:  # gathered first: overlaps are safe
                self._cand_v[new] = self._cand_v[carry]
                self._cand_t[new] = self._cand_t[carry]
            live = sub.draft_slot[: sub.size]
            live[live >= 0] = new
            self._next, self._next_epoch = sub, self.draft.epoch
        if self.ngram is not None:
            self.ngram.commit(proposal, path, seq)

    # -- reuse ------------------------------------------------------------------------------------------------------
    def _carried_child(self, tree: Tree, path: list[int], seq: list[int]) -> int | None:
        """The node of the grown tree (all the draft grew, :attr:`_grown`) that is an expanded child of the path's
        last node carrying the bonus token seq[-1], when the step's tokens were committed whole (no cut at EOS /
        the limit); else None. The verified tree never holds it (the walk would have moved there): it is a node
        the budget pruned after the draft had expanded it."""
        if not self.cfg.reuse or self._grown is None or self._grown[0] is not tree:
            return None
        n = self.draft.length  # the root's position (before this commit)
        if int(tree.draft_slot[0]) != n or len(seq) != n + len(path) + 1:
            return None
        if seq[n : n + len(path)] != tree.tokens[torch.tensor(path, device=tree.device)].tolist():
            return None
        _, grown, full, index = self._grown
        if path[-1] >= grown:  # an n-gram node: nothing was grown below it
            return None
        a = int(index[path[-1]])  # the path's last node in the full tree
        n_full = full.size
        hit = ((full.parents[:n_full] == a) & (full.tokens[:n_full] == seq[-1])).nonzero()
        if hit.numel() == 0:
            return None
        c = int(hit[0, 0])
        return c if int(full.draft_slot[c]) >= 0 else None

    def _take(self, seq: list[int]) -> Tree | None:
        """The carried subtree if it still belongs below ``seq`` (same pending token, draft cache untouched)."""
        t, self._next = self._next, None
        if t is None or not self.cfg.reuse or self.draft.epoch != self._next_epoch:
            return None
        n = len(seq) - 1
        if int(t.tokens[0]) != seq[-1] or int(t.draft_slot[0]) != n or self.draft.length != n:
            return None
        if self.draft.tokens != seq[:-1]:
            return None
        return t

    def _restart(self, start: Tree, capacity: int, cfg: TreeConfig, budget: int) -> Tree:
        """The carried subtree as the start of this step's tree: pruned to ``budget`` (expanded nodes kept), plus
        the children its expanded nodes proposed that it lacks (pruned under the old budget) where they now enter
        the top."""
        if start.size - 1 > budget:
            start.keep(start.top_k_mask(budget) | (start.draft_slot[: start.size] >= 0))
        tree = start.resized(capacity)
        assert self._cand_v is not None and self._cand_t is not None
        exp = (tree.draft_slot[: tree.size] >= 0).nonzero().squeeze(1)  # (k,) expanded nodes, the root first
        vals = self._cand_v[tree.draft_slot[exp]]  # (k, B)
        toks = self._cand_t[tree.draft_slot[exp]]
        if tree.size > 1:  # children already in the tree are not added twice
            row = torch.full((tree.size,), -1, dtype=torch.long, device=tree.device)
            row[exp] = torch.arange(exp.shape[0], device=tree.device)
            r = row[tree.parents[1 : tree.size]]  # every grown node's parent was expanded
            eq = (toks[r] == tree.tokens[1 : tree.size, None]).float()  # (N-1, B)
            present = torch.zeros_like(vals).index_add_(0, r, eq) > 0
            vals = vals.masked_fill(present, float("-inf"))
        self._add_children(tree, exp, self.scores(vals), toks, budget, prune=False)
        return tree

    @property
    def calibration(self) -> ScoreCalibration:
        """The draft's score calibration (kept on the draft: it learns across generations, and captured levels'
        graphs read its exponents)."""
        if self.draft.calibration is None:
            self.draft.calibration = ScoreCalibration(self.draft.device)
        cal: ScoreCalibration = self.draft.calibration
        return cal

    def scores(self, vals: Tensor) -> Tensor:
        """(k, B) the draft's top-B log-probs per expanded node (best first) -> the children's tree scores: calibrated
        in a greedy step with ``cfg.calibrate``, else the log-probs themselves (remembered children keep these)."""
        return self.calibration.apply(vals) if self.calibrating else vals

    def _ensure_cands(self, cfg: TreeConfig) -> None:
        """The remembered children by draft slot. Kept on the draft (shared by the proposers of its generations), so
        captured levels, whose graphs write them, keep their graphs from one generation to the next; what a slot
        held in an earlier generation is never read (only slots this generation's growth wrote are carried)."""
        branch = min(cfg.max_branch, self.draft.model.cfg.vocab_size)
        rows = self.draft.usable + 1
        if self._cand_v is None or self._cand_v.shape != (rows, branch):
            held = getattr(self.draft, "remembered", None)
            if held is None or held[0].shape != (rows, branch):
                dev = self.draft.device
                held = (
                    torch.full((rows, branch), float("-inf"), device=dev),
                    torch.zeros((rows, branch), dtype=torch.long, device=dev),
                )
                self.draft.remembered = held
            self._cand_v, self._cand_t = held

    # -- growth -----------------------------------------------------------------------------------------------------
    def grow(
        self,
        seq: list[int],
        cfg: TreeConfig,
        logprobs=default_logprobs,
        cost: GrowCost | None = None,
        start: Tree | None = None,
        seed: int | None = None,
    ) -> tuple[Tree, int, list[int], bool]:
        """Grow a best-first tree of exactly ``min(cfg.budget, reachable)`` draft tokens below the root seq[-1].

        ``seed`` (sampling): children are ranked and scored by the draft's log-probs perturbed by the walk's noise
        (:func:`specexec.decoding.sampling.coupled_logprobs`), so the most probable path is the draft's coupled draw,
        the
        token the target's walk draws wherever p is close to q. ``cost`` enables the early stop (when
        ``cfg.early_stop``; by default on a CPU, and for fixed-width growth on a GPU); None grows up to
        ``max_depth`` levels. ``start``: a carried subtree rooted at seq[-1] whose expanded nodes' draft entries are
        in the cache (see :meth:`commit`); growth continues from it without the root's pass. Returns (tree, draft
        passes, tokens per pass, stopped early);
        ``reused_nodes`` / ``reused_passes`` tell what ``start`` gave.
        """
        d = self.draft
        dev = d.device
        self.calibrating = cfg.calibrate and seed is None
        stop = cost if cfg.stops_early(dev) else None
        if cfg.grow_mode(dev) != "dynamic":
            return self._grow_fixed(seq, cfg, logprobs, start, seed, stop)
        n = len(seq) - 1
        budget = cfg.budget
        extra = self.ngram.max_nodes() if self.ngram is not None else 0
        # reuse: pruning keeps every expanded node too (their keys/values are in the draft cache; their other
        # children are remembered by slot), so the next step can start from any of them; only the best ``budget``
        # are verified. Expanded nodes outside the top are never open again, so growth itself is unchanged.
        keep_all = cfg.reuse
        capacity = 2 * budget + 1 + extra  # live nodes + at most budget candidates (+ n-grams)
        if keep_all:
            self._ensure_cands(cfg)
            capacity += 1 + cfg.max_depth * cfg.max_beams + (start.size if start is not None else 0)
        self.reused_nodes = self.reused_passes = 0
        if start is None:
            tree = Tree(seq[-1], capacity, dev)
            beams_log = [len(seq) - d.length]
            root_lq = logprobs(d.catch_up(seq))  # (1, V)
            if seed is not None:
                root_lq = sampling.coupled_logprobs(root_lq, seed, [n + 1])
            passes = 1
            tree.draft_slot[0] = n
            next_slot = n + 1
            self._expand(tree, torch.zeros(1, dtype=torch.long, device=dev), root_lq, cfg, budget, not keep_all)
        else:
            expanded = start.draft_slot[: start.size] >= 0
            self.reused_passes = int(start.depth[: start.size][expanded].unique().numel())
            tree = self._restart(start, capacity, cfg, budget)
            self.reused_nodes = tree.size - 1
            beams_log, passes = [], 0
            next_slot = int(tree.draft_slot[: tree.size].max()) + 1
        stopped = False
        # at most ``max_depth`` deep in all: a carried start already reaches its own depth, so it grows fewer levels
        levels = cfg.max_depth - 1 if start is None else max(0, cfg.max_depth - tree.max_depth())
        for _ in range(levels):
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
            if seed is not None:  # the children's output positions
                lq = sampling.coupled_logprobs(lq, seed, pos + 1)
            passes += 1
            beams_log.append(k)
            self._expand(tree, beams, lq, cfg, budget, not keep_all)
        if keep_all:  # the proposal: the best ``budget``; the whole tree stays for the next step's reuse
            out, index = tree.select(tree.top_k_mask(budget), budget + 1 + extra)
            self._full = (tree, index)
            return out, passes, beams_log, stopped
        tree.keep(tree.top_k_mask(budget))
        return tree, passes, beams_log, stopped

    def _grow_fixed(
        self, seq: list[int], cfg: TreeConfig, logprobs, start: Tree | None, seed: int | None, stop: GrowCost | None
    ) -> tuple[Tree, int, list[int], bool]:
        """:meth:`grow` in fixed-width levels (``cfg.grow`` "static" / "ahead" / "captured" / "captured-ahead";
        :mod:`.fixed_grow`, :mod:`.captured`); ``stop``: the early stop's costs (None: off)."""
        budget = cfg.budget
        extra = self.ngram.max_nodes() if self.ngram is not None else 0
        keep_all = cfg.reuse
        if keep_all:
            self._ensure_cands(cfg)
        self.reused_nodes = self.reused_passes = 0
        if start is not None:
            expanded = start.draft_slot[: start.size] >= 0
            self.reused_passes = int(start.depth[: start.size][expanded].unique().numel())
            start = self._restart(start, start.size + budget + 1, cfg, budget)
            self.reused_nodes = start.size - 1
        levels = self.overlap_levels(cfg)
        mode = cfg.grow_mode(self.draft.device, graphs=capturable(self.draft.static, cfg.max_beams))
        # a sampled step grows uncaptured (the coupled noise's seed would be baked into a graph): "ahead" levels, whose
        # host never waits, for either captured mode
        ahead = mode in ("ahead", "captured-ahead") or (mode == "captured" and seed is not None)
        g = grow_fixed(self, seq, cfg, logprobs, start, seed, ahead, levels, stop, mode in CAPTURED)
        out, full, index, chosen = finish(g.tree, budget, budget + 1 + extra, keep_all)
        if full is not None and index is not None:
            self._full = (full, index)
            if levels:  # grown on in :meth:`background` while the target verifies
                self._growth = (g, chosen, OVERLAP_BUDGET * budget, levels)
        return out, g.passes, g.tokens_per_pass(), g.stopped

    # -- overlapped growth ------------------------------------------------------------------------------------------
    def background(self, proposal: Proposal) -> None:
        """Called by the decode loop between :meth:`propose` and the target's pass (``TreeConfig.overlap`` > 0):
        grow ``overlap`` more levels of the proposal's tree below what is verified (aimed by
        ``TreeConfig.overlap_aim``: the likeliest next roots' best continuations, or the best ``OVERLAP_BUDGET`` x
        budget nodes), reading nothing from the device. On a GPU they run on a side stream while the
        target's pass runs; on a CPU they run here, in turn. :meth:`commit` waits for them and carries the subtree
        under the accepted path + bonus token, now grown deeper, into the next step.

        With :attr:`threaded` (the default on a GPU) a host thread queues them, so the target's pass is launched at
        once rather than after every level's launches. The thread only touches this proposer's growth and the
        draft (its cache, its static passes: a graph it lacks runs eagerly there, never captured beside the
        target's pass); :meth:`_join` waits for it before anything else reads them."""
        if self._growth is None or self._grown is None or self._grown[0] is not proposal.tree:
            return
        g, chosen, budget, n = self._growth
        cuda = g.device.type == "cuda"
        auto = self.cfg.overlap == OVERLAP_AUTO
        side = None
        if cuda:
            if self._side is None:
                self._side = torch.cuda.Stream(device=g.device)
            side = self._side
            side.wait_stream(torch.cuda.current_stream(g.device))
        threaded = cuda if self.threaded is None else self.threaded
        bounded = self._bounded(g.device)
        static = self.draft.static
        queued: list[torch.cuda.Event] = []  # bounded: the levels queued on the side stream and not yet waited for

        def go_on() -> bool:
            """Bounded growth: wait until fewer than AHEAD_LEVELS levels are queued ahead of the side stream, then
            grow one more only while the target's pass has not ended. Polls events (never holds the GIL waiting)."""

            def ended() -> bool:
                done = self._target_done
                return done is not None and done.query()

            while len(queued) >= AHEAD_LEVELS and not ended():
                if queued[0].query():
                    queued.pop(0)
                else:
                    time.sleep(2e-4)
            return not ended()

        def levels() -> None:
            if static is not None and threaded:
                static.capture_ok = False  # capturing syncs the device and breaks on the target's calls
            try:
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    if self.cfg.overlap_aim == "carried":
                        g.aim(chosen)
                    if bounded:
                        grown = 0
                        while grown < n and g.extend(budget, 1, go_on):
                            ev = torch.cuda.Event()
                            ev.record(side)
                            queued.append(ev)
                            grown += 1
                    else:
                        grown = g.extend(budget, n)
                        if auto and side is not None:
                            ev = torch.cuda.Event()
                            ev.record(side)
                            self._bg_done = ev
                    self.background_passes += grown
            finally:
                if static is not None:
                    static.capture_ok = True

        self._bg_auto = auto and cuda and not bounded
        if not threaded:
            levels()
            return

        def work() -> None:
            try:
                with torch.cuda.device(g.device) if cuda else contextlib.nullcontext():
                    levels()
            except BaseException as e:  # noqa: BLE001 - re-raised on the decode loop's thread by _join
                self._bg_error = e

        self._bg_thread = threading.Thread(target=work, name="specexec-overlap", daemon=True)
        self._bg_thread.start()

    def target_queued(self, done: torch.cuda.Event) -> None:
        """Called by the decode loop once the target's pass is queued, with an event recorded after it: bounded
        background levels (:data:`AHEAD_LEVELS`) stop being queued once it has completed."""
        self._target_done = done

    @property
    def overlapping(self) -> bool:
        """Whether steps grow levels beside the target's pass (the decode loop then gives that pass a stream of the
        highest priority, so the levels only take the SMs its kernels leave free)."""
        return self.cfg.overlap != 0 and self.draft.device.type == "cuda"

    def _bounded(self, device: torch.device) -> bool:
        """The background levels are queued from a thread on a GPU, a few ahead, until the target's pass ends."""
        threaded = device.type == "cuda" if self.threaded is None else self.threaded
        return threaded and device.type == "cuda" and AHEAD_LEVELS > 0

    @property
    def auto_levels(self) -> int:
        """``--overlap auto``: the levels the next step grows in the background (learnt per draft model, so they
        outlive a generation)."""
        n = self.draft.background_levels
        return OVERLAP_AUTO_START if n is None else n

    @auto_levels.setter
    def auto_levels(self, n: int) -> None:
        self.draft.background_levels = n

    def overlap_levels(self, cfg: TreeConfig) -> int:
        """The background levels a step grows: ``cfg.overlap``, or with ``--overlap auto`` :attr:`auto_levels` on a
        GPU (none on a CPU: there the levels run in turn and only cost time)."""
        if cfg.overlap != OVERLAP_AUTO:
            return cfg.overlap
        if self.draft.device.type != "cuda":
            return 0
        # bounded levels stop when the target's pass does: as many as fit, up to the slots reserved for them
        return OVERLAP_AUTO_MAX if self._bounded(self.draft.device) else self.auto_levels

    def adapt(self, finished: bool) -> None:
        """``--overlap auto``: the last step's background levels had ``finished`` by the time the target's pass
        (and the walk) had: two more next step; else three quarters (at least one). Reads no clock: the side
        stream's event says which of the two streams came second."""
        n = self.auto_levels
        self.auto_levels = min(OVERLAP_AUTO_MAX, n + 2) if finished else max(1, (3 * n) // 4)

    def _join(self) -> None:
        """Wait for :meth:`background`'s levels and put their nodes into the grown tree that :meth:`commit` reads."""
        t, self._bg_thread = self._bg_thread, None
        if t is not None:
            t.join()
        self._target_done = None  # the step's target pass is over (the next is announced afresh)
        err, self._bg_error = self._bg_error, None
        if err is not None:
            self._growth = None
            raise err
        growth, self._growth = self._growth, None
        if growth is None or self._grown is None:
            return
        g, chosen, _, _ = growth
        if self._side is not None:
            torch.cuda.current_stream(g.device).wait_stream(self._side)
        tree, k = self._grown[0], self._grown[1]
        full, index = regrown(g.tree, chosen)
        self._grown = (tree, k, full, index)

    @staticmethod
    def _tree_mask(tree: Tree, rows: Tensor, n: int, length: int) -> Tensor:
        """(k, length) bool: the committed prefix plus each row's expanded ancestors (itself included)."""
        mask = torch.zeros(rows.shape[0], length, dtype=torch.bool, device=tree.device)
        mask[:, :n] = True
        return tree.ancestor_slots(rows, length, base=mask)

    def _expand(self, tree: Tree, parents: Tensor, lq: Tensor, cfg: TreeConfig, budget: int, prune: bool) -> None:
        """The draft's log-probs ``lq`` (k, V) at the just-expanded ``parents``: propose each one's top
        ``max_branch`` children (remembered by draft slot when reuse is on)."""
        branch = min(cfg.max_branch, lq.shape[-1])
        vals, toks = torch.topk(lq, branch, dim=-1)  # (k, B)
        if self._cand_v is not None and self._cand_t is not None and self._cand_v.shape[1] == branch:
            slots = tree.draft_slot[parents]
            self._cand_v[slots] = vals
            self._cand_t[slots] = toks
        self._add_children(tree, parents, self.scores(vals), toks, budget, prune)

    @staticmethod
    def _add_children(tree: Tree, parents: Tensor, vals: Tensor, toks: Tensor, budget: int, prune: bool = True) -> None:
        """Add the proposed children (k, B) of ``parents`` (their draft log-probs ``vals``, tokens ``toks``) that
        can enter the top ``budget``; drop the other nodes outside the top ``budget``, except (``prune`` False) the
        expanded ones (below the budget-th best they are never open again: growth is the same)."""
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
            keep = tree.top_k_mask(budget)
            if not prune:  # and every expanded node (closed under ancestry: an expanded node's ancestors were)
                keep |= tree.draft_slot[: tree.size] >= 0
            tree.keep(keep)
