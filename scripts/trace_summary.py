#!/usr/bin/env python
"""Where a decode step's time goes, from a torch.profiler chrome trace of ``Engine.generate`` (``bench_gpu.py
--profile``): is the draft's growth bound by the host (Python and launches) or by the GPU?

``bench_gpu.py --profile`` marks these host ranges with ``record_function`` (monkeypatched in the script; the
library carries no profiling code): ``step.propose`` (the whole draft phase a step), ``step.verify`` (the
target's pass), ``step.sync`` (the host waiting for the device), ``draft.level`` (one fixed-width level queued),
``draft.pass`` (the draft's forward: a graph replay or eager layers), ``draft.read`` (the host reading a level's
count: it waits for an event there). A kernel belongs to the range its launch (the CUDA runtime call with the same
correlation id) falls in. Reported per step (means over the profiled steps):

* ``propose_ms``: the draft phase's wall time up to the verify's start, the ``sync`` after it included (what
  ``Stats.draft_s`` counts);
* ``gpu_busy_ms``: the union of every kernel's interval inside that window (any stream), split into the draft
  passes' kernels (``gpu_pass_ms``) and the rest (``gpu_book_ms``: top-k, masks, appends, copies);
* ``host_level_ms``: the host's time in ``draft.level`` ranges, of which waiting in ``draft.read``
  (``host_read_ms``) and launching passes (``host_pass_ms``); ``host_sync_ms``: the wait after the last level;
* ``gpu_idle_ms`` = propose - busy: the time the GPU had nothing queued (host-bound when large).

    python scripts/trace_summary.py trace.json.gz      # the summary as JSON
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _load(path: Path) -> list[dict[str, Any]]:
    raw = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()
    with raw as f:
        return json.load(f)["traceEvents"]


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _inside(ranges: list[tuple[float, float]], t: float) -> bool:
    """Whether ``t`` lies in one of the sorted, disjoint ``ranges`` (binary search)."""
    lo, hi = 0, len(ranges)
    while lo < hi:
        mid = (lo + hi) // 2
        if ranges[mid][1] < t:
            lo = mid + 1
        else:
            hi = mid
    return lo < len(ranges) and ranges[lo][0] <= t <= ranges[lo][1]


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-step means (ms) described in the module docstring."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]

    def spans(name: str) -> list[tuple[float, float]]:
        return sorted(
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in xs
            if e.get("name") == name and e.get("cat") in ("user_annotation", "cpu_op", "python_function")
        )

    propose, verify, sync = spans("step.propose"), spans("step.verify"), spans("step.sync")
    levels, passes, reads = spans("draft.level"), spans("draft.pass"), spans("draft.read")
    # the draft window: a propose range up to the start of the verify that follows it (the sync between them
    # is the host waiting for the draft's last kernels)
    windows = []
    for a, b in propose:
        nxt = [v[0] for v in verify if v[0] >= b]
        windows.append((a, min(nxt) if nxt else b))
    launches = {
        e["args"]["correlation"]: float(e["ts"])
        for e in xs
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    gpu = [e for e in xs if e.get("cat") in GPU_CATS]
    out_steps = []
    for a, b in windows:
        in_win = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in gpu]
        in_win = [(max(s, a), min(f, b), e) for s, f, e in in_win if f > a and s < b]
        pass_iv, book_iv = [], []
        for s, f, e in in_win:
            t = launches.get(e.get("args", {}).get("correlation"))
            (pass_iv if t is not None and _inside(passes, t) else book_iv).append((s, f))
        lv = [(s, f) for s, f in levels if a <= s < b]
        out_steps.append(
            {
                "propose_ms": (b - a) / 1e3,
                "gpu_busy_ms": _union(pass_iv + book_iv) / 1e3,
                "gpu_pass_ms": _union(pass_iv) / 1e3,
                "gpu_book_ms": _union(book_iv) / 1e3,
                "levels": len(lv),
                "host_level_ms": sum(f - s for s, f in lv) / 1e3,
                "host_read_ms": sum(f - s for s, f in reads if a <= s < b) / 1e3,
                "host_pass_ms": sum(f - s for s, f in passes if a <= s < b) / 1e3,
                "host_sync_ms": sum(f - s for s, f in sync if a <= s < b) / 1e3,
            }
        )
    n = max(len(out_steps), 1)
    mean = {k: sum(s[k] for s in out_steps) / n for k in (out_steps[0] if out_steps else {})}
    if mean:
        mean["gpu_idle_ms"] = mean["propose_ms"] - mean["gpu_busy_ms"]
    if mean and mean["levels"] > 0:  # fixed-width growth ("dynamic" growth has no levels to divide by)
        lv = mean["levels"]
        mean["per_level"] = {
            k: mean[k] / lv for k in ("gpu_pass_ms", "gpu_book_ms", "host_level_ms", "host_read_ms", "host_pass_ms")
        }
    vv = [f - s for s, f in verify]
    return {
        "steps": len(out_steps),
        "mean": mean,
        "verify_host_ms": sum(vv) / max(len(vv), 1) / 1e3,
        "kernels": len(gpu),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: trace_summary.py TRACE.json[.gz]", file=sys.stderr)
        return 2
    try:
        events = _load(Path(args[0]))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read a chrome trace from {args[0]}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summarize(events), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
