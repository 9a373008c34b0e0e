"""Captured levels: a fixed-width level of tree growth (its bookkeeping AND its draft pass) replayed as CUDA graphs
(``TreeConfig.grow`` "captured", the GPU's choice at a fixed budget).

"ahead" growth (:mod:`specexec.propose.fixed_grow`) reads one number a level, a level late, so the GPU never waits
for the host; but the host still launches each level's ~60 small bookkeeping kernels (the open set, the top-k of
the beams, slots, the ancestor rows, the mask, the children's top-k, the append) and then the pass's graph. On an
H200 with a 7B-shaped draft that was 3.6-5.7 ms of host time a level and 1.5 ms of GPU time in tiny kernels
(docs/BENCHMARKS.md, "Where the draft's time goes"): harmless while a pass took ~10 ms, a floor once a pass is
faster (a fused low-bit kernel, fewer rows). Here a level is two graph launches: the beams' choice (with the count
and the early stop's numbers) and then the level's expansion and pass. The host reads the count between them, so
no pass is wasted and the GPU waits only for that read and one graph launch a level. Knowing the count, the pass
runs the smallest static bucket that holds the open rows (at least :data:`MIN_ROWS`), not the level's full width
(the second graph is keyed by it).

What makes a level capturable: every shape and every address is fixed.

* The growth works in persistent arrays (:class:`LevelSpace`), reset in place each step, so a graph captured in
  one step replays in the next.
* A level runs over the arrays' whole capacity, not the live prefix: unused entries hold log-prob -inf and draft
  slot -1, so they are never open and never in the top ``budget``. The open set, the threshold (the
  ``budget``-th best log-prob, once the tree holds that many) and the beams come from the same top-k as in
  "ahead" growth, over more -inf entries.
* Every level chooses ``max_beams`` beams (beyond the open ones they are padding, as "ahead" pads) and expands the
  static bucket holding the open ones, so a graph's row count is fixed; the attention span is the static passes'
  bucket of the host's bound on the used slots.
* What moves from level to level lives on the device and is advanced by the graph itself: the next free draft
  slot, the write offset of the children, the row offset of the ancestor rows, the level counter.
* The draft pass fills the static passes' input buffers and runs the model inside the same capture.

A graph is keyed by what its kernels bake in: the row count, the span bucket, whether the tree is full (and then
the budget), whether the early stop's numbers are computed, and the log-prob function. A key's first level runs
eagerly (it warms up every kernel); the second captures (recording only), then replays. On a CPU, and for a key
not captured yet, the same code runs eagerly, which is how CI checks that a captured level grows exactly the tree
the dynamic growth grows. Sampled steps (coupled draft noise keyed by the step's seed) grow uncaptured "ahead"
levels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from specexec.model.graphs import StaticPasses
from specexec.steps.tree import Tree

log = logging.getLogger(__name__)

NEG = float("-inf")
# grow "captured" runs a level's pass over the static bucket holding its open rows, but at least this many: fewer
# rows cost about as much (a graphed 16-bit 7B pass: 6.6 ms at 1 row, 8.6 at 128), and every row bucket is
# one more graph to capture per span bucket
MIN_ROWS = 16


class LevelSpace:
    """The persistent arrays of captured growth (one per proposer; regrown when a step needs more) and its graphs.
    (``graphs`` maps a key to anything with ``replay()``: a CUDA graph, or in CPU tests a stand-in.)

    Node arrays of ``capacity``; per expanded node a row of its ancestors' draft slots (``exp_rows`` x ``width``);
    device counters; per level of a step its beam count (``levels`` at most)."""

    def __init__(self, capacity: int, width: int, exp_rows: int, levels: int, device: torch.device) -> None:
        self.capacity, self.width, self.exp_rows, self.levels, self.device = capacity, width, exp_rows, levels, device
        long: dict[str, Any] = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(capacity, **long)
        self.parents = torch.full((capacity,), -1, **long)
        self.depth = torch.zeros(capacity, **long)
        self.logp = torch.full((capacity,), NEG, dtype=torch.float32, device=device)
        self.draft_slot = torch.full((capacity,), -1, **long)
        self.rows = torch.full((exp_rows, width), -1, **long)
        self.row_of = torch.full((capacity,), -1, **long)
        self.nxt = torch.zeros((), **long)  # the next free draft slot
        self.size = torch.zeros((), **long)  # where the next level's children go (the host's ``tree.size``)
        self.row0 = torch.zeros((), **long)  # where the next level's ancestor rows go
        self.prefix = torch.zeros((), **long)  # n: the committed tokens (the root's position)
        self.level = torch.zeros((), **long)  # the step's captured levels so far
        self.passes = torch.zeros((), dtype=torch.float32, device=device)  # draft passes before the next level
        self.counts = torch.zeros(max(1, levels), **long)  # each captured level's beams
        self.stats = torch.zeros(4, dtype=torch.float32, device=device)  # the last level's count, E, U, passes
        self._selection: dict[int, tuple[Tensor, Tensor]] = {}  # per level width: the chosen beams, which are valid
        self.graphs: dict[Hashable, Any] = {}
        self.seen: set[Hashable] = set()  # keys run once eagerly (warmed up), captured on their next level
        self.captures = 0
        self.replays = 0
        self.failed: str | None = None  # why a capture failed (the levels then run eagerly)
        self.pool: Any = None  # one memory pool for every level graph (they replay one at a time)

    def selection(self, rows: int) -> tuple[Tensor, Tensor]:
        """The buffers a level's first half leaves its beams in for the second: (rows,) node indices and valid."""
        if rows not in self._selection:
            self._selection[rows] = (
                torch.zeros(rows, dtype=torch.long, device=self.device),
                torch.zeros(rows, dtype=torch.bool, device=self.device),
            )
        return self._selection[rows]

    def fits(self, capacity: int, width: int, exp_rows: int, levels: int, device: torch.device) -> bool:
        return (
            device == self.device
            and capacity <= self.capacity
            and width <= self.width
            and exp_rows <= self.exp_rows
            and levels <= self.levels
        )

    def tree(self, root_token: int) -> Tree:
        """Reset the arrays for a new step; a tree over them holding the root."""
        for a, v in ((self.tokens, 0), (self.parents, -1), (self.depth, 0), (self.draft_slot, -1), (self.row_of, -1)):
            a.fill_(v)
        self.logp.fill_(NEG)
        self.rows.fill_(-1)
        t = Tree.over(self.tokens, self.parents, self.depth, self.logp, self.draft_slot)
        self.tokens[0] = root_token
        self.logp[0] = 0.0
        return t

    def begin(self, next_slot: int, size: int, row0: int, prefix: int, passes: int) -> None:
        """The device counters at the first level of a step (host values: no read)."""
        self.nxt.fill_(next_slot)
        self.size.fill_(size)
        self.row0.fill_(row0)
        self.prefix.fill_(prefix)
        self.level.zero_()
        self.passes.fill_(float(passes))

    def run(self, key: Hashable, body: Callable[[], None], capture: bool) -> None:
        """One level: ``body`` eagerly (the key's first level, a CPU, ``capture`` False, or after a capture failed),
        else its graph (captured on the key's second level)."""
        if not capture or self.failed is not None:
            body()
            return
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.seen:  # warm up: the first level of a key runs as it is
                self.seen.add(key)
                body()
                return
            try:
                graph = self._capture(body)
            except Exception as e:  # noqa: BLE001 - any capture failure: the levels run eagerly from now on
                # a capture only records, so the level has not run: it runs eagerly now, as every later one will
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("captured growth levels are off for this draft (their capture failed: %s)", self.failed)
                body()
                return
            self.graphs[key] = graph
            self.captures += 1
            log.debug("captured a growth level: %s", key)
        graph.replay()
        self.replays += 1

    def _capture(self, body: Callable[[], None]) -> Any:
        """Record ``body`` as a graph (nothing runs until it is replayed)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body()
        return graph


def capturable(static: StaticPasses | None, rows: int) -> bool:
    """Whether a level of ``rows`` rows can be captured: the draft's passes are static and graphed (a GPU) and fit a
    bucket."""
    return static is not None and rows <= static.max_rows and static.use_graphs


def space_for(holder: Any, capacity: int, width: int, exp_rows: int, levels: int, device: torch.device) -> LevelSpace:
    """``holder``'s level space (attribute ``level_space``: the draft model's, so it and its graphs outlive a
    generation), regrown (dropping its graphs) when this step needs more."""
    space: LevelSpace | None = holder.level_space
    if space is None or not space.fits(capacity, width, exp_rows, levels, device):
        if space is not None:
            capacity, width = max(capacity, space.capacity), max(width, space.width)
            exp_rows, levels = max(exp_rows, space.exp_rows), max(levels, space.levels)
        space = LevelSpace(capacity, width, exp_rows, levels, device)
        holder.level_space = space
    return space
