"""Multi-turn chat over an :class:`~specexec.decoding.engine.Engine`: history, chat-template rendering, the context
window, interruption, transcripts; plus the pure input helpers the ``specexec chat`` REPL uses.

Every turn renders the WHOLE conversation (system prompt, earlier turns, the new user message) with the
tokenizer's chat template (``add_generation_prompt=True``) and hands the ids to ``engine.stream``. The engine keeps
its committed sequence and KV caches between calls and reuses the longest common prefix, so a turn only prefills
the tokens after the previous answer (``stats.prefill_tokens``). The assistant message is stored exactly as the
decoded answer text, so a template that renders it back verbatim (Qwen, Llama) re-tokenizes to the same ids; a
template that re-renders earlier turns differently only costs a longer prefill, never a wrong answer.

Context window: when system + history + the new message + ``max_new_tokens`` exceed ``engine.context``, the oldest
turns leave the window (the system prompt stays; they remain in the saved transcript) and a notice says so. A
message that cannot fit even alone raises :class:`SpecexecError` for that message only; the session goes on.

Interruption (Ctrl-C while an answer streams): the REPL sets a flag that :meth:`Reply.pieces` checks before
handing out each piece, so nothing of the step in flight is shown once it is set (a second Ctrl-C raises
``KeyboardInterrupt`` at once). The text yielded so far is kept as the assistant message, marked ``interrupted``
in the transcript (so the model sees what the user saw); an answer interrupted before any text appeared drops the
whole turn. The engine stays usable: its state only advances after a completed step, and the next request
re-syncs through the prefix cache.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specexec.config import ChainConfig, SamplingConfig, TreeConfig, check_method
from specexec.decoding.engine import Engine, Generation, Result, Stats
from specexec.decoding.text import render_chat
from specexec.errors import ConfigError, SpecexecError, setting

log = logging.getLogger(__name__)

MIN_ANSWER_TOKENS = 16  # a message must leave at least this much room (or max_new_tokens, if smaller)
TRIPLE_QUOTE = '"""'


# ---------------------------------------------------------------------------------------------- the session


@dataclass
class Turn:
    """One exchange. ``in_context`` turns false when the turn leaves the model's window (kept in transcripts)."""

    user: str
    assistant: str = ""
    interrupted: bool = False
    in_context: bool = True
    stats: Stats | None = None  # None for interrupted answers (their statistics are incomplete)


@dataclass(frozen=True)
class GenOptions:
    """How answers are generated (the decoding half of the CLI's options)."""

    max_new_tokens: int = 512
    method: str | None = None  # None: specexec with a draft, else ar
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    chain: ChainConfig = field(default_factory=ChainConfig)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", self.max_new_tokens, "must be >= 1")
        if self.method is not None:
            check_method(self.method)


class Reply:
    """One answer being generated. Iterate for text pieces (like :class:`~specexec.decoding.engine.Generation`).

    ``notices`` (window changes) are known before iteration. When iteration ends, normally, through
    :meth:`pieces`' stop flag, or through an exception such as ``KeyboardInterrupt``, the turn is recorded in the
    session; then ``interrupted``, ``text`` and ``result`` (None if interrupted) describe it.
    """

    def __init__(self, session: ChatSession, turn: Turn, generation: Generation, notices: list[str]) -> None:
        self._session, self.turn, self.generation = session, turn, generation
        self.notices = notices
        self.prompt_tokens = len(generation.ids)
        self.done = False
        self.stopped = False  # iteration ended before the answer did (stop flag, exception, or close)

    def __iter__(self) -> Iterator[str]:
        return self.pieces()

    def pieces(self, stop: Callable[[], bool] | None = None) -> Iterator[str]:
        """The answer's text pieces. ``stop()`` is asked before each piece is handed out: once it is true no
        further piece is yielded (the step in flight is discarded, not shown) and the turn is recorded as
        interrupted with exactly the text yielded so far (``stopped`` becomes true)."""
        if self.done:
            raise RuntimeError("a Reply can be iterated only once")
        self.done = True
        shown: list[str] = []
        gen = iter(self.generation)
        try:
            while not (stop is not None and stop()):
                try:
                    piece = next(gen)
                except StopIteration:
                    break
                if stop is not None and stop():  # the flag came while this step ran: it is never shown
                    break
                shown.append(piece)
                yield piece
        finally:
            if self.generation.result is None:
                self.stopped = True
                gen.close()  # type: ignore[attr-defined]  # cancels the engine's step loop (its state stays consistent)
            self._session._record(self.turn, self.result, "".join(shown))

    @property
    def result(self) -> Result | None:
        """The finished generation; None when interrupted (its statistics are incomplete)."""
        return None if self.stopped else self.generation.result

    @property
    def interrupted(self) -> bool:
        return self.stopped

    @property
    def text(self) -> str:
        return self.turn.assistant


