"""The offload streamer: a :class:`~specexec.model.transformer.LayerProvider` that copies layers into a GPU ring just
in time.

Layers under the VRAM budget stay resident (one device buffer each, never streamed). The others are streamed, in
order, through a ring of ``ring_size`` preallocated device buffers of one layer each. Streamed layers form an
endless sequence of *positions* (position p = the (p mod m)-th streamed layer, ring slot p mod ring_size) that
runs on across forwards, so the first layers of the next forward already stream while the caller does other work
(e.g. the draft grows its tree) between two target passes.

Synchronisation, all asynchronous (no per-layer synchronize, no allocation, no empty_cache in the loop):

* copy of position p, on a dedicated copy stream: waits ``free[slot]`` (the compute stream finished position
  p - ring_size in that slot), copies, records ``ready[slot]``;
* ``layer(i)``: the compute stream waits ``ready[slot]``, the model gets the slot's prebuilt weight views;
* ``done(i)``: records ``free[slot]`` on the compute stream, then issues the copy of position p + lookahead + 1.

While position p computes, positions p+1 .. p+lookahead are in flight (ring_size >= lookahead + 1). Pinned RAM
layers are copied straight from their host buffer by the calling thread (an async DMA). Staged layers (SSD tier,
or RAM that could not be pinned) go through one stager thread per streamer: chunks are filled into a small ring
of pinned staging buffers by reader threads (large sequential reads, in parallel) and copied to the ring slot on
the copy stream; ``layer(i)`` waits for that job's enqueueing (a CPU future) before the GPU wait.

On the CPU (tests) the very same code runs: streams and events are no-ops and copies are plain synchronous copies,
which is correct because a CPU op has finished when the next line runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from offload.layout import LayerLayout
from offload.packing import layer_weights, max_linear_numel
from offload.store import HostBuffer
from specexec.formats.nf4 import DequantScratch

if TYPE_CHECKING:
    from offload.plan import Plan

log = logging.getLogger(__name__)


class HostStore(Protocol):
    """What the streamer needs from a host tier (see :mod:`offload.store`)."""

    layout: LayerLayout
    chunk_bytes: int

    def source(self, i: int) -> Tensor | None: ...

    def fill(self, i: int, chunk: int, dst: Tensor) -> None: ...

    def close(self) -> None: ...


class _NullEvent:
    """A CUDA event stand-in on the CPU: every op has completed when it returns."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NullStream:
    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass
class StreamStats:
    """Counters of one streamer (bytes are exact buffer sizes)."""

    layers_resident: int
    layers_streamed: int
    layer_bytes: int  # one packed layer
    forwards: int = 0
    bytes_last_forward: int = 0  # streamed into the ring during the last forward (consumed by it)
    bytes_total: int = 0

    @property
    def bytes_per_forward(self) -> int:
        """Bytes one full forward streams (streamed layers x layer bytes)."""
        return self.layers_streamed * self.layer_bytes


