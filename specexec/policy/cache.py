"""The measured costs' cache: a key per machine, code and model pair, the files, and when to measure again."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import platform
from pathlib import Path

from specexec import quiet
from specexec.policy.gpu import AutoBudget

log = logging.getLogger(__name__)


def costs_key(*parts: object) -> str:
    """A stable key for measured pass costs: machine, versions, the package's code, model shapes and dtypes, tree
    limits. Costs measured by other code (an upgrade, a new kernel: a pass may cost half as much, and differently
    by size) are measured again, not read."""
    import torch

    blob = json.dumps(
        [
            platform.machine(),
            platform.processor(),
            torch.__version__,
            torch.get_num_threads(),
            code_version(),
            *[repr(p) for p in parts],
        ],
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@functools.cache
def code_version() -> str:
    """A digest of the package's Python and C sources (what a pass runs): every file under the ``specexec``
    package root."""
    root = Path(__file__).resolve().parents[1]  # specexec/policy/cache.py -> specexec/
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c") and p.is_file()):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def load_costs(path: Path) -> tuple[dict[int, float], dict[int, float]] | None:
    """A cached (target seconds by size, draft seconds by beams), or None when absent, unreadable, or to be measured
    again: taken while the machine was busy (provisional), or contradicted by run-time figures (stale)."""
    try:
        d = json.loads(path.read_text())
        if d.get("provisional") or d.get("stale"):
            return None
        return (
            {int(k): float(v) for k, v in d["target_s"].items()},
            {int(k): float(v) for k, v in d["draft_pass_s"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_costs(
    path: Path, target_s: dict[int, float], draft_pass_s: dict[int, float], load: quiet.Load | None = None
) -> None:
    """Write measured pass costs with how they were measured (``load``: a busy machine's figures are provisional,
    measured again at the next start). Best effort: an unwritable cache only costs a measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = quiet.stamp(load) if load is not None else {}
        path.write_text(json.dumps({"target_s": target_s, "draft_pass_s": draft_pass_s, **extra}))
    except OSError as e:
        log.info("pass costs not cached (%s)", e)


def drifted(policy: AutoBudget) -> bool:
    """Whether the steps measured since the start-up measurement disagree with it by more than the config's
    ``drift`` (e.g. the machine was busy while measuring): then the costs are measured again before the next
    generation."""
    c = policy.config
    if len(policy.history) < c.explore_every:  # its scales have seen a round of steps
        return False
    lim = math.log(c.drift)
    return abs(math.log(policy._target_scale)) > lim or abs(math.log(policy._draft_scale)) > lim
