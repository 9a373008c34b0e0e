"""``specexec chat``: an interactive REPL (like llama.cpp's / Ollama's) over :class:`specexec.chat.ChatSession`.

Parsing and printing only: options become configs, :mod:`specexec.chat` does the work.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import typer

from specexec.chat import (
    ChatSession,
    GenOptions,
    InvalidInput,
    decode_line,
    format_stats,
    parse_command,
    read_message,
    summary_line,
)
from specexec.cli import options as o
from specexec.cli.common import guarded, setup_logging, user_message
from specexec.errors import SpecexecError

if TYPE_CHECKING:
    from specexec.api import ModelOptions

HELP = '''commands:
  /help          this help
  /reset         forget the conversation (the system prompt stays)
  /stats         statistics of the last answer: tokens/s, tokens per step, accepted lengths, draft/target time
  /system TEXT   set the system prompt and start a new conversation (/system alone shows it)
  /save FILE     write the transcript (messages + per-answer stats) as JSON
  /quit, /exit   leave (Ctrl-D does too)
input:
  a message is one line; for several lines start with """ and end with """ (on the last line)
  Ctrl-C during an answer stops it: the text so far stays in the history, marked interrupted
  Ctrl-C at the prompt clears the line (it never exits); Ctrl-D or /quit exits'''


@o.shared_options(defaults={"max_new_tokens": 512})
def chat(
    shared: o.Shared,
    system: str | None = typer.Option(None, "--system", "-s", help="System prompt."),
) -> None:
    """Chat with a model in the terminal (streamed answers, history, /help for commands).

    With the default target and no --draft, the demo draft is used (SpecExec); --draft none decodes plainly.
    """
    s = shared
    setup_logging(s.verbose, s.quiet)

    def run() -> None:
        # everything that needs no model is checked first: a bad option never costs a model load
        model = s.model_options()
        tree = s.tree_config()
        gen = GenOptions(
            max_new_tokens=s.max_new_tokens,
            method=s.method,
            sampling=s.sampling_config(),
            tree=tree,
            chain=s.chain_config(),
        )
        engine = s.load(model, tree, show=not s.quiet)
        session = ChatSession(engine, system=system, options=gen)
        if not s.quiet:
            _banner(model, engine, s.method)
        repl(session, s.quiet)

    guarded(run, s.verbose)


def _banner(model: ModelOptions, engine: Any, method: str | None) -> None:
    method = method or ("specexec" if engine.draft is not None else "ar")
    typer.secho(
        f"specexec chat: target {model.target}, draft {model.draft or 'none'}"
        + (f" in {engine.draft_weights}" if getattr(engine, "draft_weights", None) else "")
        + f" ({method}), "
        f"context {engine.context} tokens. /help for commands, Ctrl-D to quit.",
        fg="cyan",
        err=True,
    )


# ---------------------------------------------------------------------------------------------- the REPL


def repl(session: ChatSession, quiet: bool = False) -> None:
    """Read messages and commands until /quit or end of input (Ctrl-D); ``quiet``: no per-answer summary."""
    if sys.stdin.isatty():
        _setup_readline()
    while True:
        try:
            text = read_message(read_line)
        except EOFError:
            typer.echo()
            return
        except KeyboardInterrupt:
            typer.echo()
            _notice("line cleared (Ctrl-D or /quit exits)")
            continue
        except InvalidInput as e:
            _error(e)
            continue
        if not text.strip():
            continue
        cmd = parse_command(text)
        if cmd is None:
            answer(session, text, quiet)
        elif not command(session, *cmd):
            return


def read_line(prompt: str) -> str:
    """One line of input. A terminal gets input() (readline editing); pipes are read as bytes so an invalid line
    is reported and skipped without losing the rest of the stream."""
    if sys.stdin.isatty():
        try:
            with _ctrl_c_as_key():
                line = input(prompt)
        except UnicodeDecodeError as e:
            raise InvalidInput(f"the input is not valid UTF-8 (byte {e.start}); it was ignored") from None
        if "\x03" in line:  # Ctrl-C typed at the prompt (see _ctrl_c_as_key)
            raise KeyboardInterrupt
        return line
    sys.stdout.write(prompt)
    sys.stdout.flush()
    raw = sys.stdin.buffer.readline()
    if not raw:
        raise EOFError
    return decode_line(raw)


_CTRL_C_IS_KEY = False  # GNU readline is loaded and Ctrl-C at the prompt is bound to "clear the line"


def _setup_readline() -> None:
    """Line editing and history for input(); with GNU readline, Ctrl-C at the prompt becomes a key.

    Why: CPython's readline loop only notices SIGINT when it interrupts its select(); a Ctrl-C that lands while
    readline is handling the previous keystroke is swallowed until the next key (CPython's race, seen here under
    load). As a key it cannot be lost: Ctrl-C kills the line and enters a lone ``\\x03``, which
    :func:`read_line` turns into KeyboardInterrupt.
    """
    global _CTRL_C_IS_KEY
    try:
        import readline
        import termios  # noqa: F401
    except ImportError:
        return
    if "libedit" in (readline.__doc__ or ""):
        return  # editline's binding syntax differs; Ctrl-C stays a signal there
    readline.parse_and_bind(r'"\C-c": "\C-a\C-k\C-v\C-c\n"')
    _CTRL_C_IS_KEY = True


@contextmanager
def _ctrl_c_as_key() -> Iterator[None]:
    """While reading a line, the terminal does not turn Ctrl-C into SIGINT (readline sees the key instead)."""
    if not _CTRL_C_IS_KEY:
        yield
        return
    import termios

    fd = sys.stdin.fileno()
    try:
        saved = termios.tcgetattr(fd)
        raw = termios.tcgetattr(fd)
        try:
            off = os.fpathconf(fd, "PC_VDISABLE")  # 0 on Linux, 0xff on macOS
        except (OSError, ValueError):
            off = 0
        raw[6][termios.VINTR] = bytes([off]) if isinstance(raw[6][termios.VINTR], bytes) else off
        termios.tcsetattr(fd, termios.TCSANOW, raw)
    except termios.error:
        yield
        return
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


@contextmanager
def _ctrl_c_as_flag() -> Iterator[threading.Event]:
    """While an answer streams, the first Ctrl-C only sets a flag, checked after each step's text is shown; a
    second one raises at once. A flag cannot be lost: an exception raised by a signal handler that happens to run
    inside a finalizer would be (Python prints it as "ignored"), and a step is never cut half-way."""
    stop = threading.Event()

    def on_sigint(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    try:
        old = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread: keep the default behaviour
        yield stop
        return
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, old)


def answer(session: ChatSession, text: str, quiet: bool = False) -> None:
    """Stream one answer, then (unless ``quiet``) a one-line speed summary on stderr. Ctrl-C stops it cleanly:
    nothing of the step in flight is printed and the session keeps exactly what was shown. Errors print one line."""
    reply = pieces = None
    try:
        with _ctrl_c_as_flag() as stop:
            reply = session.send(text)
            if stop.is_set():
                raise KeyboardInterrupt
            for n in reply.notices:
                _notice(n)
            pieces = reply.pieces(stop.is_set)
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:  # before the answer started, or a second Ctrl-C
        if pieces is None:
            typer.echo()
            _notice("interrupted before the answer started")
            return
        pieces.close()  # type: ignore[attr-defined]  # records the turn now, whatever was running when Ctrl-C arrived
    except SpecexecError as e:
        if reply is not None:
            sys.stdout.write("\n")
        _error(e)
        return
    assert reply is not None
    sys.stdout.write("\n")
    sys.stdout.flush()
    if reply.interrupted or not reply.done:
        kept = "the partial answer stays in the history" if reply.text else "nothing was generated; turn dropped"
        _notice(f"interrupted: {kept}")
    elif not quiet and reply.result is not None:
        typer.secho(f"[{summary_line(reply.result.stats)}]", dim=True, err=True)


def command(session: ChatSession, name: str, arg: str) -> bool:
    """Run a /command; False means leave the REPL."""
    if name in ("quit", "exit", "bye"):
        return False
    if name == "help":
        typer.echo(HELP)
    elif name == "reset":
        session.reset()
        _notice("conversation cleared")
    elif name == "stats":
        _stats(session)
    elif name == "system":
        if not arg:
            typer.echo(f"system prompt: {session.system!r}" if session.system else "no system prompt")
        else:
            session.set_system(arg)
            _notice("system prompt set; conversation cleared")
    elif name == "save":
        if not arg:
            _error("usage: /save FILE")
        else:
            try:
                _notice(f"transcript saved to {session.save(arg)}")
            except SpecexecError as e:
                _error(e)
    else:
        _error(f"unknown command /{name}; /help lists the commands")
    return True


def _stats(session: ChatSession) -> None:
    stats = session.last_stats
    if stats is None:
        typer.echo("no completed answer yet")
        return
    if session.turns and session.turns[-1].interrupted:
        _notice("the last answer was interrupted; these are the stats of the last completed one")
    typer.echo("\n".join(format_stats(stats)))


def _notice(message: str) -> None:
    typer.secho(f"[{message}]", fg="yellow", err=True)


def _error(message: object) -> None:
    text = user_message(message) if isinstance(message, SpecexecError) else message  # settings named as flags
    typer.secho(f"error: {text}", fg="red", err=True)
