"""``specexec heads train``: self-distil Medusa-style heads for a target (parsing and progress only; the work is
in :mod:`specexec.propose.heads`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from specexec.cli import options as o
from specexec.cli.common import fail
from specexec.errors import SpecexecError

app = typer.Typer(
    help="Medusa-style heads: proposals from the target's own hidden state, no draft model (--draft heads).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def training_format(cfg: Any) -> tuple[Any, str | None]:
    """A CPU's compute dtype and weight format for reading text with the target (many rows a pass): bf16 where
    this CPU's probe measures bf16 products faster than fp32 (native bf16 units), else the 4-bit kernel where it
    builds, else fp32."""
    import torch

    from specexec.formats import q4
    from specexec.loading.cpu_probe import choose_dtype

    if choose_dtype(cfg) == torch.bfloat16:
        return torch.bfloat16, None
    return torch.float32, ("q4" if q4.available() is None else None)


@app.command(
    "train",
    help="Train heads for a target by self-distillation: the frozen target reads local text (default: this "
    "Python's standard library sources and pydoc topics, no download) and the heads learn its own greedy "
    "predictions 2-4 tokens ahead. Saved under the cache dir keyed by the target's weights; a second run "
    "resumes where the last stopped. Runs on CUDA when available.",
)
def train_cmd(
    target: str = typer.Option(o.DEMO_TARGET, "--target", "-t", help="Target model: alias, HF id or local path."),
    data: Path | None = typer.Option(None, "--data", help="A text file or a folder of text files (default: stdlib)."),
    max_minutes: float = typer.Option(20.0, "--max-minutes", help="Stop (and save) after this many minutes."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    cache_dir: Path | None = o.option("cache_dir"),
) -> None:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from specexec.loading import hub
    from specexec.loading.checkpoint import (
        draft_vocab_ids,
        load_model,
        load_tokenizer,
        model_dir,
        parse_device,
        read_config,
    )
    from specexec.propose import heads as h

    if not max_minutes > 0:
        raise fail(f"--max-minutes must be > 0, got {max_minutes}")
    if data is not None and not data.exists():
        raise fail(f"--data: no such file or folder: {data}")
    try:
        path = model_dir(hub.resolve(target, progress=not quiet, home=cache_dir))
        dev = parse_device(device)
        dtype, fmt = torch.bfloat16, None
        if dev.type == "cpu":  # the target's passes over the text are the training's cost: the fastest weights
            dtype, fmt = training_format(read_config(path))
        model = load_model(path, dev, dtype, fmt=fmt)
        tok = load_tokenizer(path)
        ids = draft_vocab_ids(tok, model.cfg.vocab_size, h.VOCAB)
        out = h.heads_path(path, cache_dir)
        texts = h.path_texts(data) if data is not None else h.stdlib_texts()
        cols = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
        with Progress(*cols, console=Console(stderr=True), disable=quiet) as bar:
            task = bar.add_task("training heads", total=1.0, info="")

            def show(state: h.TrainState, done: float) -> None:
                acc = " ".join(f"{a:.0%}" for a in state.acc)
                bar.update(task, completed=done, info=f"{state.tokens} positions, head top-1 agreement {acc}")

            heads, state = h.train(
                model, tok.tokenizer.encode, texts, out, ids, max_minutes, progress=show, key=h.target_key(path)
            )
    except SpecexecError as err:
        raise fail(str(err), err.exit_code) from None
    except KeyboardInterrupt:
        typer.echo("\ninterrupted (what was trained so far is saved every minute)", err=True)
        raise typer.Exit(130) from None
    acc = ", ".join(f"head {k + 1} {a:.0%}" for k, a in enumerate(state.acc))
    typer.echo(f"heads: {out} ({state.chunks} chunks read, {state.steps} steps; top-1 agreement {acc})")
