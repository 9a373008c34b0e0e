"""The one generation worker: a thread that owns the engine, a bounded queue of jobs, cancellation.

The engine runs one generation at a time and ``engine.stream`` is synchronous, heavy torch work, so it runs in
ONE worker thread, never on the event loop. A :class:`Job` carries the token ids and settings in, and text
pieces out through an ``asyncio.Queue`` fed with ``loop.call_soon_threadsafe`` (the event loop never blocks).

Events a job's queue receives, in order: ``("text", str)`` any number of times, then exactly one of
``("done", Outcome)``, ``("cancelled", None)`` or ``("error", Exception)``. A job that asked for log-probs also
receives ``("logprobs", list[TokenLogprob])`` before each text piece and before ``done``: the tokens committed
since the last such event (end-of-sequence ids left out).

:func:`prepare` turns a request into what the engine runs (in a thread, before the job is queued): the prompt ids
(messages through the chat template, with the tools when given), the decoding constraint (``response_format``, or
the grammar of a forced tool call) checked to compile, and the tool-call format the answer is parsed in.

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
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from specexec.config import ChainConfig, SamplingConfig, TreeConfig
from specexec.decoding.constraint import Constraint, ConstraintError
from specexec.decoding.text import render_chat
from specexec.errors import SpecexecError
from specexec.model.kv_cache import common_prefix
from specexec.server import tools as tl
from specexec.server.protocol import ApiError, GenRequest, TokenLogprob

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
    with the model's template (for plain messages: the same ids as ``specexec generate --chat`` for one user
    message); with tools or tool messages, the template renders those too (tools only where it uses them).
    """
    tok = engine.tokenizer.tokenizer
    if req.kind == "chat":
        assert req.messages is not None
        if not getattr(tok, "chat_template", None):
            raise ApiError(
                400, "this model's tokenizer has no chat template; use /v1/completions", "messages", "no_chat_template"
            )
        try:
            if req.plain_messages:
                ids = render_chat(tok, [{"role": m["role"], "content": m["content"]} for m in req.messages])
            else:
                ids = _render_with_tools(tok, req)
        except ApiError:
            raise
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


def _render_with_tools(tok: Any, req: GenRequest) -> list[int]:
    """Messages with tool calls / tool answers, and the tools, through the chat template (as
    ``apply_chat_template(messages, tools=...)`` renders and tokenizes them); 400 naming ``tools`` when the
    template ignores the tools."""
    msgs = [dict(m) for m in req.messages or ()]
    specs = [t.spec for t in req.tools] or None
    text = tok.apply_chat_template(msgs, tools=specs, add_generation_prompt=True, tokenize=False)
    if specs and text == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False):
        raise ApiError(
            400,
            "this model's chat template does not render tools, so the model cannot be told about them; "
            "send the request without 'tools'",
            "tools",
        )
    return [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]


@dataclass(frozen=True)
class Prepared:
    """What a request runs with: prompt ids, the decoding constraint (None: free) and the request field it came
    from, and the tool-call format to parse the answer in (None: the answer is all content)."""

    ids: list[int]
    constraint: Constraint | None = None
    constraint_param: str | None = None
    tool_format: str | None = None


def prepare(engine: Any, req: GenRequest) -> Prepared:
    """Encode the request and build its constraint, checked to compile (ApiError 400 naming the field if not).

    ``tool_choice`` "required" or a named function decodes under the grammar of :func:`tools.forced_grammar` in
    the format the model's template uses (400 when it uses none this server knows); otherwise a JSON
    ``response_format`` constrains the answer (with ``tool_choice`` "auto" the model then cannot call a tool).
    Each tool's parameters schema must compile too.
    """
    tok = engine.tokenizer.tokenizer
    choice = req.tool_choice
    fmt = tl.tool_format(tl.template_text(tok)) if req.tools else None
    if req.response_format is None and not req.tools:
        return Prepared(encode(engine, req))

    def checked(make: Callable[[], Constraint], param: str, what: str) -> Constraint:
        try:
            c = make()
            c.check()
        except ConstraintError as e:
            raise ApiError(400, f"{what}: {e}", param) from None
        return c

    # the constraints first: the chat template renders the tools' schemas, and it can take none that is refused here
    for i, t in enumerate(req.tools):
        checked(lambda: Constraint.json_schema(t.parameters), "tools", f"tools[{i}].function.parameters cannot be used")
    parse = fmt if choice is not None and choice.mode != "none" else None
    if choice is not None and choice.forced:
        if fmt is None:
            raise ApiError(
                400,
                "this model's chat template uses no tool-call format this server knows (Qwen/Hermes <tool_call>, "
                "Llama 3 JSON, Mistral [TOOL_CALLS]), so a call cannot be forced; use tool_choice 'auto'",
                "tool_choice",
            )
        added = tok.get_added_vocab() if hasattr(tok, "get_added_vocab") else {}
        grammar = tl.forced_grammar(fmt, req.tools, choice.name, req.parallel_tool_calls, added.get)
        c = checked(lambda: Constraint.grammar(grammar), "tools", "the tools' grammar cannot be used")
        return Prepared(encode(engine, req), c, "tools", parse)
    rf = req.response_format
    if rf is None:
        return Prepared(encode(engine, req), None, None, parse)
    schema = rf.schema
    c = checked(
        lambda: Constraint.json() if schema is None else Constraint.json_schema(schema),
        "response_format",
        "response_format.json_schema.schema cannot be used",
    )
    return Prepared(encode(engine, req), c, "response_format", parse)


