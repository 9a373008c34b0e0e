"""The OpenAI wire format: request validation (body → :class:`GenRequest`) and response/chunk shapes.

Pure functions, no I/O: the app (``app.py``) feeds them parsed JSON and sends what they return. Everything a
client can get wrong raises :class:`ApiError`, which the app turns into OpenAI's error envelope
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (never a 500 for a client's mistake).
Unknown fields are ignored, as OpenAI does; known fields this server cannot honour (``n`` other than 1, several
prompts, ``echo``, ``best_of`` > 1, ``suffix``, non-text message parts) are refused.

Structured output and tools: ``response_format`` (text, json_object, json_schema) becomes a
:class:`ResponseFormat`; ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` become
:class:`~specexec.server.tools.Tool` s and a :class:`ToolChoice`; history messages may carry ``tool_calls``
(arguments as JSON strings, turned into the objects chat templates expect) and ``role: "tool"`` answers. Which
grammar that means for the model is decided where its tokenizer is known (:func:`specexec.server.worker.prepare`).
``logprobs`` / ``top_logprobs`` become the number of alternatives per token the engine reports
(:attr:`GenRequest.logprobs`), shaped back by :func:`chat_logprobs` / :class:`CompletionLogprobs`.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specexec.config import SamplingConfig
from specexec.decoding.constraint import MAX_SCHEMA_DEPTH, json_path, too_deep, too_deep_message, value_depth
from specexec.server.tools import Tool

MAX_STOPS = 16  # OpenAI allows 4; a few more cost nothing here
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


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
class ResponseFormat:
    """``response_format`` other than text: ``kind`` "json_object" (any JSON object) or "json_schema" (``schema``)."""

    kind: str
    schema: dict[str, Any] | None = None


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice``: ``mode`` "none", "auto", "required" or "function" (then ``name`` is the function)."""

    mode: str
    name: str | None = None

    @property
    def forced(self) -> bool:
        """The answer must be tool calls (decoded under a grammar)."""
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class GenRequest:
    """One validated generation request. ``messages`` (chat) or ``prompt`` (completions) is set, not both.

    ``max_tokens`` is None when the client gave none (the server's default, capped by the room left in the
    context, applies once the prompt length is known). ``messages`` are dicts the chat template takes: ``role``
    and ``content`` (a string), plus ``tool_calls`` (arguments as objects) on assistant messages and
    ``tool_call_id`` (and ``name`` if given) on tool messages. ``logprobs``: None, or how many alternatives each
    token's log-prob comes with (0: the chosen token's alone). ``tool_choice`` is None without tools.
    """

    kind: str  # "chat" or "completion"
    messages: tuple[dict[str, Any], ...] | None
    prompt: str | tuple[int, ...] | None
    max_tokens: int | None
    sampling: SamplingConfig
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None
    response_format: ResponseFormat | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: int | None = None

    @property
    def plain_messages(self) -> bool:
        """Messages a template renders without tools: no tool calls, no tool answers (render_chat's kind)."""
        return not self.tools and all(m["role"] != "tool" and not m.get("tool_calls") for m in self.messages or ())


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
        response_format=_response_format(body),
    )


def _response_format(body: dict) -> ResponseFormat | None:
    """``response_format``: None for text (or none given)."""
    v = body.get("response_format")
    if v is None:
        return None
    name = "response_format"
    if not isinstance(v, dict):
        raise ApiError(400, "'response_format' must be an object with a 'type'", name)
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise ApiError(
            400, f"response_format.type must be one of 'text', 'json_object', 'json_schema'; got {kind!r}", name
        )
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise ApiError(400, "response_format.json_schema must be an object with 'name' and 'schema'", name)
    if not isinstance(js.get("name"), str) or not FUNCTION_NAME.fullmatch(js["name"]):
        raise ApiError(
            400,
            f"response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'; got {js.get('name')!r}",
            name,
        )
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise ApiError(400, "response_format.json_schema.strict must be true or false", name)
    schema = js.get("schema")
    if schema is None:
        return ResponseFormat("json_object")
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema must be a JSON schema (an object)", name)
    _check_depth(schema, "response_format.json_schema.schema", name)
    return ResponseFormat("json_schema", schema)


