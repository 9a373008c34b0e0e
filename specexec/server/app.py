"""The HTTP layer: a FastAPI app with OpenAI's endpoints, the web page, auth, a body limit and SSE streaming.

``create_app(config, engine=...)`` serves a loaded engine; ``create_app(config, loader=...)`` answers ``/health``
with 503 while ``loader()`` runs in a thread, then serves what it returned. All engine work happens in the one
:class:`~specexec.server.worker.Worker` thread; handlers only parse, enqueue and relay events, so ``/health`` and
``/v1/models`` answer while a generation runs. Tokenizing a prompt runs in a thread too (``asyncio.to_thread``).

Errors: :class:`~specexec.server.protocol.ApiError` (4xx), unknown routes (404/405), a body over the limit (413)
and anything unexpected (500) all answer with OpenAI's envelope ``{"error": {"message", "type", "param",
"code"}}``. A generation that fails after a stream has started sends one ``data: {"error": ...}`` event, then
``data: [DONE]``.

An answer to a request with tools passes through :class:`~specexec.server.tools.ToolParser`: its tool calls come
back as ``message.tool_calls`` (streamed: ``delta.tool_calls``, the name first, then argument fragments), the rest
as content. Log-probs ride on the chunks (streamed) or the choice (whole).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specexec.config import ChainConfig, TreeConfig
from specexec.errors import SpecexecError, render
from specexec.server import protocol as p
from specexec.server import tools as tl
from specexec.server.worker import Job, Outcome, Prepared, Worker, prepare

log = logging.getLogger(__name__)

# library setting names (specexec.errors.setting) -> the request field a client sets
API_NAMES = {
    "max_new_tokens": "max_tokens",
    "SamplingConfig.temperature": "temperature",
    "SamplingConfig.top_p": "top_p",
    "SamplingConfig.top_k": "top_k",
    "SamplingConfig.min_p": "min_p",
    "SamplingConfig.seed": "seed",
    "context": "the server's context",
    "prompt": "prompt",
}


@dataclass(frozen=True)
class ServerConfig:
    """How the server behaves (the model and decoding settings live in the engine / ``defaults``)."""

    model_name: str = "specexec"
    api_key: str | None = None
    queue: int = 8  # requests that may wait while one generates; more get 429
    max_body_bytes: int = 4 * 1024 * 1024
    defaults: p.Defaults = field(default_factory=p.Defaults)
    method: str | None = None  # None: specexec with a draft, else ar
    tree: TreeConfig | None = None
    chain: ChainConfig | None = None
    parallel: int | None = None  # requests generated together (None: as many as the memory plan admits)

    def __post_init__(self) -> None:
        if self.queue < 0:
            raise ValueError(f"queue must be >= 0, got {self.queue}")
        if self.parallel is not None and self.parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {self.parallel}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.model_name.strip():
            raise ValueError("served-model-name must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api-key must not be empty")


class _State:
    """What the handlers share: the worker once the engine is loaded, or the loading error."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.engine: Any = None
        self.error: str | None = None
        self.created = int(time.time())


# the files under static/vendor/ the app serves, with their content types
VENDOR_FILES = {
    "marked.umd.js": "text/javascript; charset=utf-8",
    "purify.min.js": "text/javascript; charset=utf-8",
    "marked.LICENSE": "text/plain; charset=utf-8",
    "dompurify.LICENSE": "text/plain; charset=utf-8",
    "dompurify.LICENSE-MPL": "text/plain; charset=utf-8",
    "README.md": "text/plain; charset=utf-8",
}


def prefix_cache(engine: Any) -> dict[str, Any]:
    """/health's ``prefix_cache``: the engine's snapshots across conversations (entries, bytes, budget, hits),
    read without waiting for the worker; nothing for an engine without one."""
    info = getattr(engine, "prefix_cache_info", None)
    return {"prefix_cache": info()} if callable(info) else {}


def page_html() -> str:
    """The web chat page shipped in the package (static/index.html)."""
    return resources.files("specexec.server").joinpath("static/index.html").read_text(encoding="utf-8")


