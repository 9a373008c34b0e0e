"""The one generation worker: a thread that owns the engine, a bounded queue of jobs, cancellation.

The engine runs one generation at a time and ``engine.stream`` is synchronous, heavy torch work, so it runs in
ONE worker thread, never on the event loop. A :class:`Job` carries the token ids and settings in, and text
pieces out through an ``asyncio.Queue`` fed with ``loop.call_soon_threadsafe`` (the event loop never blocks).

Events a job's queue receives, in order: ``("text", str)`` any number of times, then exactly one of
``("done", Outcome)``, ``("cancelled", None)`` or ``("error", Exception)``.

Cancellation: :meth:`Job.cancel` (the client went away) removes a waiting job at once; a running one is closed
by the worker after the engine's next piece (one decode step). Closing the engine's generator is a safe cancel:
the engine's state only advances after whole steps, and the next request re-syncs through the prefix cache.

Stop strings and finish reasons come from the engine (``engine.stream(stop=...)``, ``Result.finish_reason``):
``stop`` (EOS or a stop string; the stop text is not returned), ``length`` (max_tokens) or ``cancelled``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specexec.config import ChainConfig, SamplingConfig, TreeConfig
from specexec.decoding.text import render_chat
from specexec.errors import SpecexecError
from specexec.server.protocol import ApiError, GenRequest

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """How a finished job ended: finish reason (``stop`` | ``length``), token counts, the ``specexec`` stats."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ext: dict[str, Any] = field(default_factory=dict)


def encode(engine: Any, req: GenRequest) -> list[int]:
    """The request's prompt as token ids: messages through the chat template, or the completion prompt.

    Completions encode exactly like ``specexec generate`` (``engine.encode``); chat renders the whole conversation
    with the model's template (for one user message: the same ids as ``specexec generate --chat``).
    """
    tok = engine.tokenizer.tokenizer
    if req.kind == "chat":
        assert req.messages is not None
        if not getattr(tok, "chat_template", None):
            raise ApiError(
                400, "this model's tokenizer has no chat template; use /v1/completions", "messages", "no_chat_template"
            )
        try:
            ids = render_chat(tok, [{"role": r, "content": c} for r, c in req.messages])
        except SpecexecError as e:
            raise ApiError(400, str(e), "messages", "invalid_value") from None
        except Exception as e:  # noqa: BLE001 - the template itself refused these messages (e.g. role order)
            raise ApiError(400, f"the chat template refused these messages: {e}", "messages", "invalid_value") from None
        return [int(t) for t in ids]
    assert req.prompt is not None
    if isinstance(req.prompt, str):
        return engine.encode(req.prompt)
    vocab = len(tok)
    if any(t < 0 or t >= vocab for t in req.prompt):
        raise ApiError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt", "invalid_value")
    return list(req.prompt)


