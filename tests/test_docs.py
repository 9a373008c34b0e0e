"""The docs stay short enough to read: README.md is a product page, docs/BENCHMARKS.md holds current results only and
docs/ARCHITECTURE.md describes the code without measurements. The README's results table has at most 6 rows, and
each names the commit it measured (checked against the history where this is a full git checkout)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BUDGETS = {"README.md": 10_000, "docs/BENCHMARKS.md": 15_000, "docs/ARCHITECTURE.md": 20_000}
RESULT_ROWS = 6
# a timing, a throughput or a ratio: what ARCHITECTURE leaves to BENCHMARKS
MEASUREMENT = re.compile(r"\b\d+(\.\d+)?\s?(ms|tok/s|tokens/s|GB/s)\b|\b\d+(\.\d+)?[x×](?!\w)")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def _results_rows() -> list[list[str]]:
    """The data rows of the first table under the README's '## Results' heading, as lists of cells."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert len(table) >= 3, "the README's Results section has no table"
    header, separator, *rows = table
    assert set(separator.replace("|", "").strip()) <= set("-: "), separator
    assert [c.strip() for c in header.strip("|").split("|")][-3:] == ["command", "machine", "commit"], header
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]


@pytest.mark.parametrize("path", sorted(BUDGETS))
def test_each_doc_fits_its_budget(path):
    size = len((ROOT / path).read_bytes())
    assert size <= BUDGETS[path], f"{path} is {size} bytes, over its budget of {BUDGETS[path]}"


def test_architecture_holds_no_measurements():
    hits = [m.group(0) for m in MEASUREMENT.finditer((ROOT / "docs/ARCHITECTURE.md").read_text())]
    assert not hits, f"measurements belong in docs/BENCHMARKS.md: {hits}"


def test_the_readme_keeps_the_ci_test_command():
    assert ".venv/bin/python -m pytest -q" in (ROOT / "README.md").read_text()


def test_the_readme_results_table_is_short_and_each_row_names_a_command_a_machine_and_a_commit():
    rows = _results_rows()
    assert 1 <= len(rows) <= RESULT_ROWS, f"{len(rows)} rows in the README's results table"
    for row in rows:
        command, machine, commit = row[-3:]
        assert command and machine, row
        assert COMMIT.fullmatch(commit), f"not a commit: {commit!r}"


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def test_each_readme_result_names_a_commit_in_the_history():
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone lacks the history")
    for row in _results_rows():
        commit = row[-1]
        assert _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0, f"{commit} is not in git log"