def create_app(
    config: ServerConfig,
    engine: Any = None,
    loader: Callable[[], Any] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The app. Give ``engine`` (ready at once) or ``loader`` (called in a thread at start-up)."""
    if (engine is None) == (loader is None):
        raise ValueError("give exactly one of engine and loader")
    state = _State()
    html = page_html()

    def ready(eng: Any) -> None:
        n = config.parallel
        if n is None:
            plan = getattr(eng, "default_parallel", None)
            n = plan(config.tree, config.chain) if callable(plan) else 1
        state.worker = Worker(eng, config.queue, method=config.method, tree=config.tree, chain=config.chain, parallel=n)
        state.engine = eng
        log.info("ready: serving %r (context %d tokens, %d requests at once)", config.model_name, eng.context, n)

    def load_in_thread() -> None:
        t0 = time.perf_counter()
        log.info("loading the model...")
        try:
            eng = loader()  # type: ignore[misc]
            log.info("loaded in %.1f s", time.perf_counter() - t0)
            ready(eng)  # the lanes' caches too: a --parallel that does not fit is a loading error
        except BaseException as e:  # noqa: BLE001 - reported through /health and on_load_error
            state.error = str(e) if isinstance(e, SpecexecError) else f"{type(e).__name__}: {e}"
            log.error("loading failed: %s", state.error)
            if on_load_error is not None:
                on_load_error(e)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            ready(engine)
        else:
            threading.Thread(target=load_in_thread, name="specexec-loader", daemon=True).start()
        yield
        if state.worker is not None:
            await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="specexec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.config = config

    # -- errors -------------------------------------------------------------------------------------------------
    @app.exception_handler(p.ApiError)
    async def _api_error(_req: Request, e: p.ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(
            p.error_body(str(e.detail), p._default_type(e.status_code), None, code),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(_req: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(p.error_body(f"internal server error: {type(e).__name__}", "server_error"), status_code=500)

    # -- pages and status ---------------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(
            html,
            headers={
                "Cache-Control": "no-cache",
                "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline';"
                " script-src 'self' 'unsafe-inline'; img-src 'self' data:",
            },
        )

    @app.get("/static/vendor/{name}", include_in_schema=False)
    async def vendor(name: str) -> Response:
        # the page's pinned third-party scripts (and their licenses), from a fixed list: nothing else is served
        media = VENDOR_FILES.get(name)
        if media is None:
            raise StarletteHTTPException(404, f"no file {name!r} here")
        data = resources.files("specexec.server").joinpath("static/vendor", name).read_bytes()
        return Response(
            data, media_type=media, headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.error is not None:
            return JSONResponse({"status": "error", "message": state.error}, status_code=503)
        if state.worker is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        w = state.worker
        return JSONResponse(
            {
                "status": "ok",
                "model": config.model_name,
                "busy": w.busy,
                "active": w.active_count,
                "waiting": w.waiting,
                "parallel": w.parallel,
                "packed_passes": w.packed_passes,
                "queue": config.queue,
                "context": state.engine.context,
                **prefix_cache(state.engine),
            }
        )

    def model_card() -> dict[str, Any]:
        return {"id": config.model_name, "object": "model", "created": state.created, "owned_by": "specexec"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != config.model_name:
            raise p.ApiError(
                404,
                f"the model {model_id!r} does not exist; this server serves {config.model_name!r}",
                "model",
                "model_not_found",
            )
        return model_card()

    # -- generation ---------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    async def _generate(request: Request, kind: str) -> Response:
        body = await _json_body(request)
        parse = p.parse_chat if kind == "chat" else p.parse_completion
        try:
            req = parse(body, config.defaults)
        except p.ApiError:
            raise
        except ValueError as e:  # a config dataclass refused a value (e.g. NaN)
            raise p.ApiError(
                400,
                _api_message(e),
                API_NAMES.get(getattr(e, "key", None) or ""),
                "invalid_value",
            ) from None
        w = state.worker
        if w is None:
            raise p.ApiError(
                503,
                "the model is still loading" if state.error is None else f"the model failed to load: {state.error}",
                None,
                "model_not_ready",
                headers={"Retry-After": "5"},
            )
        w.check_room()  # refuse early, before tokenizing, when the queue is already full
        eng = state.engine
        prep = await asyncio.to_thread(_prepare, eng, req)
        max_new = p.resolve_max_tokens(req, len(prep.ids), eng.context, config.defaults.max_new_tokens)
        job = Job(prep.ids, max_new, req.sampling, req.stops, prep.constraint, prep.constraint_param, req.logprobs)
        w.submit(job)  # raises 429 when the queue is full
        rid = p.new_id(kind)
        answer = _Answer(kind, prep.tool_format, req.logprobs is not None)
        if req.stream:
            chunks = p.Chunks(kind, rid, config.model_name, req.include_usage)
            return _SSEResponse(job, _sse_events(job, chunks, answer))
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, job))
        try:
            outcome = await _collect(job, answer)
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once done
        folded = tl.fold(answer.events)
        return JSONResponse(
            p.response(
                kind,
                rid,
                config.model_name,
                folded.content,
                answer.finish_reason(outcome),
                _usage(outcome),
                outcome.ext,
                tool_calls=folded.tool_calls,
                logprobs=answer.logprobs_object(answer.all_logprobs) if answer.want_logprobs else None,
            )
        )

    app.add_middleware(_auth, api_key=config.api_key)
    app.add_middleware(_body_limit, max_bytes=config.max_body_bytes)  # added last: the outermost
    return app


def _prepare(engine: Any, req: p.GenRequest) -> Prepared:
    try:
        return prepare(engine, req)
    except p.ApiError:
        raise
    except SpecexecError as e:
        raise p.ApiError(400, _api_message(e), None, "invalid_value") from None


class _Answer:
    """One answer as it arrives: text pieces through the tool-call parser (when the request has tools) into
    :mod:`~specexec.server.tools` events, and log-probs; both the streamed and the whole response read these."""

    def __init__(self, kind: str, tool_format: str | None, want_logprobs: bool) -> None:
        self.kind, self.want_logprobs = kind, want_logprobs
        self.parser = tl.ToolParser(tool_format) if tool_format is not None else None
        self.events: list[tl.Event] = []
        self.all_logprobs: list[p.TokenLogprob] = []
        self._completion_lp = p.CompletionLogprobs()

    def push(self, piece: str) -> list[tl.Event]:
        new: list[tl.Event] = [tl.Content(piece)] if self.parser is None else self.parser.push(piece)
        self.events.extend(new)
        return new

    def finish(self) -> list[tl.Event]:
        new = self.parser.finish() if self.parser is not None else []
        self.events.extend(new)
        return new

    def finish_reason(self, outcome: Outcome) -> str:
        """The engine's, but "tool_calls" for an answer with tool calls that ended by itself."""
        calls = self.parser is not None and self.parser.calls > 0
        return "tool_calls" if calls and outcome.finish_reason == "stop" else outcome.finish_reason

    def logprobs_object(self, entries: list[p.TokenLogprob]) -> dict[str, Any]:
        return p.chat_logprobs(entries) if self.kind == "chat" else self._completion_lp(entries)


def _api_message(e: Exception) -> str:
    return e.render(API_NAMES) if isinstance(e, SpecexecError) else render(str(e), API_NAMES)


async def _json_body(request: Request) -> Any:
    """The body parsed as JSON, whatever its Content-Type says (curl -d sends form encoding)."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise p.ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:  # nested deeper than json.loads recurses: name the field
        raise p.too_deep_body(raw.decode("utf-8", errors="replace")) from None


def _usage(o: Outcome) -> dict[str, Any]:
    use: dict[str, Any] = p.usage(o.prompt_tokens, o.completion_tokens)
    use["prompt_tokens_details"] = {"cached_tokens": o.cached_tokens}
    return use


def _engine_error(e: BaseException) -> p.ApiError:
    if isinstance(e, p.ApiError):
        return e
    if isinstance(e, (SpecexecError, ValueError)):
        return p.ApiError(400, _api_message(e), None, "invalid_value")
    return p.ApiError(500, f"the generation failed: {type(e).__name__}: {e}", None, "generation_failed")


async def _collect(job: Job, answer: _Answer) -> Outcome:
    """Wait for a non-streamed job: its whole text into ``answer``, and its outcome (raises ApiError on failure)."""
    parts: list[str] = []
    while True:
        kind, value = await job.events.get()
        if kind == "text":
            parts.append(value)
        elif kind == "logprobs":
            answer.all_logprobs.extend(value)
        elif kind == "done":
            answer.push("".join(parts))
            answer.finish()
            return value
        elif kind == "error":
            raise _engine_error(value)
        else:  # cancelled: the client is gone; this answer is never read
            raise p.ApiError(499, "the client closed the request", None, "client_closed")


async def _cancel_on_disconnect(receive: Callable[[], Any], job: Job) -> None:
    """Cancel ``job`` when the client disconnects (after its body was read, receive() waits for that)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            job.cancel()
            return


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _event_chunk(chunks: p.Chunks, e: tl.Event, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(e, tl.Content):
        return chunks.text(e.text, logprobs)
    if isinstance(e, tl.CallStart):
        return chunks.call_start(e.index, e.id, e.name, logprobs)
    return chunks.call_args(e.index, e.text, logprobs)


async def _sse_events(job: Job, chunks: p.Chunks, answer: _Answer) -> AsyncIterator[str]:
    """The server-sent events of one streamed answer: role, content / tool-call deltas, the last chunk, usage,
    [DONE]. Log-probs ride on the next chunk sent after they arrive (the last chunk takes any left)."""
    first = chunks.first()
    if first is not None:
        yield _data(first)
    pending: list[p.TokenLogprob] = []

    def take() -> dict[str, Any] | None:
        if not pending:
            return None
        obj = answer.logprobs_object(list(pending))
        pending.clear()
        return obj

    while True:
        kind, value = await job.events.get()
        if kind == "logprobs":
            pending.extend(value)
        elif kind == "text":
            for e in answer.push(value):
                yield _data(_event_chunk(chunks, e, take()))
        elif kind == "done":
            for e in answer.finish():
                yield _data(_event_chunk(chunks, e, take()))
            yield _data(chunks.last(answer.finish_reason(value), value.ext, take()))
            if chunks.include_usage:
                yield _data(chunks.usage(_usage(value)))
            break
        elif kind == "error":
            yield _data(_engine_error(value).body())
            break
        else:  # cancelled: the client is gone
            return
    yield "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """A text/event-stream response that cancels its job the moment the client disconnects.

    Starlette's StreamingResponse notices a disconnect only when a send fails (ASGI 2.4 servers) — too late for a
    job still waiting in the queue. This one watches ``receive`` for ``http.disconnect`` the whole time.
    """

    def __init__(self, job: Job, events: AsyncIterator[str]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.job, self.events = job, events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watcher = asyncio.create_task(_cancel_on_disconnect(receive, self.job))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-send
            pass
        finally:
            watcher.cancel()
            self.job.cancel()  # a no-op once done
            await self.events.aclose()  # type: ignore[attr-defined]


def _body_limit(app: Any, max_bytes: int) -> Any:
    """ASGI middleware: 413 (OpenAI envelope) for a request body over ``max_bytes``, declared or streamed."""

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        too_big = p.ApiError(413, f"the request body is larger than {max_bytes} bytes", None, "body_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return await JSONResponse(too_big.body(), status_code=413)(scope, receive, send)
        seen = 0

        async def counted_receive() -> Any:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > max_bytes:
                    raise too_big  # inside the handler's body read: the ApiError handler answers 413
            return msg

        return await app(scope, counted_receive, send)

    return middleware


def _auth(app: Any, api_key: str | None) -> Any:
    """ASGI middleware: with an API key, ``/v1/*`` needs ``Authorization: Bearer KEY`` (401 otherwise)."""
    want = (api_key or "").encode("utf-8")

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        if want and scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), want):
                err = p.ApiError(
                    401, "missing or wrong API key: send 'Authorization: Bearer KEY'", None, "invalid_api_key"
                )
                resp = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        return await app(scope, receive, send)

    return middleware
