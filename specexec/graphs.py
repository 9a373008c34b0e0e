"""Static-shape draft passes, replayed as CUDA graphs.

A draft pass over a few dozen tokens of a 7B model is launch-bound in eager PyTorch (GPU.md: 14–15 ms eager vs
6.6–8.6 ms as one CUDA graph), and a tree needs 10–20 of them per step. So the draft's passes run with static
shapes: the pass is padded up to a bucket size (1, 2, 4, … max_beams rows), attention always spans the whole
cache capacity C (the mask hides what a row may not see), and one graph per bucket is captured once and replayed.

Padding rows write their keys/values to a scratch slot (C-1, never attended by real rows) and attend only to it,
so they cannot disturb real rows. On the CPU the same padded path runs eagerly (``use_graphs=False``), which is
how CI checks that padding does not change results.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from specexec.kv_cache import KVCache
from specexec.model import Transformer

log = logging.getLogger(__name__)


class StaticPasses:
    """``forward(tokens, positions, slots, mask)`` with padded static shapes; CUDA graphs when on a GPU."""

    def __init__(self, model: Transformer, cache: KVCache, max_rows: int, use_graphs: bool | None = None) -> None:
        self.model, self.cache = model, cache
        self.C = cache.capacity
        self.scratch = self.C - 1
        self.buckets = []
        b = 1
        while b < max_rows:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(max_rows)
        dev = model.device
        self.use_graphs = (dev.type == "cuda") if use_graphs is None else use_graphs
        big = self.buckets[-1]
        self.tokens = torch.zeros(big, dtype=torch.long, device=dev)
        self.pos = torch.zeros(big, dtype=torch.long, device=dev)
        self.slots = torch.full((big,), self.scratch, dtype=torch.long, device=dev)
        self.mask = torch.zeros(big, self.C, dtype=torch.bool, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def _bucket(self, k: int) -> int:
        for b in self.buckets:
            if b >= k:
                return b
        raise ValueError(f"pass of {k} rows exceeds the largest bucket {self.buckets[-1]}")

    def _fill(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, b: int) -> None:
        k, L = mask.shape
        self.tokens[:k] = tokens
        self.pos[:k] = positions
        self.slots[:k] = slots
        self.mask[:k, :L] = mask
        self.mask[:k, L:] = False
        # padding rows: write to and read from the scratch slot only
        self.tokens[k:b] = 0
        self.pos[k:b] = 0
        self.slots[k:b] = self.scratch
        self.mask[k:b] = False
        self.mask[k:b, self.scratch] = True

    def _run(self, b: int) -> Tensor:
        return self.model.forward(self.tokens[:b], self.pos[:b], self.slots[:b], self.mask[:b], self.cache)

    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        """Logits (k, V) for k rows; ``mask`` (k, L) with L <= C-1 (the scratch slot is reserved)."""
        k = tokens.shape[0]
        b = self._bucket(k)
        self._fill(tokens, positions, slots, mask, b)
        if not self.use_graphs:
            return self._run(b)[:k]
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:k]

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Warm up on a side stream, then capture one pass of ``b`` rows (the inputs are the static buffers)."""
        # Warm-up writes go to the scratch slot only (all rows are padding rows here).
        saved = (self.slots[:b].clone(), self.mask[:b].clone(), self.tokens[:b].clone(), self.pos[:b].clone())
        self.slots[:b] = self.scratch
        self.mask[:b] = False
        self.mask[:b, self.scratch] = True
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._run(b)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run(b)
        self.slots[:b], self.mask[:b], self.tokens[:b], self.pos[:b] = saved
        log.debug("captured draft graph for %d rows", b)
        return graph, out
