"""The text layer: chat-template rendering, incremental detokenization and stop strings, outside the engine.

The engine deals in token ids; everything between ids and user-visible text lives here, shared by ``chat``,
``generate`` and the server:

- :func:`render_chat` / :func:`encode_text`: messages or raw text → prompt ids (the tokenizer's chat template).
- :class:`Detokenizer`: ids pushed as they are accepted → the new, complete text. Each push decodes only a small
  window (the previous chunk plus the new ids) and diffs it against the previous chunk's text — the prefix-offset /
  read-offset technique of vLLM and TGI — so the work per step is proportional to the new tokens, not to the
  answer so far. The window's previous chunk gives sentencepiece decoders (Llama's leading-space strip) and
  byte-level BPE the context they need. Text ending in U+FFFD (an incomplete UTF-8 sequence whose remaining bytes
  are in later tokens) is held back until completed.
- :class:`StopMatcher`: text → the part that is safe to emit (a tail that could begin a stop string is held back)
  and whether a stop string matched.
- :class:`TextStream`: the two together plus end-of-sequence ids: what a streaming front end needs.

The final text of a :class:`Detokenizer` equals ``tokenizer.decode(ids, skip_special_tokens=True,
clean_up_tokenization_spaces=False)`` — the same as the plain ``decode`` for tokenizers that do not clean up
spaces (Qwen, Llama 3, Llama 2, Mistral). The clean-up rule (" ." → "." and the like) rewrites text already
emitted, so it cannot be streamed and is not applied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from specexec.errors import SpecexecError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
REPLACEMENT = "\ufffd"
# How many of the newest ids to drop, at most, looking for the last point where the text is complete (no trailing
# U+FFFD). One UTF-8 character spans at most 4 bytes, so within 4 ids the text is complete unless a token splits
# characters on both of its ends several times in a row; past this the U+FFFD are genuine (invalid bytes).
MAX_BACKOFF = 6


class TextError(SpecexecError):
    """A text-layer input the user got wrong (the base of the errors below)."""


class ChatTemplateError(TextError):
    """The tokenizer has no chat template, or its template refused the conversation."""


class MessageError(TextError):
    """A chat message is malformed: not a mapping, an unknown role, or content that is not a string."""


class StopStringError(TextError):
    """A stop string is empty or not a string."""


# -- prompts ----------------------------------------------------------------------------------------------------
def check_messages(messages: Any) -> list[dict[str, str]]:
    """Validate a conversation; return it as plain ``{"role", "content"}`` dicts (other keys are dropped)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise MessageError(f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    if not messages:
        raise MessageError("messages is empty: give at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise MessageError(f"message {i} must be an object with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise MessageError(f"message {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise MessageError(f"message {i}: content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` (system / user / assistant) rendered through the tokenizer's chat template."""
    msgs = check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model's tokenizer has no chat template: give a plain-text prompt instead")
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    except TemplateError as e:  # e.g. a template that refuses system messages or non-alternating roles
        raise ChatTemplateError(f"the chat template refused this conversation: {e}") from None
    if isinstance(ids, Mapping):  # some versions return a BatchEncoding despite return_dict=False
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a raw-text prompt (with the tokenizer's usual special tokens, e.g. a BOS)."""
    if not isinstance(text, str):
        raise TextError(f"a prompt must be a string, got {type(text).__name__}")
    return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops: the special-token map and special added tokens."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, t in added.items() if getattr(t, "special", False))
    return frozenset(ids)


# -- detokenization ---------------------------------------------------------------------------------------------
class Detokenizer:
    """Incremental detokenizer: :meth:`push` ids, receive only the new, complete text.

    State: ``ids`` (kept ids; special tokens and ``skip_ids`` are dropped), ``prefix`` and ``read`` offsets:
    ``ids[prefix:read]`` is the last chunk whose text was emitted, ``ids[read:]`` the ids whose text is pending.
    A push decodes ``ids[prefix:]`` and emits what follows the decoded ``ids[prefix:read]``. If that text ends in
    U+FFFD (an incomplete character), it drops the newest ids one at a time (at most ``MAX_BACKOFF``) to the last
    point where the text is complete, emits up to there and keeps the rest pending. (Dropping ids rather than
    trimming U+FFFD characters matters for byte-fallback decoders, which turn a whole run of byte tokens into
    U+FFFD while any of its characters is incomplete.)
    """

    def __init__(self, tokenizer: Any, skip_ids: Iterable[int] = frozenset(), context: Sequence[int] = ()) -> None:
        """``context``: ids that precede the text (e.g. the prompt's last few), decoded as the first window's
        prefix and never emitted, so a sentencepiece tokenizer keeps the first token's leading space. Without
        it the text equals ``decode`` of the pushed ids alone (whose first leading space such decoders strip)."""
        self.tokenizer = tokenizer
        self.skip = special_ids(tokenizer) | {int(i) for i in skip_ids}
        self.ids: list[int] = [int(t) for t in context if int(t) not in self.skip]
        self._prefix = 0
        self._read = len(self.ids)
        self._prefix_text = self._decode(self.ids)  # decode(ids[prefix:read])
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, ids: Iterable[int]) -> str:
        """Add ids; return the text they complete (possibly empty)."""
        new = [int(t) for t in ids if int(t) not in self.skip]
        if not new:
            return ""
        self.ids.extend(new)
        return self._step(final=False)

    def flush(self) -> str:
        """Release text held back at the end (an incomplete character is emitted as U+FFFD, as ``decode`` does)."""
        return self._step(final=True) if self._read < len(self.ids) else ""

    def _step(self, final: bool) -> str:
        end = len(self.ids)
        window = self._decode(self.ids[self._prefix : end])
        if not final and window.endswith(REPLACEMENT):
            # an incomplete character: emit up to the last complete point among the newest ids
            for j in range(1, MAX_BACKOFF + 1):
                if end - j <= self._read:
                    return ""  # every pending id belongs to the incomplete character
                shorter = self._decode(self.ids[self._prefix : end - j])
                if not shorter.endswith(REPLACEMENT):
                    window, end = shorter, end - j
                    break
            # else: no complete point among the last MAX_BACKOFF ids, so the U+FFFD are genuine (invalid bytes)
        if not window.startswith(self._prefix_text):  # a decoder that rewrote earlier text: emit by length
            log.debug("detokenizer window does not extend its prefix: %r / %r", self._prefix_text, window)
        out = window[len(self._prefix_text) :]
        self._prefix, self._read = self._read, end
        self._prefix_text = self._decode(self.ids[self._prefix : self._read])
        if out:
            self._parts.append(out)
        return out


# -- stop strings -----------------------------------------------------------------------------------------------
def check_stops(stops: Any) -> tuple[str, ...]:
    """Validate stop strings: a string or a sequence of non-empty strings."""
    if stops is None:
        return ()
    if isinstance(stops, str):
        stops = [stops]
    out = []
    for s in stops:
        if not isinstance(s, str):
            raise StopStringError(f"stop strings must be strings, got {type(s).__name__}")
        if not s:
            raise StopStringError("a stop string is empty")
        out.append(s)
    return tuple(dict.fromkeys(out))


class StopMatcher:
    """Find the first stop string in streamed text, holding back a tail that could begin one.

    "First" is the occurrence that ends earliest (ties: the longest, i.e. the one starting earliest), so the
    outcome does not depend on how the text is split into pushes. After a match, pushes return ``("", True)``.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = check_stops(stops)
        self._hold_max = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string matched)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._buf + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self.matched, self._buf = best[2], ""
            return buf[: best[1]], True
        hold = 0
        for k in range(min(len(buf), self._hold_max), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        self._buf = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The held tail, at the end of a generation that matched no stop string."""
        out, self._buf = self._buf, ""
        return "" if self.matched is not None else out


# -- both, with end-of-sequence ids ----------------------------------------------------------------------------
class TextStream:
    """Ids in, text out: detokenization, end-of-sequence ids and stop strings for one generation.

    ``push(ids)`` returns (new text, stopped). Once stopped (an EOS id, or a stop string completed) further
    pushes return ``("", True)``. ``n_tokens`` counts the ids consumed up to and including the one that stopped
    the stream (the EOS id, or the token that completed a stop string): the ids a caller keeps. ``context``: see
    :class:`Detokenizer`.
    """

    def __init__(
        self, tokenizer: Any, eos_ids: Iterable[int] = (), stops: Sequence[str] = (), context: Sequence[int] = ()
    ) -> None:
        self.eos = frozenset(int(i) for i in eos_ids)
        self.detok = Detokenizer(tokenizer, skip_ids=self.eos, context=context)
        self.matcher = StopMatcher(stops)
        self.hit_eos = False
        self.n_tokens = 0
        self._parts: list[str] = []
        self._done = False

    @property
    def stopped(self) -> bool:
        return self.hit_eos or self.matcher.stopped

    @property
    def stop_string(self) -> str | None:
        return self.matcher.matched

    @property
    def finish_reason(self) -> str:
        """'stop' (EOS or a stop string), else 'length'."""
        return finish_reason(self.stopped)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def push(self, ids: Iterable[int]) -> tuple[str, bool]:
        if self._done:
            return "", True
        out: list[str] = []
        for t in ids:
            t = int(t)
            self.n_tokens += 1
            if t in self.eos:
                self.hit_eos = True
                out.append(self._finish())
                break
            text, stop = self.matcher.push(self.detok.push([t]))
            out.append(text)
            if stop:
                self._done = True
                break
        return self._emit("".join(out)), self._done

    def flush(self) -> str:
        """Release held text at the end of a generation (call once the ids run out)."""
        if self._done:
            return ""
        return self._emit(self._finish())

    def _finish(self) -> str:
        text, stop = self.matcher.push(self.detok.flush())
        self._done = True
        return text if stop else text + self.matcher.flush()

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text


def finish_reason(stopped: bool) -> str:
    """OpenAI's finish_reason: 'stop' when an EOS id or a stop string ended the text, 'length' otherwise."""
    return "stop" if stopped else "length"