class Job:
    """One request's generation. Create it on the event loop; read ``events`` there."""

    def __init__(self, ids: list[int], max_new: int, sampling: SamplingConfig, stops: tuple[str, ...]) -> None:
        self.ids, self.max_new, self.sampling, self.stops = ids, max_new, sampling, stops
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.state = "new"  # new -> waiting -> running -> done, or waiting -> done (withdrawn)
        self.worker: Worker | None = None
        self.generated = 0  # tokens the engine produced for this job (also when cancelled)

    def emit(self, kind: str, value: Any = None) -> None:
        """Hand an event to the event loop (callable from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            pass

    def cancel(self) -> None:
        """The client is gone: withdraw a waiting job now, stop a running one at its next step."""
        if self.state == "done" or self.cancelled.is_set():
            return
        self.cancelled.set()
        if self.worker is not None:
            self.worker._withdraw(self)


class Worker:
    """The single thread that runs the engine. ``max_waiting`` jobs may wait while one runs; more → 429."""

    def __init__(
        self,
        engine: Any,
        max_waiting: int,
        method: str | None = None,
        tree: TreeConfig | None = None,
        chain: ChainConfig | None = None,
    ) -> None:
        if max_waiting < 0:
            raise ValueError(f"queue must be >= 0, got {max_waiting}")
        self.engine, self.max_waiting = engine, max_waiting
        self.method, self.tree, self.chain = method, tree, chain
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # waiting + running
        self.running: Job | None = None
        self.completed = 0
        self.cancelled = 0
        self.last: Job | None = None  # the last job the worker finished (tests inspect it)
        self._thread = threading.Thread(target=self._run, name="specexec-worker", daemon=True)
        self._thread.start()

    # -- the event-loop side ------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        with self._lock:
            return self._pending - (1 if self.running is not None else 0)

    @property
    def busy(self) -> bool:
        return self.running is not None

    def check_room(self) -> None:
        """Raise ApiError 429 when ``max_waiting`` jobs already wait behind a running one."""
        if self._pending >= 1 + self.max_waiting:
            raise ApiError(
                429,
                f"the server is busy: one generation runs and {self.max_waiting} wait; retry shortly",
                None,
                "queue_full",
                headers={"Retry-After": "1"},
            )

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise ApiError 429 (see :meth:`check_room`)."""
        with self._lock:
            self.check_room()
            self._pending += 1
            job.state, job.worker = "waiting", self
        self._jobs.put(job)

    def _withdraw(self, job: Job) -> None:
        with self._lock:
            if job.state != "waiting":
                return  # running: the worker sees the flag after the next piece
            job.state = "done"
            self._pending -= 1
            self.cancelled += 1
        log.info("request withdrawn before it started (client disconnected)")
        job.emit("cancelled")

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job, drop the waiting ones, end the thread."""
        while True:
            try:
                j = self._jobs.get_nowait()
            except queue.Empty:
                break
            if j is not None:
                j.cancel()
        if self.running is not None:
            self.running.cancelled.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- the worker thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job.state != "waiting":
                    continue  # withdrawn while waiting
                job.state = "running"
                self.running = job
            try:
                self._generate(job)
            except (SpecexecError, ValueError) as e:
                log.warning("generation refused: %s", e)
                job.emit("error", e)
            except Exception as e:  # noqa: BLE001 - keep serving; the client gets a 500 envelope
                log.exception("generation failed")
                job.emit("error", e)
            finally:
                with self._lock:
                    job.state = "done"
                    self.running = None
                    self._pending -= 1
                    self.last = job

    def _generate(self, job: Job) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        g = eng.stream(
            job.ids,
            job.max_new,
            method=self.method,
            sampling_cfg=job.sampling,
            tree=self.tree,
            chain=self.chain,
            stop=job.stops,
        )
        try:
            for piece in g:  # one piece per decode step (a step whose text is held back yields none)
                if job.cancelled.is_set():
                    break
                job.emit("text", piece)
        finally:
            g.close()  # a safe cancel between pieces; a no-op once the generation has ended
        result = g.result
        assert result is not None
        job.generated = len(result.tokens)
        if job.cancelled.is_set() and result.finish_reason == "cancelled":
            with self._lock:
                self.cancelled += 1
            log.info("generation cancelled after %d tokens (client disconnected)", len(result.tokens))
            job.emit("cancelled")
            return
        stats = result.stats
        ext = stats_ext(stats, time.perf_counter() - t0)
        with self._lock:
            self.completed += 1
        # the last prompt token is processed by the first decode step, not by the prefill
        job.emit(
            "done",
            Outcome(
                finish_reason=result.finish_reason,
                prompt_tokens=len(job.ids),
                completion_tokens=len(result.tokens),
                cached_tokens=max(len(job.ids) - 1 - stats.prefill_tokens, 0),
                ext=ext,
            ),
        )


def stats_ext(stats: Any, wall_s: float) -> dict[str, Any]:
    """The ``specexec`` extension object: method, budget, tokens/step, tokens/s, prefill tokens, steps."""
    return {
        "method": stats.method,
        "budget": stats.budget,
        "budget_auto": bool(stats.budget_auto),
        "gamma": stats.gamma,
        "steps": int(stats.steps),
        "new_tokens": int(stats.new_tokens),
        "tokens_per_step": round(float(stats.tokens_per_step), 4),
        "tokens_per_s": round(float(stats.tokens_per_s), 3),
        "prefill_tokens": int(stats.prefill_tokens),
        "wall_s": round(wall_s, 4),
    }
