"""Static-shape draft passes, replayed as CUDA graphs.

A draft pass over a few dozen tokens of a 7B model is launch-bound in eager PyTorch (as one CUDA graph it takes
about half the eager time; see docs/BENCHMARKS.md), and a tree needs 10–20 of them per step. So the draft's passes
run with static shapes: the pass is padded up to a bucket of rows (1, 2, 4, … max_beams) and its attention span up
to a multiple of ``span_step`` slots (the mask hides what a row may not see), and one graph per (rows, span)
bucket is captured on first use and replayed. Bucketing the span matters: attention over the whole capacity costs
~45% of a 7B draft pass on an H100.

Padding rows write their keys/values to a scratch slot (C-1, outside every span, never attended) and attend only
to slot 0, so they cannot disturb real rows. On the CPU the same padded path runs eagerly (``use_graphs=False``),
which is
how CI checks that padding does not change results.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from specexec.model.kv_cache import KVCache
from specexec.model.transformer import Transformer

log = logging.getLogger(__name__)


class StaticPasses:
    """``forward(tokens, positions, slots, mask)`` with padded static shapes; CUDA graphs when on a GPU."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        max_rows: int,
        use_graphs: bool | None = None,
        span_step: int = 256,
        fused_norm: bool = False,
    ) -> None:
        self.model, self.cache = model, cache
        self.fused_norm = fused_norm  # passed to every pass (see Transformer.forward)
        self.span_step = span_step
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
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.captures = 0  # graphs captured so far (each waits for the whole device)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def _bucket(self, k: int) -> int:
        for b in self.buckets:
            if b >= k:
                return b
        raise ValueError(f"pass of {k} rows exceeds the largest bucket {self.buckets[-1]}")

    def _span(self, L: int) -> int:
        return min(self.scratch, -(-L // self.span_step) * self.span_step)

    def _pad_rows(self, lo: int, hi: int, span: int) -> None:
        """Rows [lo, hi) become padding: token 0 at position 0, written to the scratch slot, reading slot 0."""
        self.tokens[lo:hi] = 0
        self.pos[lo:hi] = 0
        self.slots[lo:hi] = self.scratch
        self.mask[lo:hi, :span] = False
        self.mask[lo:hi, 0] = True

    def _fill(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, b: int, span: int) -> None:
        k, L = mask.shape
        self.tokens[:k] = tokens
        self.pos[:k] = positions
        self.slots[:k] = slots
        self.mask[:k, :L] = mask
        self.mask[:k, L:span] = False
        self._pad_rows(k, b, span)

    def _run(self, b: int, span: int) -> Tensor:
        return self.model.forward(
            self.tokens[:b], self.pos[:b], self.slots[:b], self.mask[:b, :span], self.cache, fused_norm=self.fused_norm
        )

    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        """Logits (k, V) for k rows; ``mask`` (k, L) with L <= C-1 (the scratch slot is reserved)."""
        k, L = mask.shape
        if L > self.scratch:
            raise ValueError(f"attention span {L} exceeds the cache's usable {self.scratch} slots")
        b, span = self._bucket(k), self._span(L)
        self._fill(tokens, positions, slots, mask, b, span)
        if not self.use_graphs:
            return self._run(b, span)[:k]
        if (b, span) not in self.graphs:
            self.graphs[(b, span)] = self._capture(b, span)
            self.captures += 1
        graph, out = self.graphs[(b, span)]
        graph.replay()
        return out[:k]

    def _capture(self, b: int, span: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Warm up on a side stream, then capture one pass of ``b`` rows over ``span`` slots (static buffers)."""
        saved = (self.slots[:b].clone(), self.mask[:b, :span].clone(), self.tokens[:b].clone(), self.pos[:b].clone())
        self._pad_rows(0, b, span)  # warm-up writes go to the scratch slot only
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._run(b, span)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run(b, span)
        self.slots[:b], self.mask[:b, :span], self.tokens[:b], self.pos[:b] = saved
        log.debug("captured draft graph for %d rows over %d slots", b, span)
        return graph, out