class TokenTexts:
    """Token id → (text, bytes) for log-probs: a token's own bytes (byte-level BPE pieces mapped back to bytes,
    sentencepiece's ``▁`` as a space and ``<0xNN>`` as that byte); its text shows invalid UTF-8 as ``\\xNN``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i) for i in added}
        self._inv: dict[str, int] = {}
        if self.byte_level:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._inv = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, tid: int) -> tuple[str, bytes]:
        got = self._cache.get(tid)
        if got is None:
            got = self._cache[tid] = self._text(tid)
        return got

    def _text(self, tid: int) -> tuple[str, bytes]:
        piece = self.tok.convert_ids_to_tokens(tid)
        if not isinstance(piece, str):
            raw = self.tok.decode([tid]).encode("utf-8")
        elif tid in self.added:
            raw = piece.encode("utf-8")
        elif self.byte_level and all(c in self._inv for c in piece):
            raw = bytes(self._inv[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            raw = bytes([int(piece[3:5], 16)])
        else:
            raw = piece.replace("\u2581", " ").encode("utf-8")
        return raw.decode("utf-8", errors="backslashreplace"), raw

    def entries(self, logprobs: Any, skip: frozenset[int] = frozenset()) -> list[TokenLogprob]:
        """The engine's token log-probs (``token``, ``logprob``, ``top``) with their texts; ``skip`` ids left out."""
        out = []
        for lp in logprobs:
            if int(lp.token) in skip:
                continue
            text, raw = self(int(lp.token))
            top = tuple((*self(int(t)), float(v)) for t, v in lp.top)
            out.append(TokenLogprob(text, raw, float(lp.logprob), top))
        return out


