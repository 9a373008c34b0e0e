"""``specexec doctor``: this machine's GPU/RAM/CPU/bandwidths/versions and a placement recommendation for a target.

Parsing and printing only; the measurements and the recommendation live in :mod:`specexec.doctor`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from specexec.cli import options as o
from specexec.cli.common import guarded, setup_logging
from specexec.errors import ConfigError

GB = 1e9


def doctor(
    target: str | None = typer.Option(
        None, "--target", "-t", help="Recommend a placement for this model (alias, HF id or path; config.json only)."
    ),
    draft: str | None = typer.Option(
        None,
        "--draft",
        "-d",
        help="Charge this draft to the plan: on a GPU, resident target layers for it in 16-bit, int8 and nf4, and "
        "which --draft-dtype auto loads. 'self': the target's own weights in nf4 (what --draft self loads on a GPU). "
        "'auto': the draft --draft auto picks. Without it the report still says which draft auto would pick.",
    ),
    context: int = typer.Option(4096, "--context", help="Context the recommendation sizes the KV cache for."),
    disk_mb: int = typer.Option(256, "--disk-mb", help="Size of the disk read test in MiB (0 skips it)."),
    cache_dir: Path | None = o.option("cache_dir"),
    remeasure: bool = typer.Option(
        False,
        "--remeasure",
        help="Drop the cached one-time measurements (CPU dtype and weight formats, pass costs) so they are measured "
        "again: with --target on a CPU, its probes (and its auto draft's) right away; the rest at the next start.",
    ),
    as_json: bool = o.as_json(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No spinner."),
    verbose: bool = o.option("verbose"),
) -> None:
    """Check this machine (GPU, memory, bandwidths, versions) and recommend how to run a target on it."""
    setup_logging(verbose, quiet)

    def run() -> None:
        from specexec.doctor import run_doctor

        if disk_mb < 0:
            raise ConfigError("disk_mb", disk_mb, "must be >= 0")
        if draft is not None and target is None:
            raise ConfigError("draft", draft, "needs --target (the draft is planned beside a target)")
        with o.spinner(quiet or as_json)("measuring this machine"):
            report = run_doctor(
                target, draft, context=context, disk_mb=disk_mb, home=cache_dir, remeasure_probes=remeasure
            )
        if as_json:
            typer.echo(json.dumps(report.to_json()))
        else:
            _print(report)

    guarded(run, verbose)


def _print(report) -> None:
    from rich.console import Console
    from rich.table import Table

    s = report.system
    table = Table(title="specexec doctor", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    if s.gpu:
        g = s.gpu
        table.add_row("GPU", g.name)
        table.add_row("VRAM", f"{g.vram_free / GB:.1f} GB free of {g.vram_total / GB:.1f} GB")
        table.add_row("host→GPU pinned", _gbps(g.pinned_h2d_gbps))
        table.add_row("host→GPU pageable", _gbps(g.pageable_h2d_gbps))
        if g.note:
            table.add_row("", g.note)
    else:
        table.add_row("GPU", s.cuda_note)
    table.add_row("RAM", f"{s.ram_available / GB:.1f} GB available of {s.ram_total / GB:.1f} GB")
    table.add_row("CPU", f"{s.cpu_model} ({s.cpu_cores} cores, {s.cpu_threads} threads)")
    if s.cpu_kernels:
        table.add_row("CPU kernels", s.cpu_kernels)
    if s.disk:
        table.add_row("disk read", f"{_gbps(s.disk.read_gbps)} ({s.disk.method}) in {s.disk.directory}")
        if s.disk.note:
            table.add_row("", s.disk.note)
    table.add_row("versions", ", ".join(f"{k} {v or 'not installed'}" for k, v in s.versions.items()))
    console = Console()
    console.print(table)
    if report.recommendation:
        _print_recommendation(console, report.recommendation)
    _print_probes(console, report)


def _print_probes(console, report) -> None:
    """The cached one-time measurements: what each chose, when, and whether the machine was busy then."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="cached measurements", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    if report.remeasured:
        table.add_row("--remeasure", report.remeasured)
    for p in report.probes:
        flag = " (stale)" if p.stale else " (provisional)" if p.provisional else ""
        table.add_row(p.kind + flag, escape(p.line.split(": ", 1)[-1]))
    if not report.probes:
        table.add_row("", "none yet (the first load on a CPU, and the first --budget auto run, measure them)")
    console.print(table)


def _print_recommendation(console, r) -> None:
    from rich.table import Table

    table = Table(title=f"recommendation for {r.target}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    if r.draft_choice:
        table.add_row("draft (auto)", r.draft_choice.removeprefix("draft: "))
    if r.params is None:
        table.add_row("", r.note or "no recommendation")
        console.print(table)
        return
    table.add_row(
        "model",
        f"{r.params / 1e9:.2f} B parameters, {r.num_layers} layers "
        f"({r.layer_gb_bf16:.3f} GB/layer bf16, {r.layer_gb_nf4:.3f} GB/layer nf4)",
    )
    if r.resident_layers is None:  # nothing fits: the notes say why
        table.add_row("offload tier", r.tier)
        for note in r.notes:
            table.add_row("note", note)
        console.print(table)
        return
    table.add_row("dtype", r.dtype)
    table.add_row("offload tier", r.tier)
    table.add_row(
        "resident layers",
        f"{r.resident_layers} of {r.num_layers} ({r.streamed_layers} streamed, "
        f"{r.streamed_gb_per_pass:.2f} GB per pass)",
    )
    table.add_row("floor per target pass", f"{r.floor_s_per_pass:.3f} s at {r.bandwidth}")
    for note in r.notes:
        table.add_row("note", note)
    console.print(table)


def _gbps(v: float | None) -> str:
    return f"{v:.2f} GB/s" if v is not None else "n/a"
