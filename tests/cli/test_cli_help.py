"""``--help`` of generate, chat, bench and serve, read as a user reads it: every command takes the same shared
options, the main panel holds the choices a user makes (at most 20 options) and the tuning knobs sit under
"Advanced"."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from specexec.cli import app

runner = CliRunner()
COMMANDS = ("generate", "chat", "bench", "serve")
MAIN_MAX = 20

# the choices a user makes, shown by every command in the main panel (bench has --budgets instead of --budget)
MAIN = {
    "--target",
    "--draft",
    "--method",
    "--budget",
    "--max-new-tokens",
    "--temperature",
    "--top-p",
    "--top-k",
    "--seed",
    "--device",
    "--offload",
    "--gpu-memory",
    "--target-dtype",
    "--quiet",
    "--verbose",
}
# the shared tuning knobs, under "Advanced"
SHARED_ADVANCED = {
    "--min-p",
    "--context",
    "--dtype",
    "--draft-dtype",
    "--cache-dir",
    "--max-budget",
    "--max-beams",
    "--max-branch",
    "--max-depth",
    "--early-stop",
    "--ngram-nodes",
    "--gamma",
    "--draft-vocab",
    "--invariant",
}
# the commands' own tuning knobs
OWN_ADVANCED = {
    "--samples",
    "--queue",
    "--served-model-name",
    "--max-body-kb",
    "--prefix-cache-gb",
    "--gammas",
    "--num-prompts",
    "--plot",
    "--quality-chunk",
    "--quality-tokens",
    "--grammar",
    "--regex",
}
ADVANCED = SHARED_ADVANCED | OWN_ADVANCED
NOT_IN_BENCH = {"--method", "--budget", "--max-budget", "--gamma"}  # bench sweeps --methods, --budgets, --gammas


def panels(command: str) -> dict[str, list[str]]:
    """Panel title -> the options listed in it, from ``command --help`` (``--help`` itself and the ``--no-`` half of
    an on/off flag, which may wrap onto a line of its own, left out). An option's name starts within four characters
    of the panel's border (after the required mark); a wrapped help line that starts with a flag starts further in."""
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    out: dict[str, list[str]] = {}
    panel = None
    for line in r.output.splitlines():
        title = re.match(r"\s*╭─ (.+?) ─", line)
        if title:
            panel = title.group(1)
            out[panel] = []
            continue
        opt = re.match(r"\s*│ [ *]{0,3}(--[a-z][a-z0-9-]*)", line)
        if opt and panel is not None and opt.group(1) != "--help" and not opt.group(1).startswith("--no-"):
            out[panel].append(opt.group(1))
    return out


@pytest.mark.parametrize("command", COMMANDS)
def test_main_panel_lists_at_most_20_options(command):
    main = panels(command)["Options"]
    assert len(main) <= MAIN_MAX, main


@pytest.mark.parametrize("command", COMMANDS)
def test_tuning_knobs_are_under_advanced(command):
    shown = panels(command)
    assert set(shown) == {"Options", "Advanced"}, list(shown)
    assert not ADVANCED & set(shown["Options"]), ADVANCED & set(shown["Options"])
    assert set(shown["Advanced"]) <= ADVANCED, set(shown["Advanced"]) - ADVANCED


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_lists_each_shared_option_once_in_its_panel(command):
    shown = panels(command)
    skip = NOT_IN_BENCH if command == "bench" else set()
    assert sorted(f for f in MAIN - skip if shown["Options"].count(f) != 1) == []
    assert sorted(f for f in SHARED_ADVANCED - skip if shown["Advanced"].count(f) != 1) == []
