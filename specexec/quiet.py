"""Whether the machine was busy while a one-time measurement ran: load detection for cached probes.

specexec measures some choices once per machine and caches them (the CPU dtype and matmul orientation, the CPU
weight formats of target and draft: :mod:`specexec.loading.cpu_probe`; the policy's pass costs). Each measurement
interleaves its alternatives and keeps the best of several tries, which absorbs a short busy spell, but not
sustained load: a first run beside a compiler measured a 4-bit draft pass at 43 ms against 7 ms dense (quiet:
0.45 against 1.94 ms) and cached the wrong format. So a measurement runs inside :func:`watch`, which records
over it:

- the process's own scheduling (Linux ``/proc/self/task/*/schedstat``): nanoseconds each of our threads ran and
  nanoseconds it sat runnable in the run queue waiting for a core. The waiting share of that demand is CPU time
  we asked for and did not get. (Plain CPU time against threads x wall overstates the demand: a one-row product
  leaves most of torch's threads idle on a quiet machine.)
- the 1-minute load average (``os.getloadavg``) less our own threads (the process's CPU seconds over the wall
  time: the cores we kept busy on average), against the cores this process may run on.

and calls it busy (:attr:`Load.busy`) when either share exceeds :data:`MARGIN`. A busy measurement's choice is
stored provisional (:func:`stamp`) and measured again at the next start (:func:`needs_measuring`), and replaced
when that start is quiet. The clocks and the load source are parameters, so tests simulate a busy machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# One threshold for both rules: a measurement is trusted while other work took at most this share of what it
# needed (the run-queue share of our threads' demand; the cores other work kept busy). The choices made from the
# measurements decide on margins of 20-25% (cpu_probe: a low-bit format must cost <= 0.75x dense at one row, bf16
# <= 0.8x fp32; the policy's cost drift is 1.5x), so a loss beyond 25% can flip one; below it, the best-of-repeats
# and interleaving the alternatives already absorb it (both alternatives lose alike).
MARGIN = 0.25
# Run-time figures that disagree with a cached measurement by more than this factor either way contradict it
# (the policy's cost cache uses the same factor, ``DRIFT``): the cached entry is marked stale and measured again.
DRIFT = 1.5


@dataclass(frozen=True)
class Sample:
    """One reading of the sources: wall and process CPU seconds, our threads' run and run-queue wait
    nanoseconds (None where the OS does not say), the 1-minute load average (None: unknown)."""

    wall: float
    cpu: float
    run_ns: dict[int, tuple[int, int]] | None = None  # thread id -> (ran, waited) ns
    loadavg: float | None = None


@dataclass(frozen=True)
class Load:
    """What a measurement saw: over ``wall_s`` seconds, the share of our threads' CPU demand that waited for a core
    (None: unknown), the load average, our own average busy cores, and the cores we may use."""

    wall_s: float
    waited: float | None
    loadavg: float | None
    ours: float
    cores: int
    busy: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "busy", bool(self.reasons()))

    @property
    def others(self) -> float | None:
        """Cores other work kept busy on average (the load average less ours), as a share of our cores."""
        if self.loadavg is None:
            return None
        return max(0.0, self.loadavg - self.ours) / max(1, self.cores)

    def reasons(self) -> list[str]:
        out = []
        if self.waited is not None and self.waited > MARGIN:
            out.append(f"our threads waited for a core {self.waited:.0%} of the time they were ready to run")
        others = self.others
        if others is not None and others > MARGIN:
            out.append(f"load average {self.loadavg:.2f} on {self.cores} cores beside our {self.ours:.1f}")
        return out

    def figures(self) -> dict[str, Any]:
        """For a cache entry (JSON)."""
        return {
            "busy": self.busy,
            "wall_s": round(self.wall_s, 3),
            "waited": None if self.waited is None else round(self.waited, 3),
            "loadavg": self.loadavg,
            "ours": round(self.ours, 2),
            "cores": self.cores,
        }


def cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _schedstat(task_dir: Path = Path("/proc/self/task")) -> dict[int, tuple[int, int]] | None:
    """Per thread (ran ns, waited ns) from Linux's schedstat; None where unavailable."""
    out: dict[int, tuple[int, int]] = {}
    try:
        for d in task_dir.iterdir():
            try:
                ran, waited, _ = (d / "schedstat").read_text().split()
                out[int(d.name)] = (int(ran), int(waited))
            except (OSError, ValueError):
                continue  # a thread that ended meanwhile
    except OSError:
        return None
    return out or None


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def sample() -> Sample:
    """The sources read now (the default for :func:`watch`)."""
    return Sample(time.perf_counter(), time.process_time(), _schedstat(), _loadavg())


