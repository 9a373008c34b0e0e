"""Tool calls over a chat template: the model's tool-call format, the grammar that forces a call, the parser back.

OpenAI's ``tools`` reach the model through its own chat template (``apply_chat_template(messages, tools=...)``):
each model family was trained to answer with calls in one textual format, which :func:`tool_format` recognizes
from the template's text:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block
  per call, optionally after some text. In Qwen's vocabulary ``<tool_call>`` / ``</tool_call>`` are single added
  tokens (ids 151657 / 151658), so the grammar names them as tokens (``<[id]>``).
- ``llama3`` (Llama 3.1-3.3, JSON tool calling): the whole answer is ``{"name": "f", "parameters": {...}}``,
  possibly after ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` (``[TOOL_CALLS]`` is a control token).

:func:`forced_grammar` writes an llguidance Lark grammar for ``tool_choice`` ``required`` (one or more calls, any
function) or a named function (one call of it): the format's literal text around each function's ``parameters``
schema embedded with ``%json``, in the separators the templates render (``", "``, ``": "``, as Jinja's ``tojson``).
A Hermes answer may end with a newline after its last call (Qwen's models write one before ending their turn; a
grammar without it made the demo model start another call it did not want, where it wanted to end).

:class:`ToolParser` turns generated text, pushed piece by piece, into events: content text, a call's start (id,
name) and its argument fragments. Streamed and whole answers both fold the same events, so they agree by
construction. Hermes blocks stream their arguments as they are generated; the llama3 / mistral formats are the
whole answer, so an answer that may be one (it starts with ``{`` / ``[``) is held to its end and parsed there.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
FORMATS = (HERMES, LLAMA3, MISTRAL)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, TOOL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"
# how arguments are laid out inside a forced call: the separators of Jinja's ``tojson`` (Python's json.dumps), which
# is how the templates render the calls of earlier turns; no other whitespace (a random model cannot loop on it)
ARGS_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, its parameters' JSON schema (an object schema), and the OpenAI
    tool object as the chat template receives it."""

    name: str
    parameters: dict[str, Any]
    spec: dict[str, Any] = field(compare=False)


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template(s) as one string ('' when it has none)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, Mapping):
        return "\n".join(str(v) for v in t.values())
    return t if isinstance(t, str) else ""


def tool_format(template: str) -> str | None:
    """The tool-call format a chat template's text asks for (:data:`FORMATS`), or None when it is not one of them."""
    if OPEN in template and CLOSE in template:
        return HERMES
    if TOOL_CALLS in template:
        return MISTRAL
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return LLAMA3
    return None


def new_call_id(fmt: str | None) -> str:
    """A tool call's id: ``call_`` + 24 hex digits; for Mistral 9 letters/digits (its template refuses other ids)."""
    if fmt == MISTRAL:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# ---------------------------------------------------------------------------------------------- the grammar


def _lit(text: str) -> str:
    """A Lark string literal (JSON escapes are valid in llguidance's Lark strings)."""
    return json.dumps(text, ensure_ascii=False)


