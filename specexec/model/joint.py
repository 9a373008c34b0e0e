"""Several generations' passes as one: lanes of one KV pool, and the rendezvous that packs their passes together.

Each concurrent generation (a *lane*) owns a :class:`KVRegion`, a window of slots in one pooled
:class:`~specexec.model.kv_cache.KVCache` per model. A pass on a region does not run at once: the lane's thread
hands it to :class:`JointPasses` and waits. When every registered lane waits, the last to arrive runs a *round*:
all waiting passes of one model become one pass over the pool -- the rows end to end, each request's slots moved
to its region, one mask in which each row sees only its own region's slots. The linears then read the weights
(streamed layers: copied) once for every request.

Exactness: a pass packs requests only when its model is row-invariant (:meth:`Transformer.row_invariant`: every
row's result is the same bits in any pass and beside any other rows, and attention reads each row's own slots in
position order); then each request's logits are exactly those of its solo run. Other models run each lane's pass
alone, in turn.

Chunked prefill: one joint pass holds at most ``chunk`` rows (the engine sizes it to the rows its memory plan
left room for); a round packs the waiting passes into as few joint passes as that allows, and a longer pass (a
joining request's prompt) is served over several rounds while the running requests' steps go on beside it. Its
rows attend only to rows before them (a prompt is causal, a tree lists parents first), so splitting it changes
nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specexec.model.kv_cache import KVCache


class KVRegion(KVCache):
    """Slots [base, base + capacity) of a pooled cache, used as a cache of its own (views: no copy). Passes on it
    go through ``joint``."""

    def __init__(self, pool: KVCache, base: int, capacity: int, joint: JointPasses) -> None:
        if base + capacity > pool.capacity:
            raise ValueError(f"region [{base}, {base + capacity}) past the pool's {pool.capacity} slots")
        self.k = pool.k[:, :, base : base + capacity]
        self.v = pool.v[:, :, base : base + capacity]
        self.capacity, self.length = capacity, 0
        self.pool, self.base, self.joint = pool, base, joint


@dataclass(eq=False)
class _Pass:
    """One lane's pass, waiting or part-served: its rows [0, done) have run."""

    model: Any
    region: KVRegion
    tokens: Tensor
    positions: Tensor
    slots: Tensor
    mask: Tensor
    want: Tensor  # (R,) the rows whose logits the caller wants, in its order
    fused_norm: bool
    hidden: list[Tensor] | None
    done: int = 0
    outs: list[Tensor] = field(default_factory=list)  # logits of the wanted rows served so far, in row order
    hiddens: list[Tensor] = field(default_factory=list)
    error: BaseException | None = None
    finished: bool = False

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    def result(self) -> Tensor:
        order = torch.argsort(self.want)  # served in row order; the caller asked in ``want``'s order
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        out = torch.cat(self.outs)[back.to(self.outs[0].device)]
        if self.hidden is not None:
            self.hidden.append(torch.cat(self.hiddens)[back.to(self.hiddens[0].device)])
        return out