class ChatSession:
    """A conversation with an engine: ``send(text)`` returns a :class:`Reply` to iterate; history is kept here."""

    def __init__(self, engine: Engine, system: str | None = None, options: GenOptions | None = None) -> None:
        self.engine = engine
        self.options = options or GenOptions()
        tok = engine.tokenizer.tokenizer
        if not getattr(tok, "chat_template", None):
            raise SpecexecError(
                "this model's tokenizer has no chat template: chat needs an instruct/chat model "
                "(use `specexec generate` for plain completion)"
            )
        if self.options.method not in (None, "ar") and engine.draft is None:
            raise ConfigError(
                "method",
                self.options.method,
                "needs a draft model",
                f"{setting('method', self.options.method)} needs a draft model: pass {setting('draft')}",
            )
        if self.options.max_new_tokens + MIN_ANSWER_TOKENS > engine.context:
            raise SpecexecError(
                f"{setting('max_new_tokens', self.options.max_new_tokens)} leaves no room for a message in the "
                f"context ({engine.context} tokens): lower {setting('max_new_tokens')} or raise {setting('context')}"
            )
        self.system = _check_text(system, "system prompt") if system else None
        self.turns: list[Turn] = []
        self._last_ids: list[int] = []  # the previous request's ids (prefix-reuse diagnostics only)

    # -- history ------------------------------------------------------------------------------------------------
    @property
    def messages(self) -> list[dict[str, str]]:
        """What the model sees: the system prompt plus the turns still in the window ({role, content} dicts)."""
        return self._messages([t for t in self.turns if t.in_context])

    @property
    def last_stats(self) -> Stats | None:
        """Stats of the last answer that completed."""
        return next((t.stats for t in reversed(self.turns) if t.stats is not None), None)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays; the engine's cache of it stays useful)."""
        self.turns = []

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (empty/None: none) and start a new conversation."""
        self.system = _check_text(text, "system prompt") if text else None
        self.reset()

    # -- one turn -----------------------------------------------------------------------------------------------
    def send(self, text: str) -> Reply:
        """Start answering ``text``. Raises SpecexecError (history untouched) if the message is unusable."""
        text = _check_text(text, "message")
        if not text.strip():
            raise SpecexecError("empty message")
        ids, max_new, drop, notices = self._fit(text)
        o = self.options
        gen = self.engine.stream(ids, max_new, method=o.method, sampling_cfg=o.sampling, tree=o.tree, chain=o.chain)
        self._drop_oldest(drop)
        _log_reuse(self._last_ids, ids)
        self._last_ids = ids
        return Reply(self, Turn(user=text), gen, notices)

    def _fit(self, text: str) -> tuple[list[int], int, int, list[str]]:
        """Ids for the window that fits, the answer limit, how many oldest turns to drop, and notices."""
        ctx, max_new = self.engine.context, self.options.max_new_tokens
        alone = self._render(self._messages([]) + [{"role": "user", "content": text}])
        if len(alone) + min(max_new, MIN_ANSWER_TOKENS) > ctx:
            raise SpecexecError(
                f"message too long: it takes {len(alone)} tokens"
                + (" with the system prompt" if self.system else "")
                + f" and the context holds {ctx}; shorten it or raise {setting('context')}"
            )
        window = [t for t in self.turns if t.in_context]
        drop = 0
        while True:
            ids = self._render(self._messages(window[drop:]) + [{"role": "user", "content": text}])
            if len(ids) + max_new <= ctx or drop == len(window):
                break
            drop += 1
        notices = []
        if drop:
            notices.append(f"context full: the {drop} oldest turn(s) left the model's window (system prompt kept)")
        if len(ids) + max_new > ctx:
            max_new = ctx - len(ids)
            notices.append(f"this answer is limited to {max_new} tokens by the context ({ctx})")
        return ids, max_new, drop, notices

    def _drop_oldest(self, n: int) -> None:
        for t in [t for t in self.turns if t.in_context][:n]:
            t.in_context = False

    def _record(self, turn: Turn, result: Result | None, shown: str) -> None:
        """Append the finished (or interrupted) turn; an interrupted turn with no visible text is dropped."""
        if result is not None:
            turn.assistant, turn.stats = result.text, result.stats
        elif shown:
            turn.assistant, turn.interrupted = shown, True
        else:
            log.info("answer interrupted before any text: turn dropped")
            return
        self.turns.append(turn)

    # -- rendering ----------------------------------------------------------------------------------------------
    def _messages(self, turns: list[Turn]) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system}] if self.system else []
        for t in turns:
            out += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant}]
        return out

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the chat template, ready for the assistant's answer → token ids (the text
        layer's render_chat: the same rendering generate and the server use)."""
        return render_chat(self.engine.tokenizer.tokenizer, messages)

    # -- transcripts --------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The whole transcript (turns that left the window included) with per-answer stats and settings."""
        o = self.options
        answers = []
        for i, t in enumerate(self.turns):
            answers.append(
                {
                    "message": len(self._messages(self.turns[: i + 1])) - 1,
                    "interrupted": t.interrupted,
                    "in_context": t.in_context,
                    "stats": t.stats.to_json() if t.stats else None,
                }
            )
        return {
            "system": self.system,
            "messages": self._messages(self.turns),
            "answers": answers,
            "settings": {
                "max_new_tokens": o.max_new_tokens,
                "method": o.method,
                "context": self.engine.context,
                "sampling": asdict(o.sampling),
                "tree": asdict(o.tree),
                "chain": asdict(o.chain),
            },
        }

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` (UTF-8 JSON); returns the path."""
        p = Path(path).expanduser()
        try:
            p.write_text(json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as e:
            raise SpecexecError(f"cannot save the transcript to {p}: {e.strerror or e}") from None
        return p


def _log_reuse(previous: list[int], ids: list[int]) -> None:
    """Debug-log how much of the previous request the new one repeats (templates that re-render earlier turns
    differently shrink it; the engine's prefix cache can only reuse this common prefix)."""
    n = 0
    for a, b in zip(previous, ids):
        if a != b:
            break
        n += 1
    if previous and n < len(previous):
        log.debug("chat template re-rendered the previous request differently after token %d of %d", n, len(previous))


# ---------------------------------------------------------------------------------------------- input helpers


class InvalidInput(SpecexecError):
    """A line of input that is not valid UTF-8 (the REPL reports it and goes on)."""


def _check_text(text: str, what: str) -> str:
    """Refuse strings carrying undecodable bytes (lone surrogates from a surrogateescape-decoded stdin)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"the {what} is not valid UTF-8; it was ignored") from None
    return text


def decode_line(raw: bytes) -> str:
    """One line of raw input → text (trailing newline removed); invalid UTF-8 raises :class:`InvalidInput`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"the input is not valid UTF-8 (byte {e.start}); it was ignored") from None
    return _check_text(text.rstrip("\r\n"), "input")


def read_message(read_line: Callable[[str], str], prompt: str = ">>> ", more: str = "... ") -> str:
    """Read one message with ``read_line(prompt)``: one line, or a block between triple quotes.

    A line starting with triple quotes opens a block that ends at the line ending with triple quotes (which
    may be the same line); the quotes are removed. ``EOFError``, ``KeyboardInterrupt`` and
    :class:`InvalidInput` propagate (the caller decides what they mean).
    """
    line = _check_text(read_line(prompt), "input")
    stripped = line.strip()
    if not stripped.startswith(TRIPLE_QUOTE):
        return line
    rest = stripped[len(TRIPLE_QUOTE) :]
    if rest.endswith(TRIPLE_QUOTE):
        return rest[: -len(TRIPLE_QUOTE)]
    lines = [rest] if rest else []
    while True:
        line = _check_text(read_line(more), "input")
        if line.rstrip().endswith(TRIPLE_QUOTE):
            lines.append(line.rstrip()[: -len(TRIPLE_QUOTE)])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def parse_command(text: str) -> tuple[str, str] | None:
    """``/name rest`` → (name, rest stripped); None if ``text`` is not a command (does not start with ``/word``)."""
    s = text.strip()
    if not s.startswith("/") or len(s) < 2 or not s[1].isalpha():
        return None
    name, _, arg = s[1:].partition(" ")
    return name.lower(), arg.strip()


def summary_line(stats: Stats) -> str:
    """The one-line speed summary printed after each answer: tokens, decoding speed, tokens per target pass."""
    s = stats
    return (
        f"{s.new_tokens} token{'s' if s.new_tokens != 1 else ''}, {s.tokens_per_s:.1f} tok/s, "
        f"{s.tokens_per_step:.2f} tokens/step"
    )


def format_stats(stats: Stats) -> list[str]:
    """Human lines for one answer's stats: speed, tokens per step, accepted-length histogram, time split."""
    s = stats
    auto = "auto, mostly " if s.budget_auto else ""
    if s.budget is not None and s.budget.kind != "plain":
        param = f", budget {auto}{s.budget.label}"
    else:
        param = f", gamma {s.gamma}" if s.gamma else ""
    lines = [
        f"method       {s.method}{param}",
        f"tokens       {s.new_tokens} in {s.steps} target passes ({s.tokens_per_step:.2f} tokens/step)",
        f"speed        {s.tokens_per_s:.2f} tokens/s (decoding; prefill {s.prefill_tokens} tokens in "
        f"{s.prefill_s:.2f} s)",
        f"time         draft {s.draft_s:.2f} s, target {s.target_s:.2f} s, wall {s.wall_s:.2f} s",
    ]
    if len(s.budgets) > 1:
        lines.append("budgets      " + ", ".join(f"{b.label} x{n}" for b, n in sorted(s.budgets.items())))
    if s.mean_tree_size:
        lines.append(f"tree         {s.mean_tree_size:.1f} draft tokens per step, {s.draft_passes} draft passes")
    if s.ngram_tokens:
        lines.append(f"n-gram       {s.ngram_tokens} of the {s.new_tokens} tokens from prompt-lookup branches")
    if s.accepted_hist:
        lines.append("accepted     tokens/step: count")
        top = max(s.accepted_hist.values())
        for k in sorted(s.accepted_hist):
            n = s.accepted_hist[k]
            lines.append(f"  {k:>3}  {n:>5}  " + "#" * max(1, round(30 * n / top)))
    return lines
