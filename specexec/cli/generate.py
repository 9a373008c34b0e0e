"""``specexec generate``: one prompt in, streamed text (or one JSON object) out."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import replace

import typer

from specexec.cli import options as o
from specexec.cli.common import guarded, setup_logging
from specexec.cli.options import DEMO_DRAFT, DEMO_TARGET, tree_config  # noqa: F401  (tree_config: used by tests)
from specexec.decoding.constraint import MAX_GRAMMAR_BYTES, MAX_SCHEMA_BYTES, Constraint, ConstraintError
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
    if s.get("forced_tokens"):
        calib += f", {s['forced_tokens']} forced by the grammar"
    return (
        f"[{s['method']}{extra}] {s['new_tokens']} tokens in {s['steps']} steps "
        f"({s['tokens_per_step']:.2f} tok/step), {s['tokens_per_s']:.2f} tok/s, "
        f"draft {s['draft_s']:.2f}s, target {s['target_s']:.2f}s, prefill {s['prefill_s']:.2f}s{calib}, "
        f"wall {s['wall_s']:.2f}s"
    )


def constraint_option(json_schema: str | None, grammar: str | None, regex: str | None) -> Constraint | None:
    """The constraint the options name (at most one), compiled, so a bad one is refused before a model loads."""
    given = [(f, v) for f, v in (("--json-schema", json_schema), ("--grammar", grammar), ("--regex", regex)) if v]
    if not given:
        return None
    if len(given) > 1:
        raise ConstraintError(f"{given[0][0]} and {given[1][0]} cannot be combined: give one constraint")
    flag, value = given[0]
    try:
        if flag == "--regex":
            c = Constraint.regex(value)
        else:
            limit = MAX_SCHEMA_BYTES if flag == "--json-schema" else MAX_GRAMMAR_BYTES
            try:
                if value == "-":
                    text = o.prompt_text(value)
                else:
                    with open(value, encoding="utf-8") as f:
                        text = f.read(limit + 1)  # a longer file is refused by its size: never read it all
                        if len(text) > limit:
                            what = "JSON schema" if flag == "--json-schema" else "grammar"
                            size = os.fstat(f.fileno()).st_size
                            raise ConstraintError(f"the {what} is {size:,} bytes; at most {limit:,} are allowed")
            except OSError as e:
                raise ConstraintError(f"{value}: {e.strerror or e}") from None
            except UnicodeDecodeError:
                raise ConstraintError(f"{value}: not UTF-8 text") from None
            c = Constraint.json_schema(text) if flag == "--json-schema" else Constraint.grammar(text)
        c.check()
    except ConstraintError as e:
        raise ConstraintError(f"{flag} {e}" if str(e).startswith(value) else f"{flag}: {e}") from None
    return c


def constraint_flag(json_schema: str | None, grammar: str | None, regex: str | None) -> str:
    return "--json-schema" if json_schema else ("--grammar" if grammar else "--regex")


@o.shared_options(defaults={"max_new_tokens": 256})
def generate(
    shared: o.Shared,
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (raw unless --chat); '-' reads stdin."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    as_json: bool = o.as_json(),
    json_schema: str | None = typer.Option(
        None,
        "--json-schema",
        metavar="FILE",
        help="Constrain the output to JSON that validates against the JSON Schema in FILE (exactly as constrained "
        "plain decoding would write it, with any method).",
    ),
    grammar: str | None = typer.Option(
        None,
        "--grammar",
        metavar="FILE",
        help="Constrain the output to the grammar in FILE: GBNF as llama.cpp writes it (root ::= ...) or "
        "llguidance's Lark (start: ...).",
        rich_help_panel=o.ADVANCED,
    ),
    regex: str | None = typer.Option(
        None,
        "--regex",
        metavar="PATTERN",
        help="Constrain the output to text that matches PATTERN as a whole.",
        rich_help_panel=o.ADVANCED,
    ),
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
        constraint = constraint_option(json_schema, grammar, regex)
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
                text,
                s.max_new_tokens,
                method=s.method,
                sampling_cfg=samp_i,
                tree=tree,
                chain=chain_cfg,
                chat=chat,
                constraint=constraint,
            )
            pieces = iter(g)
            try:
                with status(first_label if i == 0 else "reading the prompt"):  # until the first text arrives
                    first = next(pieces, None)
                for piece in chain_pieces(first, pieces):
                    if not as_json:
                        sys.stdout.write(piece)
                        sys.stdout.flush()
            except ConstraintError as e:  # the grammar failed part-way: the text so far stays, one error line
                if not as_json:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                raise ConstraintError(f"{constraint_flag(json_schema, grammar, regex)}: {e}") from None
            assert g.result is not None
            if as_json:
                sys.stdout.write(json.dumps(g.result.to_json()) + "\n")
                sys.stdout.flush()
            else:
                sys.stdout.write("\n")
                if not s.quiet:
                    typer.echo(stats_line(g.result.stats.to_json()), err=True)

    guarded(run, s.verbose)
