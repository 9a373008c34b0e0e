"""The ``specexec`` command line (Typer). Parsing only: options become configs, the work happens elsewhere."""

from __future__ import annotations

import typer

from specexec.cli import generate as _generate
from specexec.cli.common import OneLineUsageErrors, run_cli

app = typer.Typer(
    cls=OneLineUsageErrors,
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

from specexec.cli.models import app as _models_app  # noqa: E402

app.add_typer(_models_app, name="models", help="List and pull models (aliases, demo pair).")

from specexec.cli.cache import app as _cache_app  # noqa: E402
from specexec.cli.heads import app as _heads_app  # noqa: E402

app.add_typer(_cache_app, name="cache", help="List and remove specexec's caches (models, layer caches, wheels).")
app.add_typer(_heads_app, name="heads", help="Train Medusa-style heads for a target (--draft heads).")

# commands that live in their own modules (each module defines one function of that name)
for _name in ("chat", "doctor", "bench", "serve", "export"):
    try:
        _mod = __import__(f"specexec.cli.{_name}", fromlist=[_name])
    except ModuleNotFoundError as _e:  # not written yet
        if _e.name != f"specexec.cli.{_name}":
            raise
        continue
    app.command(_name)(getattr(_mod, _name))


def main() -> None:
    run_cli(app)
