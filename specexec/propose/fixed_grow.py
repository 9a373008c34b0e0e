"""Best-first tree growth in fixed-width levels: no host read inside a level (``TreeConfig.grow`` "ahead" and
"captured"; the CPU's "dynamic" growth is :meth:`specexec.propose.best_first.TreeDraft.grow`).

The dynamic growth compacts the tree after every level and sizes each draft pass by the number of open nodes, so
the host reads the device about six times a level (the budget-th log-prob, the open count, boolean selections, the
compaction's ``nonzero``, the mask's depth loop). On a GPU each read drains the stream: the host then launches the
next level's small kernels while the GPU idles. Here every shape is known on the host before a level runs:

* nodes are appended, never compacted: each level appends exactly ``W * B`` candidate children (W = beams per
  level, B = children per beam), those of padding beams at log-prob -inf. "In the tree" means "among the
  ``budget`` best": that set is the same as the dynamic growth's pruned tree (the top ``budget`` of everything ever
  proposed; ties aside), so the open nodes, the beams and the children are the same;
* each level runs the draft on W rows (fewer only while the tree has fewer nodes): the best open nodes by
  log-prob; rows with no open node left are padding, write their keys/values to the cache's scratch slot and
  propose nothing; valid beams get consecutive draft slots from a device-side counter;
* each expanded node keeps a row of its ancestors' draft slots (by depth), so its attention mask is one scatter,
  not a pointer chase whose length the host must know.

The host reads one number per level, the number of beams a level expanded, to stop when none is left and to bound
the attention span. "ahead" reads the previous level's count through a pinned buffer and an event, so the host
queues level l+1 while the GPU runs pass l; when growth ends, one pass over padding rows has run for nothing.
"captured" (:mod:`.captured`) runs a level as two CUDA graphs and reads its count between them, before the level's
pass (no pass is wasted). The result is compacted once, at the end, into the same trees (node order included) as
the dynamic growth; draft slots may differ. The cost-based early stop (``TreeConfig.early_stop``, the dynamic
growth's rule: one more pass only while its beams' mass U can pay for it, given E and the step's costs) is decided
on E and U read with the level's count, in the same transfer; "ahead" decides it a level late (one pass more than
the dynamic growth at most).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from specexec.propose.captured import MIN_ROWS, LevelSpace, capturable, space_for
from specexec.steps import sampling
from specexec.steps.tree import Tree

if TYPE_CHECKING:
    from specexec.config import TreeConfig
    from specexec.propose.draft_model import DraftModel
    from specexec.steps.rules import GrowCost

NEG = float("-inf")


class _Reader:
    """Reads a device scalar on the host: at once (``send`` then ``read``), or later without draining the stream
    (CUDA: a non-blocking copy into pinned memory and an event; ``read`` waits for that event only)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def send(self, t: Tensor) -> object:
        if not self.cuda:
            return t
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return buf, ev

    def read(self, h: object) -> int:
        if not self.cuda:
            assert isinstance(h, Tensor)
            return int(h)
        buf, ev = cast("tuple[Tensor, torch.cuda.Event]", h)
        ev.synchronize()
        return int(buf)

    def read_all(self, h: object) -> list[float]:
        """A sent vector's values."""
        if not self.cuda:
            assert isinstance(h, Tensor)
            return h.tolist()
        buf, ev = cast("tuple[Tensor, torch.cuda.Event]", h)
        ev.synchronize()
        return buf.tolist()


class _Store:
    """Append-only node arrays (a :class:`Tree` of fixed capacity) plus, per expanded node, the draft slots of its
    ancestors and itself by depth (``rows``; -1 = none). ``space``: take the arrays from a captured growth's
    persistent :class:`~specexec.propose.captured.LevelSpace` (reset by its ``tree``)."""

    def __init__(self, tree: Tree, width: int, exp_rows: int, space: LevelSpace | None = None) -> None:
        self.tree = tree
        dev = tree.device
        if space is not None:
            self.rows, self.row_of = space.rows, space.row_of
            return
        self.rows = torch.full((exp_rows, width), -1, dtype=torch.long, device=dev)
        self.row_of = torch.full((tree.capacity,), -1, dtype=torch.long, device=dev)  # node -> its row, if expanded


