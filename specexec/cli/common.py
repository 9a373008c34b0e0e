"""What every command shares: option → config conversion, logging set-up, the one-line error handler."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
import typer
from typer.core import TyperGroup

from specexec.errors import SpecexecError


def run_cli(app: Any) -> None:
    """Run the Typer app; user errors become one line on stderr and a non-zero exit, never a traceback."""
    try:
        app(standalone_mode=True)
    except SpecexecError as e:  # raised outside a command body (rare)
        print(f"error: {user_message(e)}", file=sys.stderr)
        sys.exit(e.exit_code)


class OneLineUsageErrors(TyperGroup):
    """The command group whose usage errors (an unknown option or command, a value of the wrong type) print one
    ``error:`` line on stderr and exit 2, as every other error a user can cause does, instead of Typer's usage
    box. A bare command group still prints its help."""

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with _one_line_usage_errors():
            return super().invoke(ctx)


# Typer's command classes derive from click's, or (newer Typer) from its own copy of click: the usage errors
# they raise are that module's
_CLICK = sys.modules[TyperGroup.__mro__[1].__module__]
_NO_ARGS_IS_HELP: Any = getattr(_CLICK, "NoArgsIsHelpError", ())  # a bare group's help (click >= 8.2)


@contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    try:
        yield
    except _NO_ARGS_IS_HELP:
        raise
    except _CLICK.UsageError as e:
        message = " ".join(e.format_message().split())
        if e.ctx is not None:
            message = f"{message.rstrip('.')}; see '{e.ctx.command_path} --help'"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(e.exit_code) from None


def setup_logging(verbose: bool, quiet: bool = False) -> None:
    level = logging.DEBUG if verbose else (logging.ERROR if quiet else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not verbose:
        for noisy in ("transformers", "huggingface_hub", "accelerate"):
            logging.getLogger(noisy).setLevel(logging.ERROR)


def user_message(e: SpecexecError) -> str:
    """The error's message with every setting named by its CLI flag (``context`` → ``--context``)."""
    from specexec.cli.options import FLAGS

    return e.render(FLAGS)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr; return the Exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


INTERNAL_ERROR_EXIT = 1  # a bug (user errors exit 2, Ctrl-C 130)


def guarded(fn: Callable[[], Any], verbose: bool = False) -> Any:
    """Call ``fn``; user errors (:class:`SpecexecError`, Ctrl-C, host out of memory) become clean exits.

    Anything else is a bug: without ``verbose`` one ``error: internal error ...`` line that points to ``-v``;
    with it the exception propagates and Python prints the full traceback.
    """
    try:
        return fn()
    except SpecexecError as e:
        raise fail(user_message(e), e.exit_code) from None
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    except MemoryError:
        raise fail("out of host memory (RAM): use a smaller model, --offload ssd or a 4-bit target") from None
    except (typer.Exit, typer.Abort, click.exceptions.ClickException):
        raise
    except Exception as e:
        if verbose:
            raise
        detail = str(e).splitlines()[0] if str(e) else ""
        raise fail(
            f"internal error ({type(e).__name__}{': ' + detail if detail else ''}); this is a bug in "
            "specexec: run again with -v for the traceback and report it",
            INTERNAL_ERROR_EXIT,
        ) from None
