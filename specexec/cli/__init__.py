"""The ``specexec`` command line (Typer). Parsing only: options become configs, the work happens elsewhere."""

from __future__ import annotations

import typer

from specexec.cli import generate as _generate
from specexec.cli.common import run_cli

app = typer.Typer(
    name="specexec",
    help="Exact speculative decoding (SpecExec draft trees) for big models on one GPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Exact speculative decoding (SpecExec draft trees) for big models on one GPU."""


app.command("generate")(_generate.generate)

try:  # sub-apps written in their own modules
    from specexec.cli.models import app as _models_app

    app.add_typer(_models_app, name="models", help="List and pull models (aliases, demo pair).")
except ImportError:  # pragma: no cover - during development only
    pass


def main() -> None:
    run_cli(app)
