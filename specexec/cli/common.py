"""What every command shares: option → config conversion, logging set-up, the one-line error handler."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import typer

from specexec.errors import SpecexecError


def run_cli(app: Any) -> None:
    """Run the Typer app; user errors become one line on stderr and a non-zero exit, never a traceback."""
    try:
        app(standalone_mode=True)
    except SpecexecError as e:  # raised outside a command body (rare)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def setup_logging(verbose: bool, quiet: bool = False) -> None:
    level = logging.DEBUG if verbose else (logging.ERROR if quiet else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not verbose:
        for noisy in ("transformers", "huggingface_hub", "accelerate"):
            logging.getLogger(noisy).setLevel(logging.ERROR)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr; return the Exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def guarded(fn: Callable[[], Any]) -> Any:
    """Call ``fn``; translate user errors (SpecexecError, bad config values, Ctrl-C) into clean exits."""
    try:
        return fn()
    except SpecexecError as e:
        raise fail(str(e), e.exit_code) from None
    except ValueError as e:  # config dataclasses validate with ValueError
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    except MemoryError:
        raise fail("out of host memory (RAM): use a smaller model, --offload ssd or a 4-bit target") from None


def early_stop_option() -> Any:
    """``--early-stop/--no-early-stop``, shared by generate, chat and bench (None: the device's default)."""
    return typer.Option(
        None, "--early-stop/--no-early-stop",
        help="SpecExec: stop growing a tree once one more draft pass is expected to cost more time than the tokens "
             "it adds are worth (measured costs); --no-early-stop always grows up to --max-depth levels. "
             "Default: on for a CPU draft, off on a GPU.")