def args_schema(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters schema with the argument layout of :data:`ARGS_LAYOUT` (unless it sets its own)."""
    schema = dict(parameters)
    schema.setdefault("x-guidance", ARGS_LAYOUT)
    return schema


def forced_grammar(
    fmt: str, tools: Sequence[Tool], name: str | None, parallel: bool, token_id: Callable[[str], int | None]
) -> str:
    """An llguidance Lark grammar for a forced call in ``fmt``: one call of function ``name``, or (``name`` None:
    ``tool_choice`` "required") one call of any of ``tools``, or several when ``parallel`` and the format allows.

    ``token_id(text)``: the id of the single token spelling ``text`` in the model's vocabulary, or None; such a
    marker is named as that token (``<[id]>``), others as text.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    chosen = [t for t in tools if name is None or t.name == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}")

    def marker(text: str) -> str:
        tid = token_id(text)
        return f"<[{tid}]>" if tid is not None else _lit(text)

    key = "parameters" if fmt == LLAMA3 else "arguments"
    lines, alts = [], []
    for i, t in enumerate(chosen):
        head = _lit(f'{{"name": "{t.name}", "{key}": ')
        body = f'{head} args_{i} "}}"'
        if fmt == HERMES:
            body = f'{marker(OPEN)} "\\n" {body} "\\n" {marker(CLOSE)}'
        lines.append(f"call_{i}: {body}")
        lines.append(f"args_{i}: %json {json.dumps(args_schema(t.parameters), ensure_ascii=False)}")
        alts.append(f"call_{i}")
    many = parallel and name is None
    if fmt == HERMES:  # Qwen ends a call with a newline before the end of its turn: allowed, not required
        start = 'call ("\\n" call)* "\\n"?' if many else 'call "\\n"?'
    elif fmt == MISTRAL:
        calls = 'call (", " call)*' if many else "call"
        start = f'{marker(TOOL_CALLS)} " [" {calls} "]"'
    else:  # llama3: one call is the whole answer
        start = "call"
    return "\n".join([f"start: {start}", f"call: {' | '.join(alts)}", *lines]) + "\n"


# ---------------------------------------------------------------------------------------------- the parser


@dataclass(frozen=True)
class Content:
    """Answer text for ``message.content``."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its index among the answer's calls, id and function name (arguments follow)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """A fragment of call ``index``'s arguments (a JSON text once all fragments are joined)."""

    index: int
    text: str


Event = Content | CallStart | CallArgs


class _JsonEnd:
    """Finds where one JSON object or array ends in text fed piece by piece (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.done = 0, False, False, False

    def feed(self, text: str) -> int:
        """Consume ``text``; return how many of its characters belong to the value (all of them unless it ended)."""
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (text to hold back while it may be one)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _call_of(obj: Any, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for k in keys:
        if k in obj:
            args = obj[k]
            if isinstance(args, str):  # arguments given as a JSON string
                try:
                    json.loads(args)
                except json.JSONDecodeError:
                    return None
                return obj["name"], args
            return obj["name"], json.dumps(args, ensure_ascii=False)
    return obj["name"], "{}"


class ToolParser:
    """Generated text → :data:`Event` s, for one answer in tool-call format ``fmt`` (see the module docstring).

    ``push(text)`` returns the events that text completes; ``finish()`` the rest once the answer has ended. Text
    that may still turn out to be markup (a partial ``<tool_call>``, trailing whitespace before a call) is held
    back until it is decided; a block that does not parse as a call comes back as content, markup and all.
    """

    def __init__(self, fmt: str, new_id: Callable[[], str] | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt = fmt
        self.new_id = new_id or (lambda: new_call_id(fmt))
        self.calls = 0
        self._buf = ""
        # hermes: content -> head -> args -> tail -> content ...; llama3 / mistral: start -> content | whole
        self._state = "content" if fmt == HERMES else "start"
        self._fresh = False  # right after a call: leading whitespace is dropped
        self._gap = ""  # the whitespace between content and the block being read
        self._scan = _JsonEnd()

    # -- public -------------------------------------------------------------------------------------------------
    def push(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        if self.fmt == HERMES:
            self._hermes(out, final=False)
        else:
            self._whole(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.fmt == HERMES:
            self._hermes(out, final=True)
        else:
            self._whole(out, final=True)
        return out

    # -- hermes: blocks anywhere in the text ----------------------------------------------------------------------
    def _hermes(self, out: list[Event], final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "content":
                i = buf.find(OPEN)
                if i >= 0:  # a block begins: the text before it, less the whitespace that separates them
                    text = buf[:i].rstrip()
                    self._content(out, text)
                    self._gap = buf[len(text) : i]  # given back if the block is no call
                    self._buf, self._state = buf[i + len(OPEN) :], "head"
                    continue
                if final:
                    self._content(out, buf)
                    self._buf = ""
                    return
                # hold back what may begin a block, and trailing whitespace (dropped if a block follows)
                ready = buf[: len(buf) - _held_prefix(buf, OPEN)].rstrip()
                self._content(out, ready)
                self._buf = buf[len(ready) :]
                return
            if self._state == "head":  # after <tool_call>: the usual layout streams its arguments
                m = _HEAD.match(buf)
                if m and m.end() < len(buf) and buf[m.end()] == "{":
                    self._start_call(out, json.loads(f'"{m.group(1)}"'))
                    self._buf, self._state, self._scan = buf[m.end() :], "args", _JsonEnd()
                    continue
                j = buf.find(CLOSE)
                if j < 0 and not final:
                    return
                inner = buf[:j] if j >= 0 else buf  # another layout: parse the whole block
                called = self._whole_block(out, inner, self._gap + OPEN + (buf[: j + len(CLOSE)] if j >= 0 else buf))
                self._buf = buf[j + len(CLOSE) :] if j >= 0 else ""
                self._state, self._fresh = "content", called
                continue
            if self._state == "args":
                n = self._scan.feed(buf)
                if n:
                    out.append(CallArgs(self.calls - 1, buf[:n]))
                self._buf = buf[n:]
                if not self._scan.done:
                    return
                self._state = "tail"
                continue
            # tail: the wrapper's closing brace, then </tool_call>
            rest = buf[re.match(r"\s*\}?\s*", buf).end() :]  # type: ignore[union-attr]
            if rest.startswith(CLOSE):
                rest = rest[len(CLOSE) :]
            elif CLOSE.startswith(rest) and not final:
                return  # it may still come
            self._buf, self._state, self._fresh = rest, "content", True

    def _whole_block(self, out: list[Event], inner: str, raw: str) -> bool:
        """One block's call (True), or its ``raw`` text as content when it is none (False)."""
        try:
            call = _call_of(json.loads(inner), ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            self._content(out, raw)
            return False
        self._start_call(out, call[0])
        out.append(CallArgs(self.calls - 1, call[1]))
        return True

    # -- llama3 / mistral: the whole answer is the call(s) ----------------------------------------------------------
    def _whole(self, out: list[Event], final: bool) -> None:
        if self._state == "content":
            if self._buf:
                self._content(out, self._buf)
                self._buf = ""
            return
        body = self._buf.lstrip()
        if self._state == "start":
            opener = ("{", PYTHON_TAG) if self.fmt == LLAMA3 else ("[", TOOL_CALLS)
            if not final and (not body or any(o != body and o.startswith(body) for o in opener)):
                return  # whitespace, or the start of a marker: undecided
            self._state = "whole" if any(body.startswith(o) for o in opener) else "content"
            if self._state == "content":
                self._whole(out, final)
                return
        if not final:
            return
        calls = self._parse_whole(body)
        if calls is None:
            self._content(out, self._buf)
        else:
            for name, args in calls:
                self._start_call(out, name)
                out.append(CallArgs(self.calls - 1, args))
        self._buf = ""

    def _parse_whole(self, body: str) -> list[tuple[str, str]] | None:
        for tag in (PYTHON_TAG, TOOL_CALLS):
            if body.startswith(tag):
                body = body[len(tag) :].lstrip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        items = obj if self.fmt == MISTRAL and isinstance(obj, list) else [obj] if self.fmt == LLAMA3 else None
        if not items:
            return None
        calls = [_call_of(o, ("arguments", "parameters")) for o in items]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]

    # -- shared -------------------------------------------------------------------------------------------------
    def _content(self, out: list[Event], text: str) -> None:
        if self._fresh:
            text = text.lstrip()
            self._fresh = not text
        if text:
            out.append(Content(text))

    def _start_call(self, out: list[Event], name: str) -> None:
        out.append(CallStart(self.calls, self.new_id(), name))
        self.calls += 1


@dataclass
class Folded:
    """The events of a whole answer folded into OpenAI's message fields."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def fold(events: Sequence[Event]) -> Folded:
    """``message.content`` (None when the answer is only tool calls) and ``message.tool_calls``."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Content):
            text.append(e.text)
        elif isinstance(e, CallStart):
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        else:
            calls[e.index]["function"]["arguments"] += e.text
    content = "".join(text)
    return Folded(content=None if calls and not content.strip() else content, tool_calls=calls)