class FixedGrowth:
    """One tree's growth in fixed-width levels: the store, the device-side slot counter and the host's bound on it.
    :meth:`run` grows like :meth:`~specexec.propose.best_first.TreeDraft.grow`."""

    def __init__(
        self,
        draft: DraftModel,
        seq: list[int],
        cfg: TreeConfig,
        logprobs,
        seed: int | None,
        stop: GrowCost | None = None,
        captured: bool = False,
    ) -> None:
        d = self.draft = draft
        self.stop = stop  # the cost-based early stop (None: off)
        self.stopped = False
        self.logprobs, self.seed = logprobs, seed
        dev = self.device = d.device
        self.n = n = len(seq) - 1
        self.B = B = min(cfg.max_branch, d.model.cfg.vocab_size)
        self.W = W = cfg.max_beams
        self.levels = levels = cfg.max_depth - 1  # up to ``max_depth`` deep
        self.reader = _Reader(dev)
        self.beams_log = [len(seq) - d.length]  # the catch-up pass's rows
        root_lq = logprobs(d.catch_up(seq))  # (1, V)
        if seed is not None:
            root_lq = sampling.coupled_logprobs(root_lq, seed, [n + 1])
        self.passes = 1
        self.width = levels + 2
        capacity = 1 + B + levels * W * B
        # captured levels (greedy steps only: a sampled step's coupled noise is keyed by its seed)
        self.space = (
            space_for(d, capacity, self.width, 1 + levels * W, levels, dev) if captured and seed is None else None
        )
        if self.space is not None:
            tree = self.space.tree(seq[-1])
            self.width = self.space.width
        else:
            tree = Tree(seq[-1], capacity, dev)
        store = self.store = _Store(tree, self.width, 1 + levels * W, self.space)
        t = self.tree = store.tree
        t.draft_slot[0] = n
        store.rows[0, 0] = n
        store.row_of[0] = 0
        vals, toks = torch.topk(root_lq[0], B)
        _append(t, torch.zeros(B, dtype=torch.long, device=dev), toks, vals.float(), 1 + B)
        next_slot = n + 1
        # the next free draft slot (device)
        self.nxt = self.space.nxt if self.space is not None else torch.full((), next_slot, dtype=torch.long, device=dev)
        self.known = next_slot  # the host's exact copy, up to the last level whose count was read
        self.unread: list[tuple[object, int]] = []  # (count handle, rows) of levels not read yet, oldest first
        self.counts: list[Tensor] = []
        self.row0 = 1
        self.captured_levels = 0  # levels run by :meth:`_level_captured` (their counts are in the space)
        if self.space is not None:
            self.space.begin(next_slot, t.size, 1, n, self.passes)

    @property
    def bound(self) -> int:
        """An upper bound on the next free slot: exact up to the last read level, plus every later level's rows."""
        return self.known + sum(k for _, k in self.unread)

    def run(self, budget: int) -> None:
        """Best-first growth towards the best ``budget`` nodes, up to ``max_depth`` deep; stops when no node is open
        or when the early stop says so (captured levels read a level's count before its pass, "ahead" ones a level
        late)."""
        for _ in range(self.levels):
            if self.space is None and not self._read_late():
                break
            if self.bound >= self.draft.usable:
                break
            if not (self._level_captured(budget) if self.space is not None else self._level_ahead(budget)):
                break

    def _read_late(self) -> bool:
        """The previous level's count (and early-stop numbers), read a level late ("ahead"). False: growth is over."""
        if not self.unread:
            return True
        h, _k = self.unread.pop(0)
        if self.stop is not None:  # (count, E, U, passes before that level): see :meth:`_level_ahead`
            c_f, e, u, done = self.reader.read_all(h)
            c = int(c_f)
            if c and e == e and not self.stop.more(e, u, int(done)):  # e is NaN when the tree was not full
                self.known += c
                self.stopped = True
                return False
        else:
            c = self.reader.read(h)
        self.known += c
        return c > 0  # the last pass expanded nothing, so nothing changed: nothing is open now either

    def _level_ahead(self, budget: int) -> bool:
        """One uncaptured level; its count is sent to be read by the next level. False: growth is over."""
        t, store, d, dev = self.tree, self.store, self.draft, self.device
        size = t.size
        k = min(self.W, size)
        lp = t.logp[:size]
        top = None  # the verified tree's log-probs (the best ``budget``), once the store holds that many
        if size - 1 >= budget:
            top = torch.topk(lp[1:], budget).values
            thr = top[-1]
        else:
            thr = lp.new_full((), NEG)  # made on the device (torch.tensor would copy from the host and wait)
        open_ = (t.draft_slot[:size] < 0) & (lp > thr)
        cand = torch.where(open_, lp, torch.full_like(lp, NEG))
        best, beams = torch.topk(cand, k)  # best first
        rank = torch.arange(k, device=dev)
        valid = (best > NEG) & (rank < d.usable - self.nxt)
        count = valid.sum()
        sent = count
        if self.stop is not None:  # early stop: E (1 + the tree's path mass) and U (the mass of this level's beams,
            # a bound on what its pass can add) travel with the count, in the same read
            nan = lp.new_full((), float("nan"))
            e = 1.0 + top.exp().sum() if top is not None else nan
            u = torch.where(valid, best, torch.full_like(best, NEG)).exp().sum()
            sent = torch.stack([count.float(), e.float(), u.float(), lp.new_full((), float(self.passes))])
        beams, order = beams.sort()  # ascending node index, as the dynamic growth assigns slots
        valid = valid[order]
        slots = torch.where(valid, self.nxt + valid.cumsum(0) - 1, torch.full_like(beams, d.usable))  # d.usable:
        # the scratch slot (padding rows write there, no row reads it)
        self.nxt = self.nxt + count
        span = min(d.usable, self.bound + k)
        self.unread.append((self.reader.send(sent), k))
        self.counts.append(count)
        t.draft_slot[beams] = torch.where(valid, slots, t.draft_slot[beams])
        # ancestor-slot rows: the parent's row plus the beam's own slot at its depth (padding: the root's row)
        par = t.parents[beams].clamp(min=0)
        rows = store.rows[store.row_of[par].clamp(min=0)].clone()
        rows.scatter_(1, t.depth[beams][:, None].clamp(max=self.width - 1), slots[:, None])
        rows = torch.where(valid[:, None], rows, store.rows[0].expand_as(rows))
        r0 = self.row0
        store.rows[r0 : r0 + k] = rows
        store.row_of[beams] = torch.where(valid, torch.arange(r0, r0 + k, device=dev), store.row_of[beams])
        self.row0 += k
        mask = torch.zeros(k, span + 1, dtype=torch.bool, device=dev)
        mask[:, : self.n] = True
        mask.scatter_(1, torch.where(rows >= 0, rows, torch.full_like(rows, span)), True)
        mask = mask[:, :span]
        pos = torch.where(valid, self.n + t.depth[beams], torch.full_like(beams, self.n))
        lq = self.logprobs(d.forward(t.tokens[beams], pos, slots, mask))  # (k, V)
        if self.seed is not None:
            lq = sampling.coupled_logprobs(lq, self.seed, pos + 1)
        self.passes += 1
        vals, toks = torch.topk(lq, self.B, dim=-1)  # (k, B)
        cum = torch.where(valid[:, None], t.logp[beams][:, None] + vals, torch.full_like(vals, NEG))
        par = beams[:, None].expand_as(toks).reshape(-1)
        _append(t, par, toks.reshape(-1), cum.reshape(-1), size + k * self.B)
        return True

    def _level_captured(self, budget: int) -> bool:
        """One level as :meth:`_level_ahead` grows it, on the device (:mod:`.captured`): graph replays on a GPU once
        its keys have been seen, else the same code eagerly. The beams are chosen (one graph), their count and
        early-stop numbers read, then the level is expanded (a second graph): the dynamic growth's passes, one short
        host wait a level. The host advances its own copies of the sizes (known without a read). False: growth is
        over."""
        space, d, t = self.space, self.draft, self.tree
        assert space is not None
        W, B = self.W, self.B
        st = d.static
        full = t.size - 1 >= budget
        capture = capturable(st, W)
        fn = getattr(self.logprobs, "__code__", self.logprobs)  # greedy steps: the same ops whatever the closure
        # what a graph bakes in: shapes, the budget once the tree is full, and the addresses it touches outside the
        # space (the draft's cache, its static inputs)
        bound = (d.cache.k.data_ptr(), id(st), W, B, self.width, d.usable)
        select = ("select", budget if full else 0, self.stop is not None, bound)
        stats = space.stats if self.stop is not None else space.stats[0]
        space.run(select, lambda: self._select(budget, full), capture)
        h = self.reader.send(stats)
        if self.stop is not None:
            c_f, e_h, u_h, _ = self.reader.read_all(h)
            c = int(c_f)
            if c and e_h == e_h and not self.stop.more(e_h, u_h, self.passes):  # only a full tree
                self.stopped = True
                return False
        else:
            c = self.reader.read(h)
        if c == 0:
            return False
        self.known += c
        span = self._span(self.known)
        # the count is known: the pass runs the smallest static bucket that holds the open rows (at least MIN_ROWS;
        # all of them without static passes), not the level's full width
        rows = st._bucket(max(c, min(W, MIN_ROWS))) if st is not None and W <= st.max_rows else c
        space.run(("expand", span, rows, fn, bound), lambda: self._expand(span, rows), capture)
        self.captured_levels += 1
        self.row0 += rows
        t.size += rows * B
        self.passes += 1
        return True

    def _span(self, used: int) -> int:
        """The attention span of a level whose rows read slots below ``used``: the static passes' bucket."""
        st = self.draft.static
        return st._span(used) if st is not None and self.W <= st.max_rows else used

    def _select(self, budget: int, full: bool) -> None:
        """A captured level's first half, over the space's whole arrays: its beams (best open nodes), which of them
        are valid, and the count / E / U / passes the host reads (``space.stats``). Changes no tree array."""
        space, d, t, dev = self.space, self.draft, self.tree, self.device
        assert space is not None
        W = self.W
        lp = t.logp
        if full:
            top = torch.topk(lp[1:], budget).values
            thr = top[-1]
        else:
            thr = lp.new_full((), NEG)
        open_ = (t.draft_slot < 0) & (lp > thr)
        best, beams = torch.topk(torch.where(open_, lp, torch.full_like(lp, NEG)), W)
        rank = torch.arange(W, device=dev)
        valid = (best > NEG) & (rank < d.usable - space.nxt)
        count = valid.sum()
        if self.stop is not None:
            nan = lp.new_full((), float("nan"))
            e = 1.0 + top.exp().sum() if full else nan
            u = torch.where(valid, best, torch.full_like(best, NEG)).exp().sum()
            space.stats.copy_(torch.stack([count.float(), e.float(), u.float(), space.passes]))
        else:
            space.stats[0] = count.float()
        sel_beams, sel_valid = space.selection(W)
        sel_beams.copy_(beams)
        sel_valid.copy_(valid)

    def _expand(self, span: int, R: int) -> None:
        """A captured level's second half over its first ``R`` selected rows (the valid beams lead the selection,
        best first; R >= their count): the beams get draft slots and ancestor rows, run through the draft (its static
        passes' inputs filled here, its model run inside the same graph), and their children are appended at the
        space's offset."""
        space, d, t, dev = self.space, self.draft, self.tree, self.device
        assert space is not None
        B = self.B
        beams, valid = space.selection(self.W)
        beams, valid = beams[:R], valid[:R]
        count = valid.sum()
        space.counts.index_copy_(0, space.level.reshape(1), count.reshape(1))
        space.level.add_(1)
        space.passes.add_(1.0)
        rank = torch.arange(R, device=dev)
        beams, order = beams.sort()
        valid = valid[order]
        slots = torch.where(valid, space.nxt + valid.cumsum(0) - 1, torch.full_like(beams, d.usable))
        space.nxt.add_(count)
        t.draft_slot[beams] = torch.where(valid, slots, t.draft_slot[beams])
        par = t.parents[beams].clamp(min=0)
        rows = space.rows[space.row_of[par].clamp(min=0)]
        rows.scatter_(1, t.depth[beams][:, None].clamp(max=self.width - 1), slots[:, None])
        rows = torch.where(valid[:, None], rows, space.rows[0].expand_as(rows))
        at = space.row0 + rank
        space.rows.index_copy_(0, at, rows)
        space.row_of[beams] = torch.where(valid, at, space.row_of[beams])
        space.row0.add_(R)
        cols = torch.arange(span + 1, device=dev)
        mask = (cols < space.prefix)[None, :].expand(R, span + 1).contiguous()
        mask.scatter_(1, torch.where(rows >= 0, rows, torch.full_like(rows, span)), True)
        mask = mask[:, :span]
        pos = torch.where(valid, space.prefix + t.depth[beams], space.prefix.expand_as(beams))
        tokens = d.in_vocab(t.tokens[beams])
        st = d.static
        if st is not None and R <= st.max_rows:
            b = st._bucket(R)
            st._fill(tokens, pos, slots, mask, b, span)
            logits = st._run(b, span)[:R]
        else:
            logits = d.model.forward(tokens, pos, slots, mask, d.cache, fused_norm=d.fused_norm)
        lq = self.logprobs(logits)
        vals, toks = torch.topk(lq, B, dim=-1)  # (R, B)
        cum = torch.where(valid[:, None], t.logp[beams][:, None] + vals, torch.full_like(vals, NEG))
        par = beams[:, None].expand_as(toks).reshape(-1)
        at = space.size + torch.arange(R * B, device=dev)
        t.tokens.index_copy_(0, at, toks.reshape(-1))
        t.parents.index_copy_(0, at, par)
        t.depth.index_copy_(0, at, t.depth[par] + 1)
        t.logp.index_copy_(0, at, cum.reshape(-1).float())
        space.size.add_(R * B)

    def tokens_per_pass(self) -> list[int]:
        """The rows of every pass run so far (one host read)."""
        cap = self.space.counts[: self.captured_levels].tolist() if self.space is not None else []
        return self.beams_log + cap + (torch.stack(self.counts).tolist() if self.counts else [])


