"""``specexec cache list`` / ``specexec cache rm NAME|--all``: what specexec keeps on disk (see
:mod:`specexec.loading.cache`).

Parsing and printing only.
"""

from __future__ import annotations

from pathlib import Path

import typer

from specexec.cli import options as o
from specexec.cli.common import guarded, setup_logging

GB = 1e9

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="List and remove specexec's caches (models, offload layer caches, wheels).",
)


@app.command("list")
def list_(cache_dir: Path | None = o.option("cache_dir")) -> None:
    """Each cache entry with its size and path."""
    setup_logging(False)

    def run() -> None:
        from specexec.loading import cache, hub

        items = cache.entries(cache_dir)
        root = hub.cache_home(cache_dir)
        if not items:
            typer.echo(f"the cache is empty ({root})")
            return
        width = max(len(e.name) for e in items)
        for e in items:
            typer.echo(f"{e.name:<{width}}  {e.size / GB:7.2f} GB  {e.kind:<14}  {e.path}")
        typer.echo(f"{'total':<{width}}  {sum(e.size for e in items) / GB:7.2f} GB  in {root}")

    guarded(run)


@app.command("rm")
def rm(
    names: list[str] | None = typer.Argument(None, help="Entries to remove (as `specexec cache list` names them)."),
    all_: bool = typer.Option(False, "--all", help="Remove every entry."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    cache_dir: Path | None = o.option("cache_dir"),
) -> None:
    """Remove cache entries (asks first unless --yes)."""
    setup_logging(False)

    def run() -> None:
        from specexec.errors import SpecexecError
        from specexec.loading import cache

        if all_ == bool(names):
            raise SpecexecError("give entry names or --all (not both)")
        items = cache.entries(cache_dir) if all_ else [cache.find(n, cache_dir) for n in names or []]
        if not items:
            typer.echo("nothing to remove: the cache is empty")
            return
        total = sum(e.size for e in items) / GB
        if not yes:
            listing = ", ".join(e.name for e in items)
            if not typer.confirm(f"remove {listing} ({total:.2f} GB)?", default=False):
                typer.echo("nothing removed")
                raise typer.Exit(1)
        for e in items:
            cache.remove(e)
        typer.echo(f"removed {len(items)} entr{'y' if len(items) == 1 else 'ies'} ({total:.2f} GB)")

    guarded(run)
