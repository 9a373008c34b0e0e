"""``specexec generate``: one prompt in, streamed text (or one JSON object) out."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace

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
    calib = f", cost measurement {s['costs_s']:.2f}s" if s.get("costs_s") else ""
    return (
        f"[{s['method']}{extra}] {s['new_tokens']} tokens in {s['steps']} steps "
        f"({s['tokens_per_step']:.2f} tok/step), {s['tokens_per_s']:.2f} tok/s, "
        f"draft {s['draft_s']:.2f}s, target {s['target_s']:.2f}s, prefill {s['prefill_s']:.2f}s{calib}, "
        f"wall {s['wall_s']:.2f}s"
    )


@o.shared_options(defaults={"max_new_tokens": 256})
def generate(
    shared: o.Shared,
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (raw unless --chat); '-' reads stdin."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    as_json: bool = o.as_json(),
    samples: int = typer.Option(
        1,
        "--samples",
        help="Draw N independent samples in one run (models load once); sample i uses seed + i "
        "when --seed is given. With --json and N > 1: JSON Lines, one object per sample per line.",
        rich_help_panel=o.ADVANCED,
    ),
) -> None:
    """Generate a continuation of one prompt.

    With the default target and no --draft, the demo draft is used (SpecExec); --draft none decodes plainly.
    """
    s = shared
    setup_logging(s.verbose, s.quiet)

    def run() -> None:
        # everything that needs no model is checked first: a bad option never costs a model load
        text = o.prompt_text(prompt)
        samp = s.sampling_config()
        tree = s.tree_config()
        chain_cfg = s.chain_config()
        model = s.model_options()
        if samples < 1:
            raise ConfigError("samples", samples, "must be >= 1")
        show = not s.quiet and not as_json
        engine = s.load(model, tree, show=show)
        status = o.spinner(not show)
        uses_tree = (s.method or ("specexec" if engine.draft is not None else "ar")) == "specexec"
        first_label = "measuring step costs for --budget auto" if uses_tree and tree.auto else "reading the prompt"
        for i in range(samples):
            samp_i = replace(samp, seed=None if s.seed is None else s.seed + i)
            if samples > 1 and not as_json:
                sys.stdout.write(f"----- sample {i + 1} of {samples} -----\n")
            g = engine.stream(
                text, s.max_new_tokens, method=s.method, sampling_cfg=samp_i, tree=tree, chain=chain_cfg, chat=chat
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
                if not s.quiet:
                    typer.echo(stats_line(g.result.stats.to_json()), err=True)

    guarded(run, s.verbose)
