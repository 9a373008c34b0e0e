"""The arm a policy chooses (specexec.steps.record.Arm): validated, labelled as users read it, ordered as the
policies' neighbours by size expect; and the costs cache's code version, taken over the whole package."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import specexec
from specexec.policy import code_version
from specexec.steps.record import PLAIN, Arm, Stats, StepInfo


def test_arms_are_validated():
    for kind, size in (("plain", 1), ("chain", 0), ("tree", 0), ("heads", -1), ("beam", 4)):
        with pytest.raises(ValueError):
            Arm(kind, size)  # type: ignore[arg-type]
    assert Arm("plain") == PLAIN == Arm.nodes(0) and Arm.nodes(8) == Arm("tree", 8)


@pytest.mark.parametrize(
    "arm, label, js",
    [(PLAIN, "0", 0), (Arm("chain", 3), "-3", -3), (Arm("tree", 8), "8", 8), (Arm("heads", 4), "heads:4", "heads:4")],
)
def test_labels_and_json_are_the_users(arm, label, js):
    assert arm.label == label == str(arm) and arm.json() == js
    assert Arm.parse(label) == arm == Arm.parse(js)


def test_arms_sort_chains_longest_first_then_plain_trees_and_head_trees():
    arms = [Arm("heads", 1), Arm("tree", 8), PLAIN, Arm("chain", 2), Arm("tree", 4), Arm("chain", 10)]
    assert [a.label for a in sorted(arms)] == ["-10", "-2", "0", "4", "8", "heads:1"]


def test_stats_json_names_arms_by_label():
    s = Stats(method="specexec")
    for arm in (Arm("chain", 3), Arm("chain", 3), PLAIN, Arm("heads", 2)):
        s.add(StepInfo(arm, (), 1, 0.0, 0.01, 0, tokens=(5,)))
    d = s.to_json()
    assert d["budgets"] == {"-3": 2, "0": 1, "heads:2": 1} and d["budget"] == -3
    assert list(d)[: list(d).index("budget") + 2][-2:] == ["budget", "budgets"], "field order kept"


def test_code_version_hashes_every_source_of_the_package():
    root = Path(specexec.__file__).resolve().parent
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c") and p.is_file()):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    assert code_version() == digest.hexdigest()[:16]
