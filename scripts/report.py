"""What the counting scripts (bench_overlap, bench_level_width, bench_calibrate) do with their report at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def finish(report: dict[str, Any], out: Path | None) -> int:
    """Write ``report`` as JSON to ``out`` (if given) and return the exit code: 1 where a run was not the target's
    greedy text (``report["all_exact"]`` false), else 0."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    return 0 if report["all_exact"] else 1