def _check_depth(schema: Any, field_name: str, param: str) -> None:
    """400 naming ``field_name`` for a schema nested deeper than a constraint may be (counted without recursion,
    so before anything that recurses over it: repr, the chat template's tojson, json.dumps)."""
    if value_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ApiError(400, too_deep_message(field_name), param)


def too_deep_body(text: str) -> ApiError:
    """The 400 for a request body nested too deeply for ``json.loads`` (which recurses): it names the field where
    the nesting first passes the schemas' limit (a schema's field when it is inside one)."""
    path = too_deep(text, MAX_SCHEMA_DEPTH) or []
    if path[:3] == ["response_format", "json_schema", "schema"]:
        where, param = "response_format.json_schema.schema", "response_format"
    elif len(path) >= 4 and path[0] == "tools" and path[2:4] == ["function", "parameters"]:
        where, param = json_path(path[:4]), "tools"
    elif path and isinstance(path[0], str) and path[0]:
        where, param = json_path(path[:2]), path[0]
    else:
        return ApiError(400, too_deep_message("the request body"), None, "invalid_json")
    return ApiError(400, too_deep_message(where), param)


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0..20, only with logprobs) → alternatives or None."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise ApiError(400, f"'logprobs' must be true or false, got {on!r}", "logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(
                400, f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}", "top_logprobs"
            )
        if top and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return int(top or 0) if on else None


def _completion_logprobs(body: dict) -> int | None:
    """Completions' ``logprobs``: how many alternatives per token (0..5), or None."""
    v = body.get("logprobs")
    if v is None:
        return None
    if not _is_int(v) or not 0 <= v <= MAX_COMPLETION_LOGPROBS:
        raise ApiError(
            400,
            f"'logprobs' must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] for completions, got {v!r}",
            "logprobs",
        )
    return int(v)


