"""The OpenAI wire format: request validation (body → :class:`GenRequest`) and response/chunk shapes.

Pure functions, no I/O: the app (``app.py``) feeds them parsed JSON and sends what they return. Everything a
client can get wrong raises :class:`ApiError`, which the app turns into OpenAI's error envelope
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (never a 500 for a client's mistake).
Unknown fields are ignored, as OpenAI does; known fields this server cannot honour (``n`` other than 1, several
prompts, ``logprobs``, ``echo``, ``best_of`` > 1, ``suffix``, non-text message parts) are refused.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specexec.config import SamplingConfig

MAX_STOPS = 16  # OpenAI allows 4; a few more cost nothing here
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` plus the fields of OpenAI's error envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True)
class Defaults:
    """What a request gets for the fields it leaves out (from the ``serve`` command's options)."""

    max_new_tokens: int = 512
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class GenRequest:
    """One validated generation request. ``messages`` (chat) or ``prompt`` (completions) is set, not both.

    ``max_tokens`` is None when the client gave none (the server's default, capped by the room left in the
    context, applies once the prompt length is known).
    """

    kind: str  # "chat" or "completion"
    messages: tuple[tuple[str, str], ...] | None
    prompt: str | tuple[int, ...] | None
    max_tokens: int | None
    sampling: SamplingConfig
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None


# ---------------------------------------------------------------------------------------------- validation


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()


def _opt_number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be a finite number, got {v!r}", name, "invalid_type")
    bad = v <= lo if lo_open else v < lo
    if bad or v > hi:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be in {rng}, got {v}", name, "invalid_value")
    return float(v)


def _opt_int(body: dict, name: str, lo: int, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise ApiError(400, f"'{name}' must be an integer, got {v!r}", name, "invalid_type")
    if v < lo:
        raise ApiError(400, f"'{name}' must be >= {lo}, got {int(v)}", name, "invalid_value")
    return int(v)


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(v) > MAX_STOPS:
        raise ApiError(400, f"'stop' has {len(v)} strings; at most {MAX_STOPS}", "stop", "invalid_value")
    return tuple(dict.fromkeys(s for s in v if s))  # empty strings never match; keep order, drop repeats


def _common(body: Any, defaults: Defaults) -> dict[str, Any]:
    """The fields chat and completions share."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_body")
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"only n=1 is supported (one answer per request), got n={n!r}", "n", "unsupported")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise ApiError(400, "logprobs are not supported by this server", "logprobs", "unsupported")
    s = defaults.sampling
    temperature = _opt_number(body, "temperature", 0.0, 2.0, s.temperature)
    top_p = _opt_number(body, "top_p", 0.0, 1.0, s.top_p, lo_open=True)
    min_p = _opt_number(body, "min_p", 0.0, 1.0, s.min_p)
    if min_p >= 1.0:
        raise ApiError(400, f"'min_p' must be in [0, 1), got {min_p}", "min_p", "invalid_value")
    top_k = _opt_int(body, "top_k", 0, s.top_k)
    seed = body.get("seed", s.seed)
    if seed is not None and not _is_int(seed):
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}", "seed", "invalid_type")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise ApiError(400, f"'seed' must fit in 64 bits, got {seed}", "seed", "invalid_value")
    sampling = SamplingConfig(
        temperature=temperature,
        top_k=int(top_k or 0),
        top_p=top_p,
        min_p=min_p,
        seed=None if seed is None else int(seed),
    )
    mt = _opt_int(body, "max_completion_tokens", 1, None)
    if mt is None:
        mt = _opt_int(body, "max_tokens", 1, None)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream!r}", "stream", "invalid_type")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
    model = body.get("model")
    return dict(
        max_tokens=mt,
        sampling=sampling,
        stops=_stops(body),
        stream=stream,
        include_usage=bool(stream and opts.get("include_usage")),
        model=model if isinstance(model, str) else None,
    )


def _content(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (other part types are refused)."""
    param = f"messages[{i}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"only text content parts are supported, got {kind!r}", param, "unsupported")
            out.append(part["text"])
        return "".join(out)
    raise ApiError(400, "message content must be a string or a list of text parts", param, "invalid_type")


def parse_chat(body: Any, defaults: Defaults) -> GenRequest:
    """A ``/v1/chat/completions`` body → GenRequest (raises ApiError)."""
    common = _common(body, defaults)
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages", "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role must be one of system, developer, user, assistant; got {role!r}",
                f"messages[{i}].role",
                "invalid_value",
            )
        out.append((ROLES[role], _content(m.get("content"), i)))
    return GenRequest(kind="chat", messages=tuple(out), prompt=None, **common)


def parse_completion(body: Any, defaults: Defaults) -> GenRequest:
    """A ``/v1/completions`` body → GenRequest (raises ApiError). ``prompt``: a string or token ids (one)."""
    common = _common(body, defaults)
    if body.get("echo"):
        raise ApiError(400, "echo is not supported by this server", "echo", "unsupported")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "only best_of=1 is supported", "best_of", "unsupported")
    if body.get("suffix"):
        raise ApiError(400, "suffix (insertion) is not supported by this server", "suffix", "unsupported")
    p = body.get("prompt")
    if p is None:
        raise ApiError(400, "'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        prompt: str | tuple[int, ...] = tuple(int(t) for t in p)
    elif isinstance(p, str):
        prompt = p
    elif isinstance(p, list) and len(p) > 1:
        raise ApiError(400, "only one prompt per request is supported", "prompt", "unsupported")
    else:
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", "prompt", "invalid_value")
    if not prompt:
        raise ApiError(400, "'prompt' is empty", "prompt", "invalid_value")
    return GenRequest(kind="completion", messages=None, prompt=prompt, **common)


def resolve_max_tokens(req: GenRequest, prompt_len: int, context: int, default: int) -> int:
    """The answer limit: the client's (refused if prompt + it exceed the context) or the default, capped."""
    room = context - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens but the context holds {context} (prompt + answer)",
            "messages" if req.kind == "chat" else "prompt",
            "context_length_exceeded",
        )
    if req.max_tokens is None:
        return min(default, room)
    if req.max_tokens > room:
        name = "max_tokens"
        raise ApiError(
            400,
            f"the prompt ({prompt_len} tokens) + max_tokens ({req.max_tokens}) exceed the context "
            f"({context} tokens); at most {room} new tokens fit",
            name,
            "context_length_exceeded",
        )
    return req.max_tokens


# ---------------------------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(
    kind: str, rid: str, model: str, text: str, finish: str, use: dict[str, int], ext: dict[str, Any]
) -> dict[str, Any]:
    """A whole (non-streamed) chat.completion / text_completion object, with the ``specexec`` extension."""
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
        "specexec": ext,
    }


class Chunks:
    """The streamed chunks of one answer (same id/created/model on each), as dicts ready for ``data:`` lines."""

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool) -> None:
        self.kind, self.rid, self.model, self.include_usage = kind, rid, model, include_usage
        self.created = int(time.time())

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        d = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            d["usage"] = None
        d.update(extra)
        return d

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def first(self) -> dict[str, Any] | None:
        """Chat: the role chunk (empty content). Completions have none."""
        return self._chunk([self._choice("", None, role=True)]) if self.kind == "chat" else None

    def text(self, piece: str) -> dict[str, Any]:
        return self._chunk([self._choice(piece, None)])

    def last(self, finish: str, ext: dict[str, Any]) -> dict[str, Any]:
        return self._chunk([self._choice(None, finish)], specexec=ext)

    def usage(self, use: dict[str, int]) -> dict[str, Any]:
        d = self._chunk([])
        d["usage"] = use
        return d
