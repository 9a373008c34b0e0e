"""Cost curves: seconds by pass size, measured at a few sizes and interpolated between them."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# target pass sizes timed once for the CPU policy's trimming and catch-ups (the rows a machine is measured at)
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
TARGET_SIZES = (1, 64, 256, 1024, 2048)  # the cost model's target pass sizes (tokens in the pass)
DRAFT_BEAMS = (1, 16, 64, 128)  # the cost model's draft pass sizes (beams)


def ema(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new


def interp(points: dict[int, float], x: float) -> float:
    """Piecewise-linear interpolation over measured (size → seconds), linear extrapolation at the ends."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if x <= xs[0]:
        i = 1
    elif x >= xs[-1]:
        i = len(xs) - 1
    else:
        i = bisect.bisect_left(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-6)


def measure_costs(
    time_target: Callable[[int], float], time_draft: Callable[[int], float], max_budget: int, max_beams: int
) -> tuple[dict[int, float], dict[int, float]]:
    """Measure target pass seconds at a few sizes and draft pass seconds at a few beam counts.

    Sizes grow geometrically; once a pass costs more than 3x the smallest (compute-bound, e.g. on a CPU) the
    rest is extrapolated linearly instead of measured, so the measurement stays short on slow machines.
    """
    target: dict[int, float] = {}
    for size in TARGET_SIZES:
        if size > max_budget + 1 and size != 1:
            break
        target[size] = time_target(size)
        if target[size] > 3 * target[1] and size >= 64:
            break
    draft: dict[int, float] = {}
    for beams in DRAFT_BEAMS:
        if beams > max_beams and beams != 1:
            break
        draft[beams] = time_draft(beams)
    log.info("auto budget pass costs: target %s, draft %s", target, draft)
    return monotone(target), monotone(draft)


def monotone(points: dict[int, float]) -> dict[int, float]:
    """Timing noise must not make a bigger pass look cheaper: running maximum over increasing sizes."""
    out, top = {}, 0.0
    for k in sorted(points):
        top = max(top, points[k])
        out[k] = top
    return out
