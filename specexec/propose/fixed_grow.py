"""Best-first tree growth in fixed-width levels: no host read inside a level (``TreeConfig.grow`` "static" /
"ahead"; the default "dynamic" growth is :meth:`specexec.propose.tree.TreeDraft.grow`).

The dynamic growth compacts the tree after every level and sizes each draft pass by the number of open nodes, so
the host reads the device about six times a level (the budget-th log-prob, the open count, boolean selections, the
compaction's ``nonzero``, the mask's depth loop). On a GPU each read drains the stream: the host then launches the
next level's small kernels while the GPU idles. Here every shape is known on the host before a level runs:

* nodes are appended, never compacted: each level appends exactly ``W * B`` candidate children (W = beams per
  level, B = children per beam), those of padding beams at log-prob -inf. "In the tree" means "among the
  ``budget`` best": that set is the same as the dynamic growth's pruned tree (the top ``budget`` of everything ever
  proposed; ties aside), so the open nodes, the beams and the children are the same;
* each level runs the draft on exactly W rows (the best open nodes by log-prob; rows with no open node left are
  padding, write their keys/values to the cache's scratch slot and propose nothing); valid beams get consecutive
  draft slots from a device-side counter;
* each expanded node keeps a row of its ancestors' draft slots (by depth), so its attention mask is one scatter,
  not a pointer chase whose length the host must know.

The host reads one number per level, the number of beams a level expanded, to stop when none is left and to bound
the attention span. "static" reads it before the level's pass (the host waits for the previous pass; no pass is
wasted). "ahead" reads the previous level's count through a pinned buffer and an event, so the host queues level
l+1 while the GPU runs pass l; when growth ends, one pass over padding rows has run for nothing. The result is
compacted once, at the end, into the same trees (node order included) as the dynamic growth; draft slots may
differ. The cost-based early stop (a CPU policy) is not applied here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from specexec import sampling
from specexec.tree import Tree

if TYPE_CHECKING:
    from specexec.config import TreeConfig
    from specexec.propose.tree import TreeDraft

NEG = float("-inf")


class _Reader:
    """Reads a device scalar on the host: at once (``send`` then ``read``), or later without draining the stream
    (CUDA: a non-blocking copy into pinned memory and an event; ``read`` waits for that event only)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def send(self, t: Tensor) -> object:
        if not self.cuda:
            return t
        buf = torch.empty((), dtype=t.dtype, pin_memory=True)
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


class _Store:
    """Append-only node arrays (a :class:`Tree` of fixed capacity) plus, per expanded node, the draft slots of its
    ancestors and itself by depth (``rows``; -1 = none)."""

    def __init__(self, tree: Tree, width: int, exp_rows: int) -> None:
        self.tree = tree
        dev = tree.device
        self.rows = torch.full((exp_rows, width), -1, dtype=torch.long, device=dev)
        self.row_of = torch.full((tree.capacity,), -1, dtype=torch.long, device=dev)  # node -> its row, if expanded