class Job:
    """One request's generation. Create it on the event loop; read ``events`` there.

    ``constraint``: the engine's decoding constraint (None: free), ``constraint_param`` the request field it came
    from (named by a 400 if the engine cannot compile it); ``logprobs``: None, or the alternatives per token."""

    def __init__(
        self,
        ids: list[int],
        max_new: int,
        sampling: SamplingConfig,
        stops: tuple[str, ...],
        constraint: Constraint | None = None,
        constraint_param: str | None = None,
        logprobs: int | None = None,
    ) -> None:
        self.ids, self.max_new, self.sampling, self.stops = ids, max_new, sampling, stops
        self.constraint, self.constraint_param, self.logprobs = constraint, constraint_param, logprobs
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
    """The thread that runs the engine: ``parallel`` jobs at once (each in a lane thread of its own, their passes
    packed into joint passes, :meth:`Engine.lanes`; 1: the engine itself, one job at a time). ``max_waiting`` jobs
    may wait while ``parallel`` run; more → 429."""

    def __init__(
        self,
        engine: Any,
        max_waiting: int,
        method: str | None = None,
        tree: TreeConfig | None = None,
        chain: ChainConfig | None = None,
        parallel: int = 1,
    ) -> None:
        if max_waiting < 0:
            raise ValueError(f"queue must be >= 0, got {max_waiting}")
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.engine, self.max_waiting, self.parallel = engine, max_waiting, parallel
        self.method, self.tree, self.chain = method, tree, chain
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # waiting + running
        self.active: set[Job] = set()
        # the lanes' engines and which are free; their stream() setups (prefix cache, policies) run one at a time
        self._lanes: list[Any] = engine.lanes(parallel, tree, chain) if parallel > 1 else [engine]
        self._free = list(range(len(self._lanes)))
        self._lane_free = threading.Condition(self._lock)
        self._setup = threading.Lock()
        self.completed = 0
        self.cancelled = 0
        self.last: Job | None = None  # the last job the worker finished (tests inspect it)
        self._texts: TokenTexts | None = None  # token texts for log-probs (built at the first request for them)
        self._thread = threading.Thread(target=self._run, name="specexec-worker", daemon=True)
        self._thread.start()

    # -- the event-loop side ------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        with self._lock:
            return self._pending - len(self.active)

    @property
    def active_count(self) -> int:
        """Jobs generating now."""
        with self._lock:
            return len(self.active)

    @property
    def packed_passes(self) -> int:
        """Passes that ran in a joint pass beside another request's."""
        joint = getattr(self._lanes[0], "joint", None)
        return joint.packed if joint is not None else 0

    @property
    def busy(self) -> bool:
        return bool(self.active)

    @property
    def running(self) -> Job | None:
        """A running job (None: none runs)."""
        with self._lock:
            return next(iter(self.active), None)

    def check_room(self) -> None:
        """Raise ApiError 429 when ``max_waiting`` jobs already wait behind ``parallel`` running ones."""
        if self._pending >= self.parallel + self.max_waiting:
            runs = "one generation runs" if self.parallel == 1 else f"{self.parallel} generations run"
            raise ApiError(
                429,
                f"the server is busy: {runs} and {self.max_waiting} wait; retry shortly",
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
        with self._lock:
            for j in self.active:
                j.cancelled.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- the worker thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                while not self._free:
                    self._lane_free.wait()
                if job.state != "waiting":
                    continue  # withdrawn while waiting
                job.state = "running"
                self.active.add(job)
                lane = self._pick(job)
            if self.parallel == 1:
                self._job(job, lane)
            else:
                threading.Thread(target=self._job, args=(job, lane), name=f"specexec-lane-{lane}", daemon=True).start()

    def _pick(self, job: Job) -> int:
        """A free lane for ``job`` (holding the lock): the one whose committed sequence shares most of its prompt."""
        best = max(self._free, key=lambda i: common_prefix(getattr(self._lanes[i], "seq", ()), job.ids))
        self._free.remove(best)
        return best

    def _job(self, job: Job, lane: int) -> None:
        try:
            try:
                self._generate(job, self._lanes[lane])
            except ApiError as e:
                log.warning("generation refused: %s", e.message)
                job.emit("error", e)
            except (SpecexecError, ValueError) as e:
                log.warning("generation refused: %s", e)
                job.emit("error", e)
            except Exception as e:  # noqa: BLE001 - keep serving; the client gets a 500 envelope
                log.exception("generation failed")
                job.emit("error", e)
        finally:
            with self._lock:
                job.state = "done"
                self.active.discard(job)
                self._pending -= 1
                self.last = job
                self._free.append(lane)
                self._lane_free.notify()

    def _generate(self, job: Job, eng: Any) -> None:
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        if job.constraint is not None:
            extra["constraint"] = job.constraint
        if job.logprobs is not None:
            extra["logprobs"] = job.logprobs
        try:
            with self._setup:
                g = eng.stream(
                    job.ids,
                    job.max_new,
                    method=self.method,
                    sampling_cfg=job.sampling,
                    tree=self.tree,
                    chain=self.chain,
                    stop=job.stops,
                    **extra,
                )
        except ConstraintError as e:
            if job.constraint is None:
                raise
            msg = f"{job.constraint_param} cannot be used with this model: {e}"
            raise ApiError(400, msg, job.constraint_param) from None
        sent = 0  # tokens whose log-probs were sent
        try:
            joint = getattr(eng, "joint", None)
            with joint.lane() if joint is not None else nullcontext():
                for piece in g:  # one piece per decode step (a step whose text is held back yields none)
                    if job.cancelled.is_set():
                        break
                    if job.logprobs is not None:
                        sent = self._send_logprobs(job, g.logprobs, sent, len(g.tokens))
                    job.emit("text", piece)
        except ConstraintError as e:  # the grammar failed part-way (a limit hit): an error event ends the answer
            if job.constraint is None:
                raise
            raise ApiError(400, f"{job.constraint_param}: {e}", job.constraint_param) from None
        finally:
            g.close()  # a safe cancel between pieces; a no-op once the generation has ended
            if (
                getattr(eng, "joint", None) is not None
            ):  # another lane may get this conversation next: keep it in the prefix cache
                with self._setup:
                    eng.save_live()
        result = g.result
        assert result is not None
        job.generated = len(result.tokens)
        if job.logprobs is not None and not job.cancelled.is_set():
            self._send_logprobs(job, result.logprobs, sent, len(result.tokens))
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

    def _send_logprobs(self, job: Job, logprobs: Any, sent: int, committed: int) -> int:
        """Emit the log-probs of tokens ``sent..committed`` (EOS left out); return the new count sent."""
        if logprobs is None or committed <= sent:
            return sent
        if self._texts is None:
            self._texts = TokenTexts(self.engine.tokenizer.tokenizer)
        eos = frozenset(int(i) for i in getattr(self.engine.tokenizer, "eos_ids", ()))
        job.emit("logprobs", self._texts.entries(logprobs[sent:committed], eos))
        return committed


def stats_ext(stats: Any, wall_s: float) -> dict[str, Any]:
    """The ``specexec`` extension object: method, budget, tokens/step, tokens/s, prefill tokens (and restored ones),
    steps, and the tokens a constraint forced."""
    return {
        "method": stats.method,
        "budget": stats.budget.json() if stats.budget is not None else None,
        "budget_auto": bool(stats.budget_auto),
        "gamma": stats.gamma,
        "steps": int(stats.steps),
        "new_tokens": int(stats.new_tokens),
        "tokens_per_step": round(float(stats.tokens_per_step), 4),
        "tokens_per_s": round(float(stats.tokens_per_s), 3),
        "prefill_tokens": int(stats.prefill_tokens),
        # of the cached prompt tokens: those restored from the prefix cache's snapshot of another conversation
        "restored_tokens": int(getattr(stats, "restored_tokens", 0)),
        "forced_tokens": int(getattr(stats, "forced_tokens", 0)),  # constrained: tokens the grammar wrote itself
        "wall_s": round(wall_s, 4),
    }