class StreamedLayers:
    """Resident layers plus a ring of streamed ones; implements the LayerProvider protocol."""

    def __init__(
        self,
        layout: LayerLayout,
        num_layers: int,
        device: torch.device,
        resident: Mapping[int, Tensor],
        store: HostStore | None,
        lookahead: int = 1,
        ring_size: int | None = None,
        staging_buffers: int = 4,
        readers: int = 4,
        plan: Plan | None = None,
    ) -> None:
        """``resident``: layer index -> packed uint8 device buffer; every other layer is streamed from ``store``.

        ``lookahead`` >= 1 layers are prefetched while one computes; ``ring_size`` (default lookahead + 1)
        device buffers of ``layout.nbytes`` each are allocated here, once.
        """
        ring_size = lookahead + 1 if ring_size is None else ring_size
        if lookahead < 1 or ring_size < max(2, lookahead + 1):
            raise ValueError(
                f"need lookahead >= 1 and ring_size >= max(2, lookahead + 1), "
                f"got lookahead={lookahead} ring_size={ring_size}"
            )
        self.num_layers = num_layers
        self.layout = layout
        self.device = device
        self.plan = plan
        self.store = store
        self.lookahead = lookahead
        self._cuda = device.type == "cuda"
        self._streamed = [i for i in range(num_layers) if i not in resident]
        if self._streamed and store is None:
            raise ValueError("layers to stream but no host store")
        nf4_cuda = layout.fmt.kind == "nf4" and self._cuda
        self._scratch = DequantScratch(max_linear_numel(layout), layout.fmt.dtype, device) if nf4_cuda else None
        self._resident = {i: layer_weights(layout, buf, self._scratch) for i, buf in resident.items()}
        self._resident_bufs = dict(resident)  # keep the buffers alive
        self.stats = StreamStats(len(resident), len(self._streamed), layout.nbytes)

        R = ring_size if self._streamed else 0
        self._ring = [torch.empty(layout.nbytes, dtype=torch.uint8, device=device) for _ in range(R)]
        self._ring_weights = [layer_weights(layout, b, self._scratch) for b in self._ring]
        self._copy = torch.cuda.Stream(device) if self._cuda else _NullStream()
        self._ready = [self._event() for _ in range(R)]
        self._free = [self._event() for _ in range(R)]
        self._next = 0  # next position to compute
        self._issued = 0  # next position to issue a copy for
        self._jobs: dict[int, Future[None]] = {}  # staged positions in flight
        self._failed = False  # a staged copy raised: its slot holds no valid layer, restart at the next begin()

        staged = [i for i in self._streamed if store is not None and store.source(i) is None]
        self._stager: ThreadPoolExecutor | None = None
        if staged:
            assert store is not None
            n = min(store.chunk_bytes, layout.nbytes)
            self._staging = [HostBuffer(n, pin=self._cuda) for _ in range(staging_buffers)]
            self._staged = [self._event() for _ in range(staging_buffers)]
            self._stage_count = 0
            self._stager = ThreadPoolExecutor(1, thread_name_prefix="offload-stager")
            self._readers = ThreadPoolExecutor(readers, thread_name_prefix="offload-reader")
            log.info(
                "%d streamed layers are staged through %d pinned %.0f MB buffers", len(staged), staging_buffers, n / 1e6
            )

    # -- LayerProvider ---------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start of a forward: make sure the first streamed positions are in flight."""
        m = len(self._streamed)
        self.stats.forwards += 1
        self.stats.bytes_last_forward = 0
        if not m:
            return
        if self._next % m or self._failed:  # the previous forward stopped part-way (an exception): restart
            self._drain()
        while self._issued <= self._next + self.lookahead:
            self._issue(self._issued)

    def layer(self, i: int) -> Mapping[str, Any]:
        """Layer i's weights, usable by work enqueued on the current stream from now on."""
        w = self._resident.get(i)
        if w is not None:
            return w
        p = self._next
        expect = self._streamed[p % len(self._streamed)]
        if i != expect:
            raise RuntimeError(f"streamed layers must be asked for in order: expected layer {expect}, got {i}")
        job = self._jobs.pop(p, None)
        if job is not None:
            try:
                job.result()  # the staged copy has been enqueued on the copy stream (or its error is raised here)
            except BaseException:
                self._failed = True
                raise
        slot = p % len(self._ring)
        self._current_stream().wait_event(self._ready[slot])
        self.stats.bytes_last_forward += self.layout.nbytes
        self.stats.bytes_total += self.layout.nbytes
        return self._ring_weights[slot]

    def done(self, i: int) -> None:
        """Layer i's compute is enqueued: free its slot once the GPU gets there, prefetch the next position."""
        if i in self._resident:
            return
        p = self._next
        self._free[p % len(self._ring)].record(self._current_stream())
        self._next = p + 1
        while self._issued <= p + self.lookahead + 1:
            self._issue(self._issued)

    # -- internals --------------------------------------------------------------------------------------------
    def _event(self) -> Any:
        return torch.cuda.Event() if self._cuda else _NullEvent()

    def _current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self._cuda else _NullStream()

    @contextlib.contextmanager
    def _on_copy_stream(self) -> Iterator[None]:
        with torch.inference_mode():
            if self._cuda:
                with torch.cuda.device(self.device), torch.cuda.stream(self._copy):  # type: ignore[arg-type]
                    yield
            else:
                yield

    def _issue(self, p: int) -> None:
        """Start the copy of position p into its ring slot (after that slot's previous compute)."""
        assert self.store is not None
        i = self._streamed[p % len(self._streamed)]
        slot = p % len(self._ring)
        src = self.store.source(i)
        if src is None:
            assert self._stager is not None
            self._jobs[p] = self._stager.submit(self._stage, i, slot)
        else:
            with self._on_copy_stream():
                self._copy.wait_event(self._free[slot])
                self._ring[slot].copy_(src, non_blocking=True)
                self._ready[slot].record(self._copy)
        self._issued = p + 1

    def _stage(self, i: int, slot: int) -> None:
        """Stager thread: read layer i chunk by chunk into pinned staging buffers, copy each into ring ``slot``."""
        assert self.store is not None
        cb, n = self.store.chunk_bytes, self.layout.nbytes
        depth = len(self._staging)
        pending: deque[tuple[int, int, Future[None]]] = deque()
        waited = False
        with self._on_copy_stream():
            try:
                for c in range(-(-n // cb)):
                    s = self._stage_count % depth
                    self._stage_count += 1
                    self._staged[s].synchronize()  # the previous copy out of staging buffer s has finished
                    length = min(cb, n - c * cb)
                    dst = self._staging[s].tensor[:length]
                    pending.append((c, s, self._readers.submit(self.store.fill, i, c, dst)))
                    if len(pending) == depth:
                        waited = self._h2d(*pending.popleft(), slot, waited)
                while pending:
                    waited = self._h2d(*pending.popleft(), slot, waited)
                self._ready[slot].record(self._copy)
            finally:  # on error, let in-flight reads finish before their buffers are reused
                for _, _, fut in pending:
                    fut.exception()

    def _h2d(self, c: int, s: int, fut: Future[None], slot: int, waited: bool) -> bool:
        fut.result()
        if not waited:
            self._copy.wait_event(self._free[slot])
        cb = self.store.chunk_bytes  # type: ignore[union-attr]
        src = self._staging[s].tensor[: min(cb, self.layout.nbytes - c * cb)]
        self._ring[slot][c * cb : c * cb + src.numel()].copy_(src, non_blocking=True)
        self._staged[s].record(self._copy)
        return True

    def _drain(self) -> None:
        """Wait for every copy in flight and restart the position sequence (after an aborted forward)."""
        for job in self._jobs.values():
            job.exception()
        self._jobs.clear()
        self._copy.synchronize()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._next = self._issued = 0
        self._failed = False

    def close(self) -> None:
        """Stop worker threads and unpin host memory (the streamer is unusable afterwards)."""
        if self._stager is not None:
            self._stager.shutdown(wait=True)
            self._readers.shutdown(wait=True)
            for b in self._staging:
                b.close()
        if self.store is not None:
            self.store.close()