def grow_fixed(
    prop: TreeDraft,
    seq: list[int],
    cfg: TreeConfig,
    logprobs,
    start: Tree | None,
    seed: int | None,
    ahead: bool,
) -> tuple[Tree, int, list[int]]:
    """Grow like :meth:`TreeDraft.grow` (without early stop) in fixed-width levels.

    Returns (the store: every node ever proposed, root first, ``size`` = all of them, padding at -inf; the draft
    passes run; tokens per pass). The caller keeps the best ``budget`` (and, for reuse, the expanded nodes)."""
    d = prop.draft
    dev = d.device
    n = len(seq) - 1
    budget = cfg.budget
    V = d.model.cfg.vocab_size
    B = min(cfg.max_branch, V)
    W = cfg.max_beams
    levels = cfg.max_depth - 1
    scratch = d.usable  # the cache's reserved slot: padding rows write there, no row reads it
    reader = _Reader(dev)

    if start is None:
        beams_log = [len(seq) - d.length]  # the catch-up pass's rows
        root_lq = logprobs(d.catch_up(seq))  # (1, V)
        if seed is not None:
            root_lq = sampling.coupled_logprobs(root_lq, seed, [n + 1])
        passes = 1
        base, base_depth, n_exp = 1, 0, 1
    else:
        passes, beams_log = 0, []
        base = start.size
        expanded = (start.draft_slot[:base] >= 0).nonzero().squeeze(1)  # root first
        n_exp = int(expanded.shape[0])
        base_depth = start.max_depth()
    width = base_depth + levels + 2
    capacity = base + B + levels * W * B
    store = _Store(
        Tree(seq[-1], capacity, dev) if start is None else start.resized(capacity), width, n_exp + levels * W
    )
    t = store.tree
    if start is None:
        t.draft_slot[0] = n
        store.rows[0, 0] = n
        store.row_of[0] = 0
        vals, toks = torch.topk(root_lq[0], B)
        _remember(prop, t.draft_slot[:1], vals[None], toks[None])
        _append(t, torch.zeros(B, dtype=torch.long, device=dev), toks, vals.float(), 1 + B)
        next_slot = n + 1
    else:
        r = torch.arange(n_exp, device=dev)
        cur = expanded.clone()
        for _ in range(base_depth + 1):  # each expanded node's ancestors (all expanded) by depth
            ok = cur >= 0
            at = cur.clamp(min=0)
            store.rows[r[ok], t.depth[at][ok]] = t.draft_slot[at][ok]
            cur = torch.where(ok, t.parents[at], cur)
        store.row_of[expanded] = r
        next_slot = int(t.draft_slot[:base].max()) + 1

    nxt = torch.full((), next_slot, dtype=torch.long, device=dev)  # the next free draft slot (device side)
    known = next_slot  # the host's exact copy, up to the last level whose count was read
    pending: object | None = None  # "ahead": the last level's count, not read yet
    counts: list[Tensor] = []
    row0 = n_exp
    for _ in range(levels):
        if ahead and pending is not None:
            c = reader.read(pending)
            if c == 0:  # the last pass expanded nothing, so nothing changed: nothing is open now either
                break
            known += c
        if known >= d.usable:
            break
        size = t.size
        k = min(W, size)
        lp = t.logp[:size]
        if size - 1 >= budget:
            thr = torch.topk(lp[1:], budget).values[-1]
        else:
            thr = lp.new_full((), NEG)  # made on the device (torch.tensor would copy from the host and wait)
        open_ = (t.draft_slot[:size] < 0) & (lp > thr)
        cand = torch.where(open_, lp, torch.full_like(lp, NEG))
        best, beams = torch.topk(cand, k)  # best first
        rank = torch.arange(k, device=dev)
        valid = (best > NEG) & (rank < d.usable - nxt)
        beams, order = beams.sort()  # ascending node index, as the dynamic growth assigns slots
        valid = valid[order]
        count = valid.sum()
        slots = torch.where(valid, nxt + valid.cumsum(0) - 1, torch.full_like(beams, scratch))
        nxt = nxt + count
        if ahead:
            pending = reader.send(count)
            span = min(d.usable, known + k)
        else:
            c = reader.read(reader.send(count))
            if c == 0:
                break
            span = known + c
            known = span
        counts.append(count)
        t.draft_slot[beams] = torch.where(valid, slots, t.draft_slot[beams])
        # ancestor-slot rows: the parent's row plus the beam's own slot at its depth (padding: the root's row)
        par = t.parents[beams].clamp(min=0)
        rows = store.rows[store.row_of[par].clamp(min=0)].clone()
        rows.scatter_(1, t.depth[beams][:, None].clamp(max=width - 1), slots[:, None])
        rows = torch.where(valid[:, None], rows, store.rows[0].expand_as(rows))
        store.rows[row0 : row0 + k] = rows
        store.row_of[beams] = torch.where(valid, torch.arange(row0, row0 + k, device=dev), store.row_of[beams])
        row0 += k
        mask = torch.zeros(k, span + 1, dtype=torch.bool, device=dev)
        mask[:, :n] = True
        mask.scatter_(1, torch.where(rows >= 0, rows, torch.full_like(rows, span)), True)
        mask = mask[:, :span]
        pos = torch.where(valid, n + t.depth[beams], torch.full_like(beams, n))
        lq = logprobs(d.forward(t.tokens[beams], pos, slots, mask))  # (k, V)
        if seed is not None:
            lq = sampling.coupled_logprobs(lq, seed, pos + 1)
        passes += 1
        vals, toks = torch.topk(lq, B, dim=-1)  # (k, B)
        _remember(prop, slots, vals, toks)
        cum = torch.where(valid[:, None], t.logp[beams][:, None] + vals, torch.full_like(vals, NEG))
        _append(t, beams[:, None].expand_as(toks).reshape(-1), toks.reshape(-1), cum.reshape(-1), size + k * B)
    if counts:
        beams_log += torch.stack(counts).tolist()
    return t, passes, beams_log


def _append(t: Tree, parents: Tensor, tokens: Tensor, logp: Tensor, end: int) -> None:
    """Children [t.size, end) (host-known size; padding children carry -inf)."""
    s = t.size
    t.tokens[s:end] = tokens
    t.parents[s:end] = parents
    t.depth[s:end] = t.depth[parents] + 1
    t.logp[s:end] = logp
    t.size = end


def _remember(prop: TreeDraft, slots: Tensor, vals: Tensor, toks: Tensor) -> None:
    """Reuse: each expanded node's proposed children, by draft slot (padding rows write the scratch row)."""
    if prop._cand_v is not None and prop._cand_t is not None and prop._cand_v.shape[1] == vals.shape[1]:
        prop._cand_v[slots] = vals
        prop._cand_t[slots] = toks


def finish(store: Tree, budget: int, capacity: int, keep_all: bool) -> tuple[Tree, Tree | None, Tensor | None]:
    """The grown store → (the best ``budget`` nodes in a tree of ``capacity``; with ``keep_all`` the full tree of
    those plus every expanded node, and the index of each kept node in it; else None, None). One host read."""
    finite = store.logp[: store.size] > NEG
    top = store.top_k_mask(budget) & finite
    if not keep_all:
        out, _ = store.select(top, capacity)
        return out, None, None
    full_keep = top | ((store.draft_slot[: store.size] >= 0) & finite)
    full, _ = store.select(full_keep, int(full_keep.sum()))
    out, index = full.select(full.top_k_mask(budget), capacity)
    return out, full, index
