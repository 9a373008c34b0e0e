"""``specexec bench``: methods x budgets over a prompt set, as a table, JSON and a plot.

Parsing and printing only; :mod:`specexec.bench` runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specexec.cli.chat import DEMO_DRAFT, DEMO_TARGET, spinner
from specexec.cli.common import early_stop_option, guarded, setup_logging
from specexec.cli.generate import offload_config


def bench(
    target: str = typer.Option(DEMO_TARGET, "--target", "-t", help="Target model: alias, HF id or local path."),
    draft: Optional[str] = typer.Option(
        None, "--draft", "-d",
        help=f"Draft model; 'none' for no draft. Default: {DEMO_DRAFT} with the default target, else none."),
    methods: str = typer.Option("ar,chain,specexec", "--methods", help="Comma-separated methods (ar always runs)."),
    budgets: str = typer.Option("16,64,256", "--budgets", help="SpecExec tree budgets to try."),
    gammas: str = typer.Option("2,4", "--gammas", help="Chain lengths to try."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="New tokens per prompt."),
    prompts_file: Optional[Path] = typer.Option(
        None, "--prompts", help='JSONL prompt set: {"prompt": str, "chat": bool?} per line (default: built-in).'),
    num_prompts: int = typer.Option(8, "--num-prompts", help="How many built-in prompts (code and prose) to use."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the results as JSON here."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG plot (needs matplotlib)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (then exactness is checked vs ar)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling."),
    max_beams: int = typer.Option(128, "--max-beams", help="SpecExec: nodes expanded per draft pass."),
    max_branch: int = typer.Option(32, "--max-branch", help="SpecExec: children proposed per expanded node."),
    max_depth: int = typer.Option(32, "--max-depth", help="SpecExec: most draft passes per tree."),
    early_stop: Optional[bool] = early_stop_option(),
    context: int = typer.Option(2048, "--context", help="KV cache length (longest prompt + answer)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    dtype: str = typer.Option(
        "auto", "--dtype", help="Compute dtype: auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16."),
    offload: str = typer.Option("auto", "--offload", help="Target placement: auto, none (all on GPU), ram, ssd."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", help="Cap on the GPU memory used, in GB."),
    target_dtype: str = typer.Option("auto", "--target-dtype", help="Target weights: auto, bf16, fp16, nf4."),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype", help="Draft dtype (default: --dtype)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No spinner or progress bar."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Benchmark ar / chain / specexec over a prompt set (tokens/s, tokens per step, speedup, exactness)."""
    setup_logging(verbose, quiet)
    if draft is None and target == DEMO_TARGET:
        draft = DEMO_DRAFT
    if draft is not None and draft.lower() == "none":
        draft = None

    def run() -> None:
        from specexec.bench import BenchConfig, builtin_prompts, load_prompts, parse_ints, plot, run_bench, save_json
        from specexec.chat import ModelOptions, load_engine
        from specexec.config import SamplingConfig, TreeConfig

        cfg = BenchConfig(
            methods=tuple(m.strip() for m in methods.split(",") if m.strip()), budgets=parse_ints(budgets, "--budgets"),
            gammas=parse_ints(gammas, "--gammas"), max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(temperature=temperature, seed=seed),
            tree=TreeConfig(max_beams=max_beams, max_branch=max_branch, max_depth=max_depth,
                            early_stop=early_stop))
        prompts = load_prompts(prompts_file) if prompts_file else builtin_prompts(num_prompts)
        model = ModelOptions(target=target, draft=draft, device=device, dtype=dtype, draft_dtype=draft_dtype,
                             context=context, offload=offload_config(offload, gpu_memory, target_dtype))
        engine = load_engine(model, TreeConfig(budget=max(cfg.budgets), max_beams=max_beams), progress=not quiet,
                             status=spinner(quiet))
        report = _with_progress(quiet, len(cfg.runs()) * len(prompts),
                                lambda step: run_bench(engine, prompts, cfg, target, draft, on_run=step))
        _table(report)
        if out:
            save_json(report, out)
            typer.echo(f"results: {out}", err=True)
        if plot_path:
            plot(report, plot_path)
            typer.echo(f"plot: {plot_path}", err=True)

    guarded(run)


def _with_progress(quiet: bool, total: int, work):
    """Run ``work(step)`` under a rich progress bar (``step(label)`` advances it); plain when quiet."""
    if quiet:
        return work(lambda _label: None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("bench {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
        task = progress.add_task("warm-up", total=total)
        return work(lambda label: progress.update(task, advance=1, description=label))


def _table(report) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report.target} + {report.draft or 'no draft'} on {report.device}, "
                        f"{report.config['max_new_tokens']} new tokens x {len(report.prompts)} prompts")
    for col in ("method", "budget/γ", "tok/step", "tok/s", "speedup", "draft s", "target s", "≠ ar"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for r in report.rows:
        mism = "n/a" if r.mismatches is None else str(r.mismatches)
        table.add_row(r.method, "-" if r.param is None else str(r.param), f"{r.tokens_per_step:.2f}",
                      f"{r.tokens_per_s:.1f}",
                      f"{r.speedup:.2f}x" if r.speedup is not None else "-", f"{r.draft_s:.2f}", f"{r.target_s:.2f}",
                      f"[red]{mism}[/red]" if r.mismatches else mism)
    Console().print(table)
    if any(r.mismatches is None for r in report.rows):
        typer.echo("≠ ar: not checked when sampling (exactness holds in distribution, not token for token)", err=True)