def _tools(body: dict) -> tuple[Tool, ...]:
    """``tools``: function tools with a name and an object schema for their parameters (default: none)."""
    v = body.get("tools")
    if v is None or v == []:
        return ()
    if not isinstance(v, list):
        raise ApiError(400, "'tools' must be a list of function tools", "tools")
    out: list[Tool] = []
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ApiError(400, f"{where} must be a function tool ({{'type': 'function', ...}}), got {kind!r}", "tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, f"{where}.function must be an object with a 'name'", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ApiError(
                400, f"{where}.function.name must be 1-64 letters, digits, '_' or '-'; got {name!r}", "tools"
            )
        if any(o.name == name for o in out):
            raise ApiError(400, f"{where}: two tools are named {name!r}", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ApiError(400, f"{where}.function.description must be a string", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if isinstance(params, dict):
            _check_depth(params, f"{where}.function.parameters", "tools")
        if not isinstance(params, dict) or params.get("type") != "object":
            raise ApiError(
                400,
                f"{where}.function.parameters must be a JSON schema of type 'object', got {params!r}"[:300],
                "tools",
            )
        spec_fn = {k: fn[k] for k in ("name", "description") if fn.get(k) is not None}
        spec_fn["parameters"] = params
        out.append(Tool(name=name, parameters=params, spec={"type": "function", "function": spec_fn}))
    return tuple(out)


def _tool_choice(body: dict, tools: tuple[Tool, ...]) -> ToolChoice | None:
    v = body.get("tool_choice")
    if v is None:
        return ToolChoice("auto") if tools else None
    if not tools:
        raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if v in ("none", "auto", "required"):
        return ToolChoice(v)
    fn = v.get("function") if isinstance(v, dict) and v.get("type", "function") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ApiError(
            400,
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if all(t.name != name for t in tools):
        known = ", ".join(t.name for t in tools)
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools ({known})", "tool_choice")
    return ToolChoice("function", name)


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


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates take them: arguments parsed from their JSON text."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list", where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}[{j}] must have a function with a name", f"{where}[{j}]")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                param = f"{where}[{j}].function.arguments"
                raise ApiError(400, f"{param} is not valid JSON: {e}", param) from None
        elif not isinstance(args, dict):
            param = f"{where}[{j}].function.arguments"
            raise ApiError(400, f"{param} must be a JSON string", param)
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _message(m: Any, i: int) -> dict[str, Any]:
    """One chat message → the dict the chat template takes (raises ApiError)."""
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
    role = m.get("role")
    if role not in ROLES:
        raise ApiError(
            400,
            f"messages[{i}].role must be one of system, developer, user, assistant, tool; got {role!r}",
            f"messages[{i}].role",
            "invalid_value",
        )
    out: dict[str, Any] = {"role": ROLES[role], "content": _content(m.get("content"), i)}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(m["tool_calls"], i)
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            param = f"messages[{i}].tool_call_id"
            raise ApiError(400, f"{param} is required for a tool message (a string)", param)
        out["tool_call_id"] = tid
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def parse_chat(body: Any, defaults: Defaults) -> GenRequest:
    """A ``/v1/chat/completions`` body → GenRequest (raises ApiError)."""
    common = _common(body, defaults)
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages", "invalid_value")
    out = tuple(_message(m, i) for i, m in enumerate(msgs))
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", "parallel_tool_calls", "invalid_type")
    return GenRequest(
        kind="chat",
        messages=out,
        prompt=None,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel is not False,
        logprobs=_chat_logprobs(body),
        **common,
    )


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
    return GenRequest(kind="completion", messages=None, prompt=prompt, logprobs=_completion_logprobs(body), **common)


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


LOGPROB_FLOOR = -9999.0  # a log-prob of -inf (or NaN) is sent as this: JSON has no infinities


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-prob with its text: ``text`` (invalid UTF-8 as ``\\xNN`` escapes), its ``raw``
    bytes, ``logprob`` (natural log, the target's distribution) and ``top`` alternatives (text, bytes, logprob),
    most likely first."""

    text: str
    raw: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...] = ()


def _lp(v: float) -> float:
    return float(v) if math.isfinite(v) else LOGPROB_FLOOR


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``choices[i].logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], ...}``."""
    return {
        "content": [
            {
                "token": e.text,
                "logprob": _lp(e.logprob),
                "bytes": list(e.raw),
                "top_logprobs": [{"token": t, "logprob": _lp(lp), "bytes": list(b)} for t, b, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


class CompletionLogprobs:
    """Completions' ``logprobs`` objects for one answer, in pieces (a stream's chunks) or whole.

    ``text_offset`` counts characters of the answer text before each token (its bytes decoded as they complete).
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def __call__(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(self._decoder.decode(e.raw))
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": [{t: _lp(lp) for t, _, lp in e.top} for e in entries],
            "text_offset": offsets,
        }


def response(
    kind: str,
    rid: str,
    model: str,
    text: str | None,
    finish: str,
    use: dict[str, int],
    ext: dict[str, Any],
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) chat.completion / text_completion object, with the ``specexec`` extension.

    Chat: ``text`` None with ``tool_calls`` is an answer of tool calls only. ``logprobs``: the choice's logprobs
    object (:func:`chat_logprobs`, :class:`CompletionLogprobs`)."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
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

    def _choice(
        self,
        text: str | None,
        finish: str | None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def first(self) -> dict[str, Any] | None:
        """Chat: the role chunk (empty content). Completions have none."""
        return self._chunk([self._choice("", None, role=True)]) if self.kind == "chat" else None

    def text(self, piece: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._chunk([self._choice(piece, None, logprobs=logprobs)])

    def call_start(self, index: int, call_id: str, name: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Chat: a tool call begins (its arguments follow in :meth:`call_args` chunks)."""
        call = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        return self._chunk([self._choice(None, None, logprobs=logprobs, tool_calls=[call])])

    def call_args(self, index: int, fragment: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        call = {"index": index, "function": {"arguments": fragment}}
        return self._chunk([self._choice(None, None, logprobs=logprobs, tool_calls=[call])])

    def last(self, finish: str, ext: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._chunk([self._choice(None, finish, logprobs=logprobs)], specexec=ext)

    def usage(self, use: dict[str, int]) -> dict[str, Any]:
        d = self._chunk([])
        d["usage"] = use
        return d
