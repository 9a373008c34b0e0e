"""``specexec bench``: methods x budgets over a prompt set, as a table, JSON and a plot.

Parsing and printing only; :mod:`specexec.bench` runs it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from specexec.cli import options as o
from specexec.cli.common import guarded, setup_logging


@o.shared_options(omit=("method", "budget", "max_budget", "gamma"), defaults={"context": 2048, "max_new_tokens": 64})
def bench(
    shared: o.Shared,
    methods: str = typer.Option(
        "ar,chain,specexec",
        "--methods",
        help="Comma-separated methods: ar, chain, specexec, ngram, default (what generate/chat run with no "
        "tuning flags); ar always runs.",
    ),
    budgets: str = typer.Option("16,64,256", "--budgets", help="SpecExec tree budgets to try."),
    prompts_file: Path | None = typer.Option(
        None, "--prompts", help='JSONL prompt set: {"prompt": str, "chat": bool?} per line (default: built-in).'
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the results as JSON here."),
    gammas: str = typer.Option("2,4", "--gammas", help="Chain lengths to try.", rich_help_panel=o.ADVANCED),
    num_prompts: int = typer.Option(
        8, "--num-prompts", help="How many built-in prompts (code and prose) to use.", rich_help_panel=o.ADVANCED
    ),
    plot_path: Path | None = typer.Option(
        None, "--plot", help="Write a PNG plot (needs matplotlib).", rich_help_panel=o.ADVANCED
    ),
) -> None:
    """Benchmark ar / chain / specexec over a prompt set (tokens/s, tokens per step, speedup, exactness).

    With the default target and no --draft, the demo draft is used; --draft none benchmarks ar alone.
    """
    s = shared
    setup_logging(s.verbose, s.quiet)

    def run() -> None:
        from specexec.bench import BenchConfig, builtin_prompts, load_prompts, parse_ints, plot, run_bench, save_json
        from specexec.config import TreeConfig

        # everything that needs no model is checked first: a bad option never costs a model load
        cfg = BenchConfig(
            methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
            budgets=parse_ints(budgets, "--budgets"),
            gammas=parse_ints(gammas, "--gammas"),
            max_new_tokens=s.max_new_tokens,
            sampling=s.sampling_config(),
            tree=TreeConfig(
                max_beams=s.max_beams,
                max_branch=s.max_branch,
                max_depth=s.max_depth,
                early_stop=s.early_stop,
                ngram=o.ngram_limit(s.ngram_nodes),
            ),
        )
        prompts = load_prompts(prompts_file) if prompts_file else builtin_prompts(num_prompts)
        model = s.model_options()
        sizing = TreeConfig(budget=max(cfg.budgets), auto=False, max_beams=s.max_beams)  # caches for the largest
        engine = s.load(model, sizing, show=not s.quiet)
        report = _with_progress(
            s.quiet,
            len(cfg.runs()) * len(prompts),
            lambda step: run_bench(engine, prompts, cfg, s.target, model.draft, on_run=step),
        )
        _table(report)
        if out:
            save_json(report, out)
            typer.echo(f"results: {out}", err=True)
        if plot_path:
            plot(report, plot_path)
            typer.echo(f"plot: {plot_path}", err=True)

    guarded(run, s.verbose)


def _with_progress(quiet: bool, total: int, work):
    """Run ``work(step)`` under a rich progress bar (``step(label)`` advances it); plain when quiet."""
    if quiet:
        return work(lambda _label: None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("bench {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as progress:
        task = progress.add_task("warm-up", total=total)
        return work(lambda label: progress.update(task, advance=1, description=label))


def _table(report) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{report.target} + {report.draft or 'no draft'} on {report.device}, "
        f"{report.config['max_new_tokens']} new tokens x {len(report.prompts)} prompts"
    )
    for col in ("method", "budget/γ", "tok/step", "tok/s", "speedup", "draft s", "target s", "≠ ar"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for r in report.rows:
        mism = "n/a" if r.mismatches is None else str(r.mismatches)
        table.add_row(
            r.method,
            "-" if r.param is None else str(r.param),
            f"{r.tokens_per_step:.2f}",
            f"{r.tokens_per_s:.1f}",
            f"{r.speedup:.2f}x" if r.speedup is not None else "-",
            f"{r.draft_s:.2f}",
            f"{r.target_s:.2f}",
            f"[red]{mism}[/red]" if r.mismatches else mism,
        )
    Console().print(table)
    if any(r.mismatches is None for r in report.rows):
        typer.echo("≠ ar: not checked when sampling (exactness holds in distribution, not token for token)", err=True)