class JointPasses:
    """The rendezvous of the lanes' passes (see the module docstring). ``chunk``: the most rows of one joint pass.
    Counters for ``/health`` and tests: ``rounds``, ``packed`` (passes that ran beside another)."""

    def __init__(self, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = chunk
        self._cond = threading.Condition()
        self._lanes = 0  # registered lane threads
        self._waiting: list[_Pass] = []
        self._busy = False  # a round (or a pass outside the lanes) is running
        self._local = threading.local()
        self.rounds = 0
        self.packed = 0

    @contextmanager
    def lane(self) -> Iterator[None]:
        """Register the calling thread as a lane for the block: its passes on regions wait for the others'."""
        with self._cond:
            self._lanes += 1
        self._local.lane = True
        try:
            yield
        finally:
            self._local.lane = False
            with self._cond:
                self._lanes -= 1
                self._cond.notify_all()  # the others may all be waiting now: one of them runs the round

    @property
    def lanes(self) -> int:
        with self._cond:
            return self._lanes

    def forward(
        self,
        model: Any,
        region: KVRegion,
        tokens: Tensor,
        positions: Tensor,
        slots: Tensor,
        mask: Tensor,
        logits_rows: Tensor | slice | None,
        fused_norm: bool,
        hidden: list[Tensor] | None,
    ) -> Tensor:
        """``model.forward`` on ``region``: from a lane thread, through the rendezvous; from any other thread, at
        once (between rounds), alone."""
        T = int(tokens.shape[0])
        want = torch.arange(T, device=tokens.device)
        if logits_rows is not None:
            want = want[logits_rows].reshape(-1)
        p = _Pass(model, region, tokens, positions, slots, mask, want, fused_norm, hidden)
        with self._cond:
            if not getattr(self._local, "lane", False):
                while self._busy:
                    self._cond.wait()
                self._busy = True
                try:
                    self._cond.release()
                    try:
                        while not p.finished:
                            self._serve([p], alone=True)
                    finally:
                        self._cond.acquire()
                finally:
                    self._busy = False
                    self._cond.notify_all()
            else:
                self._waiting.append(p)
                while not p.finished:
                    if not self._busy and len(self._waiting) >= self._lanes:
                        self._round()
                    else:
                        self._cond.wait()
        if p.error is not None:
            raise p.error
        return p.result()

    def _round(self) -> None:
        """Serve one chunk of every waiting pass (called holding the condition; releases it while passes run)."""
        self._busy = True
        batch = list(self._waiting)
        self._cond.release()
        try:
            self._serve(batch, alone=False)
        finally:
            self._cond.acquire()
            self._busy = False
            self._waiting = [p for p in self._waiting if not p.finished]
            self.rounds += 1
            self._cond.notify_all()

    def _serve(self, batch: list[_Pass], alone: bool) -> None:
        groups: dict[tuple[int, bool], list[_Pass]] = {}
        for p in batch:
            groups.setdefault((id(p.model), p.fused_norm), []).append(p)
        for group in groups.values():
            model = group[0].model
            if alone or len(group) == 1 or not model.row_invariant():
                for p in group:
                    self._run([(p, min(p.rows - p.done, self.chunk))])
                continue
            # the steps first, whole; a prompt's rows fill what is left of the pass (the rest waits a round)
            packs: list[list[tuple[_Pass, int]]] = [[]]
            room = self.chunk
            for p in sorted(group, key=lambda q: q.rows - q.done):
                if room == 0:
                    packs.append([])
                    room = self.chunk
                take = min(p.rows - p.done, room)
                packs[-1].append((p, take))
                room -= take
            for pack in packs:
                self._run(pack)
                if len(pack) > 1:
                    self.packed += len(pack)

    def _run(self, group: list[tuple[_Pass, int]]) -> None:
        """One pass over the pool: the next ``take`` rows of each pass in ``group`` (all on one model and pool)."""
        try:
            model, pool = group[0][0].model, group[0][0].region.pool
            dev = group[0][0].tokens.device
            spans = [(p, p.done, p.done + take) for p, take in group]
            width = max(p.region.base + p.mask.shape[1] for p, _ in group)
            total = sum(b - a for _, a, b in spans)
            mask = torch.zeros(total, width, dtype=torch.bool, device=dev)
            toks, pos, slots, rows, counts = [], [], [], [], []
            r0 = 0
            for p, a, b in spans:
                base = p.region.base
                toks.append(p.tokens[a:b])
                pos.append(p.positions[a:b])
                slots.append(p.slots[a:b] + base)
                mask[r0 : r0 + b - a, base : base + p.mask.shape[1]] = p.mask[a:b]
                sel = torch.sort(p.want[(p.want >= a) & (p.want < b)]).values
                rows.append(sel - a + r0)
                counts.append(int(sel.numel()))
                r0 += b - a
            picked = torch.cat(rows)
            # a round whose rows nobody reads (a prompt's middle chunks) still computes one row's logits
            read = picked if picked.numel() else torch.tensor([total - 1], device=dev)
            hidden: list[Tensor] | None = [] if any(p.hidden is not None for p, _ in group) else None
            out = model.forward(torch.cat(toks), torch.cat(pos), torch.cat(slots), mask, pool, logits_rows=read,
                                fused_norm=group[0][0].fused_norm, hidden=hidden)  # fmt: skip
            h = None if hidden is None else torch.cat(hidden)
            at = 0
            for (p, _, b), n in zip(spans, counts):
                if n:
                    p.outs.append(out[at : at + n])
                    if h is not None:
                        p.hiddens.append(h[at : at + n])
                at += n
                p.done = b
                p.finished = b >= p.rows
        except BaseException as e:  # noqa: BLE001 - every pass of the group gets the error, in its own thread
            for p, _ in group:
                p.error, p.finished = e, True