def load_between(a: Sample, b: Sample, ncores: int) -> Load:
    """The :class:`Load` of the interval from ``a`` to ``b``."""
    wall = max(b.wall - a.wall, 1e-9)
    waited = None
    if a.run_ns is not None and b.run_ns is not None:
        ran = wait = 0
        for tid, (r1, w1) in b.run_ns.items():
            r0, w0 = a.run_ns.get(tid, (0, 0))  # a thread started meanwhile: all of it
            ran, wait = ran + max(0, r1 - r0), wait + max(0, w1 - w0)
        waited = wait / (ran + wait) if ran + wait > 0 else None
    return Load(wall, waited, b.loadavg, max(0.0, b.cpu - a.cpu) / wall, ncores)


class Watch:
    """Filled in by :func:`watch` when its block ends: :attr:`load`."""

    load: Load


@contextmanager
def watch(read: Callable[[], Sample] | None = None, ncores: int | None = None) -> Iterator[Watch]:
    """``with watch() as w: measure()``, then ``w.load`` says whether the machine was busy meanwhile. ``read``: the
    sources (default :func:`sample`, looked up at each call: tests replace it with :func:`simulated`);
    ``ncores``: the cores we may use (default :func:`cores`)."""
    read = read or sample
    w = Watch()
    start = read()
    try:
        yield w
    finally:
        w.load = load_between(start, read(), ncores or cores())


def simulated(busy: bool | Callable[[], bool]) -> Callable[[], Sample]:
    """A load source for :func:`watch` that reports a quiet or a busy machine without loading one (tests; a
    callable ``busy`` is asked at each reading): a second between readings, one core of ours kept busy, and when
    busy our threads waiting as long as they ran and a load average of two other tasks per core."""
    state = {"t": 0, "ran": 0, "waited": 0}

    def read() -> Sample:
        b = busy() if callable(busy) else busy
        state["t"] += 1
        state["ran"] += 10**9
        state["waited"] += 10**9 if b else 0
        load = 1.0 + (2.0 * cores() if b else 0.0)
        return Sample(float(state["t"]), float(state["t"]), {1: (state["ran"], state["waited"])}, load)

    return read


# ---------------------------------------------------------------------------------------------- cache entries
# A cached measurement carries: ``measured_at`` (unix seconds; 0 for entries written before load was recorded),
# ``provisional`` (measured under load), ``load`` (:meth:`Load.figures`) and ``stale`` (why run-time figures
# contradicted it; "" when they did not).


def stamp(load: Load, now: Callable[[], float] = time.time) -> dict[str, Any]:
    """The fields that record how a measurement was taken."""
    return {"provisional": load.busy, "load": load.figures(), "measured_at": round(now(), 1), "stale": ""}


def needs_measuring(entry: Any) -> bool:
    """Whether a cached measurement is measured again at this start: it was taken under load (or before load was
    recorded), or run-time figures contradicted it."""
    return bool(getattr(entry, "provisional", False) or getattr(entry, "stale", "") or not entry.measured_at)


def keep_old(old: Any, load: Load) -> bool:
    """A provisional entry measured again under load is kept (still provisional): the new figures are no better.
    A stale one is replaced even so (its figures were contradicted)."""
    return old is not None and load.busy and not getattr(old, "stale", "")


def contradicts(expected_s: float, measured_s: float, factor: float = DRIFT) -> bool:
    """Whether a run-time figure disagrees with the cached one beyond ``factor`` either way."""
    if expected_s <= 0 or measured_s <= 0:
        return False
    return not 1 / factor <= measured_s / expected_s <= factor


def describe(entry: Any) -> str:
    """When and how a cached measurement was taken (for ``doctor``)."""
    at = getattr(entry, "measured_at", 0.0)
    if not at:
        when = "measured before load was recorded (measured again at the next quiet start)"
    else:
        when = "measured " + time.strftime("%Y-%m-%d %H:%M", time.localtime(at))
    load = getattr(entry, "load", {}) or {}
    if getattr(entry, "stale", ""):
        return f"{when}; stale: {entry.stale} (measured again at the next start)"
    if getattr(entry, "provisional", False):
        seen = []
        if load.get("waited") is not None:
            seen.append(f"threads waited {load['waited']:.0%}")
        if load.get("loadavg") is not None:
            seen.append(f"load average {load['loadavg']:.2f} on {load.get('cores')} cores")
        return f"{when}; provisional: the machine was busy ({', '.join(seen) or 'load'}); measured again when quiet"
    return when + (" (quiet)" if load else "")
