"""``specexec bench``: methods x budgets over a prompt set, as a table, JSON and a plot.

Parsing and printing only; :mod:`specexec.bench` runs it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

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
    quality: Path | None = typer.Option(
        None,
        "--quality",
        help="Instead of speed: the perplexity of the target in the chosen weight format (--target-dtype) on this "
        "UTF-8 text, and its top-1 agreement and mean KL against the same checkpoint dense (fp32 on a CPU, "
        "--dtype on a GPU), as llama-perplexity scores chunks: each chunk's second half given its first.",
    ),
    as_json: bool = o.as_json(),
    gammas: str = typer.Option("2,4", "--gammas", help="Chain lengths to try.", rich_help_panel=o.ADVANCED),
    num_prompts: int = typer.Option(
        8, "--num-prompts", help="How many built-in prompts (code and prose) to use.", rich_help_panel=o.ADVANCED
    ),
    plot_path: Path | None = typer.Option(
        None, "--plot", help="Write a PNG plot (needs matplotlib).", rich_help_panel=o.ADVANCED
    ),
    quality_chunk: int = typer.Option(
        512, "--quality-chunk", help="--quality: tokens per chunk.", rich_help_panel=o.ADVANCED
    ),
    quality_tokens: int = typer.Option(
        8192,
        "--quality-tokens",
        help="--quality: score at most about this many tokens (whole chunks) of a long text.",
        rich_help_panel=o.ADVANCED,
    ),
) -> None:
    """Benchmark ar / chain / specexec over a prompt set (tokens/s, tokens per step, speedup, exactness).

    With the default target and no --draft, the demo draft is used; --draft none benchmarks ar alone.
    --quality FILE measures the target's weight format instead (no draft).
    """
    s = shared
    setup_logging(s.verbose, s.quiet)

    def run() -> None:
        if quality is not None:
            _quality(s, quality, quality_chunk, quality_tokens, as_json, out)
            return
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
        engine = s.load(model, sizing, show=not s.quiet and not as_json)
        report = _with_progress(
            s.quiet or as_json,
            len(cfg.runs()) * len(prompts),
            lambda step: run_bench(engine, prompts, cfg, s.target, model.draft, on_run=step),
        )
        if as_json:
            typer.echo(json.dumps(report.to_json()))
        else:
            _table(report)
        if out:
            save_json(report, out)
            typer.echo(f"results: {out}", err=True)
        if plot_path:
            plot(report, plot_path)
            typer.echo(f"plot: {plot_path}", err=True)

    guarded(run, s.verbose)


def _quality(s: o.Shared, path: Path, chunk: int, max_tokens: int, as_json: bool, out: Path | None) -> None:
    """``--quality FILE``: the chosen format's perplexity, agreement and KL against the dense reference."""
    from specexec import api
    from specexec import quality as q
    from specexec.config import TreeConfig
    from specexec.errors import SpecexecError
    from specexec.home import cache_home
    from specexec.loading import hub
    from specexec.loading.checkpoint import load_tokenizer, model_dir

    text = q.read_text(path)  # checks that need no model come first
    q.check_sizes(chunk, max_tokens)
    # no draft; the KV cache holds one chunk
    shared = replace(s, draft="none", context=max(chunk, 8), max_new_tokens=1)
    model = shared.model_options()
    show = not s.quiet and not as_json
    spin = o.spinner(not show)
    tokenizer = load_tokenizer(model_dir(hub.resolve(s.target, progress=show, home=s.cache_dir), home=s.cache_dir))
    chunks = q.text_chunks(tokenizer.tokenizer, text, chunk, max_tokens)
    sizing = TreeConfig(budget=1, auto=False, max_beams=1, max_branch=1, max_depth=1)

    def reference(device) -> Any:
        off = replace(model.offload, target_dtype="auto")
        dtype = "fp32" if device.type == "cpu" else model.dtype
        ref = replace(model, device=str(device), dtype=dtype, offload=off)
        return api.load_engine(ref, sizing, progress=show, status=spin)

    home = cache_home(s.cache_dir)
    phase = (lambda name: None) if not show else (lambda name: typer.echo(f"scoring {name}", err=True))
    report = q.compare(
        lambda: shared.load(model, sizing, show=show),
        reference,
        chunks,
        target_dtype=s.target_dtype,
        workdir=home if home.is_dir() else None,  # the log-prob file: on the cache's disk rather than a RAM /tmp
        target=s.target,
        file=str(path),
        on_phase=phase,
    )
    if as_json:
        typer.echo(json.dumps(report.to_json()))
    else:
        _quality_table(report)
    if out:
        try:
            out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        except OSError as e:
            raise SpecexecError(f"cannot write {out}: {e.strerror or e}") from None
        typer.echo(f"results: {out}", err=True)


def _quality_table(report) -> None:
    from rich.console import Console
    from rich.table import Table

    scored = report.rows[0].tokens
    table = Table(
        title=f"{report.target} on {report.device}: {scored} tokens scored in {report.chunks} chunks of "
        f"{report.chunk} ({report.file}); top-1: argmax = the reference's; KL: mean KL(reference || format), nats"
    )
    for col in ("format", "perplexity", "top-1", "KL", "tokens", "s"):
        table.add_column(col, justify="left" if col == "format" else "right", no_wrap=True)
    for r in report.rows:
        table.add_row(
            f"{r.format} (reference)" if r.reference else r.format,
            f"{r.perplexity:.4f}",
            "-" if r.agreement is None else f"{100 * r.agreement:.2f}%",
            "-" if r.kl is None else f"{r.kl:.6f}",
            str(r.tokens),
            f"{r.seconds:.2f}",
        )
    Console().print(table)


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
