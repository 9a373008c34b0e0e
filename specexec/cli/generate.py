"""``specexec generate``: one prompt in, streamed text (or one JSON object) out."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import typer

from specexec.cli import options as o
from specexec.cli.common import guarded, setup_logging
from specexec.cli.options import DEMO_DRAFT, DEMO_TARGET, tree_config  # noqa: F401  (tree_config: used by tests)
from specexec.errors import ConfigError


def chain_pieces(first: str | None, rest: Iterator[str]) -> Iterator[str]:
    """The first text piece (already taken, None if there was none), then the rest."""
    if first is not None:
        yield first
        yield from rest


def stats_line(stats: dict) -> str:
    s = stats
    auto = "auto→" if s.get("budget_auto") else ""
    extra = f" budget={auto}{s['budget']}" if s.get("budget") else (f" gamma={s['gamma']}" if s.get("gamma") else "")
    calib = f", calibration {s['calibration_s']:.2f}s" if s.get("calibration_s") else ""
    return (
        f"[{s['method']}{extra}] {s['new_tokens']} tokens in {s['steps']} steps "
        f"({s['tokens_per_step']:.2f} tok/step), {s['tokens_per_s']:.2f} tok/s, "
        f"draft {s['draft_s']:.2f}s, target {s['target_s']:.2f}s, prefill {s['prefill_s']:.2f}s{calib}, "
        f"wall {s['wall_s']:.2f}s"
    )


def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (raw unless --chat); '-' reads stdin."),
    target: str = o.target(),
    draft: str | None = o.draft(),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Stop after this many new tokens."),
    method: str | None = o.method(),
    temperature: float = o.temperature(),
    top_p: float = o.top_p(),
    top_k: int = o.top_k(),
    min_p: float = o.min_p(),
    seed: int | None = o.seed(),
    samples: int = typer.Option(
        1,
        "--samples",
        help="Draw N independent samples in one run (models load once); sample i uses seed + i "
        "when --seed is given. With --json and N > 1: JSON Lines, one object per sample per line.",
    ),
    budget: str = o.budget(),
    max_budget: int = o.max_budget(),
    max_beams: int = o.max_beams(),
    max_branch: int = o.max_branch(),
    max_depth: int = o.max_depth(),
    early_stop: bool | None = o.early_stop(),
    ngram_nodes: str = o.ngram_nodes(),
    gamma: int = o.gamma(),
    context: int = o.context(),
    device: str = o.device(),
    dtype: str = o.dtype(),
    offload: str = o.offload(),
    gpu_memory: float | None = o.gpu_memory(),
    target_dtype: str = o.target_dtype(),
    cache_dir: Path | None = o.cache_dir(),
    draft_dtype: str | None = o.draft_dtype(),
    draft_vocab: str | None = o.draft_vocab(),
    draft_layers: str | None = o.draft_layers(),
    as_json: bool = o.as_json("Print exactly one JSON object on stdout (with --samples N: one per line)."),
    quiet: bool = o.quiet(),
    verbose: bool = o.verbose(),
) -> None:
    """Generate a continuation of one prompt.

    With the default target and no --draft, the demo draft is used (SpecExec); --draft none decodes plainly.
    """
    setup_logging(verbose, quiet)

    def run() -> None:
        from specexec.chat import load_engine

        # everything that needs no model is checked first: a bad option never costs a model load
        text = o.prompt_text(prompt)
        samp = o.sampling_config(temperature, top_p, top_k, min_p, seed)
        tree = o.tree_config(
            budget, max_budget, max_beams, max_branch, max_depth, early_stop, ngram_nodes
        )
        chain_cfg = o.chain_config(gamma)
        model = o.model_options(
            target,
            draft,
            device,
            dtype,
            draft_dtype,
            context,
            o.offload_config(offload, gpu_memory, target_dtype, cache_dir),
            method,
            cache_dir,
            draft_vocab_=draft_vocab,
            draft_layers_=draft_layers,
        )
        o.check_method(method, model.draft)
        o.check_max_new_tokens(max_new_tokens, context)
        if samples < 1:
            raise ConfigError("samples", samples, "must be >= 1")
        show = not quiet and not as_json
        o.notices_before_load(model)
        status = o.spinner(not show)
        engine = load_engine(model, tree, progress=show, status=status)
        o.notices_after_load(model, engine)
        uses_tree = (method or ("specexec" if engine.draft is not None else "ar")) == "specexec"
        first_label = "measuring step costs for --budget auto" if uses_tree and tree.auto else "reading the prompt"
        for i in range(samples):
            samp_i = replace(samp, seed=None if seed is None else seed + i)
            if samples > 1 and not as_json:
                sys.stdout.write(f"----- sample {i + 1} of {samples} -----\n")
            g = engine.stream(
                text, max_new_tokens, method=method, sampling_cfg=samp_i, tree=tree, chain=chain_cfg, chat=chat
            )
            pieces = iter(g)
            with status(first_label if i == 0 else "reading the prompt"):  # until the first text arrives
                first = next(pieces, None)
            for piece in chain_pieces(first, pieces):
                if not as_json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            assert g.result is not None
            if as_json:
                sys.stdout.write(json.dumps(g.result.to_json()) + "\n")
                sys.stdout.flush()
            else:
                sys.stdout.write("\n")
                if not quiet:
                    typer.echo(stats_line(g.result.stats.to_json()), err=True)

    guarded(run, verbose)