def grow_fixed(
    draft: DraftModel,
    seq: list[int],
    cfg: TreeConfig,
    logprobs,
    seed: int | None,
    stop: GrowCost | None = None,
    captured: bool = False,
) -> FixedGrowth:
    """Grow like :meth:`~specexec.propose.best_first.TreeDraft.grow` in fixed-width levels with ``draft``. The
    result's store holds every node ever proposed (root first, padding at -inf); the caller keeps the best ``budget``.
    ``stop``: the cost-based early stop (as the dynamic growth's, decided on the values read with each level's count;
    "ahead" decides a level late). ``captured``: levels as CUDA graphs (greedy steps; a sampled step grows "ahead"
    levels)."""
    g = FixedGrowth(draft, seq, cfg, logprobs, seed, stop, captured)
    g.run(cfg.budget)
    return g


def _append(t: Tree, parents: Tensor, tokens: Tensor, logp: Tensor, end: int) -> None:
    """Children [t.size, end) (host-known size; padding children carry -inf)."""
    s = t.size
    t.tokens[s:end] = tokens
    t.parents[s:end] = parents
    t.depth[s:end] = t.depth[parents] + 1
    t.logp[s:end] = logp
    t.size = end


def finish(store: Tree, budget: int, capacity: int) -> Tree:
    """The grown store -> the best ``budget`` nodes in a tree of ``capacity`` (one host read)."""
    finite = store.logp[: store.size] > NEG
    return store.select(store.top_k_mask(budget) & finite, capacity)[0]
