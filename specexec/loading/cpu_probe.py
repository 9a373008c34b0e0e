"""Pick the CPU compute dtype (fp32 or bf16) for a model by measuring this machine, once.

Whether bf16 pays on a CPU depends on the CPU: with AMX-BF16 / AVX512-BF16 a 32-row bf16 pass over the demo
target's weights cost about half the fp32 one (a probe on a quiet machine: 29 vs 63 ms per layer), while on an
AVX2-only CPU bf16 matmuls are emulated and slower than fp32 at every row count. So ``--dtype auto`` on a CPU times
one decoder layer's four weight matrices, in the model's own shapes (from its config), at 1 and 32 rows, in fp32
and bf16 (bf16 in both matmul orientations, see :func:`specexec.formats.dense.linear`), taking the minimum of a few
repeats (other processes only ever add time). It picks bf16 when the 32-row pass is clearly faster
(:data:`BF16_GAIN`) and the one-row pass is not clearly slower (:data:`ONE_ROW_SLACK`); else fp32.

It also measures, for the dtype the model will run in, which matmul orientation (``F.linear`` or ``w @ x.T``)
is faster at each row count from 2 to 64 (:func:`orientation`; a tree verification or draft level has a few
rows, and the BLAS's kernel choice there varies by CPU and build by 2-3x), and sets
:func:`specexec.formats.dense.linear`'s table from it.

The results are cached in ``<cache home>/cpu_probe.json``, keyed by CPU model, torch version, thread count and
the shapes, so the second start skips the measurement. Models too small for the dtype to matter (tests' tiny
models) are not probed: fp32. ``doctor`` shows the cached results (:func:`doctor_lines`).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specexec.formats.dense import ORIENT_MAX_ROWS, linear, set_cpu_orientation, set_cpu_transposed
from specexec.model.transformer import ModelConfig

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 32)
BF16_GAIN = 0.8  # bf16 is chosen when its 32-row layer cost <= this fraction of fp32's ...
ONE_ROW_SLACK = 1.15  # ... and its one-row cost <= this multiple of fp32's
TRANSPOSE_GAIN = 0.9  # bf16 uses ``w @ x.T`` for 8..48 rows when that is at most this fraction of ``F.linear``
ORIENT_ROWS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # row counts timed in both orientations
ORIENT_GAIN = 0.9  # ``w @ x.T`` is used at a row count when it costs at most this fraction of ``F.linear``
ORIENT_REPEATS = 4
MIN_LAYER_PARAMS = 1 << 20  # smaller layers (test models): no probe, fp32
REPEATS = 5
CACHE_FILE = "cpu_probe.json"


@dataclass(frozen=True)
class ProbeResult:
    """One measurement: per-layer milliseconds (min of repeats) and the choice made from them."""

    key: str
    cpu: str
    torch: str
    threads: int
    shapes: list[list[int]]  # (out, in) of the layer's linears
    ms: dict[str, dict[str, float]]  # "fp32" / "bf16" / "bf16_transposed" -> rows -> ms
    dtype: str  # "fp32" or "bf16"
    bf16_transposed: bool  # bf16 passes of 8..48 rows use w @ x.T
    seconds: float = 0.0  # how long the probe took
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        f, b = self.ms.get("fp32", {}), self.ms.get("bf16", {})
        parts = [f"{r} rows fp32 {f[r]:.1f} / bf16 {b[r]:.1f} ms" for r in f if r in b]
        return f"{self.dtype} ({'; '.join(parts)} per layer)"


def cpu_name() -> str:
    """The CPU model name (Linux /proc/cpuinfo, else platform)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's fused linears: wqkv, wo, w13, w2."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return [(q + 2 * kv, d), (d, q), (2 * cfg.intermediate_size, d), (d, cfg.intermediate_size)]


def probe_key(shapes: list[tuple[int, int]]) -> str:
    return f"{cpu_name()}|torch {torch.__version__}|threads {torch.get_num_threads()}|{shapes}"


def cache_path() -> Path:
    from specexec.loading import hub

    return hub.cache_home() / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(result: ProbeResult | OrientResult | DraftProbe | TargetProbe) -> None:
    path = cache_path()
    data = _read_cache()
    data[result.key] = asdict(result)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache costs a re-probe next start, nothing else
        log.warning("could not save the CPU dtype probe to %s: %s", path, e)


def _cached(key: str, cls: Any, use_cache: bool = True) -> Any:
    """The cached result under ``key`` as a ``cls`` instance, or None (absent, disabled, or from an older format)."""
    data = _read_cache().get(key) if use_cache else None
    if not data:
        return None
    try:
        return cls(**data)
    except TypeError:
        return None


def _best_ms_pair(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Best-of-``repeats`` ms of two alternatives timed alternately (A, B, A, B, ...), so a busy spell on the
    machine slows both rather than biasing the comparison; the minimum discards the interrupted repeats."""
    a()
    b()
    best_a = best_b = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a()
        best_a = min(best_a, time.perf_counter() - t)
        t = time.perf_counter()
        b()
        best_b = min(best_b, time.perf_counter() - t)
    return best_a * 1e3, best_b * 1e3


def _best_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (first-call allocation, kernel selection)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(
    shapes: list[tuple[int, int]],
    rows: tuple[int, ...] = PROBE_ROWS,
    repeats: int = REPEATS,
) -> dict[str, dict[str, float]]:
    """Per-layer ms (min of ``repeats``) for fp32 (:func:`~specexec.formats.dense.linear`'s rule) and bf16 in both
    orientations (``bf16``: ``F.linear``; ``bf16_transposed``: ``w @ x.T``, only for rows in 8..48)."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {"fp32": {}, "bf16": {}, "bf16_transposed": {}}
    w32 = [torch.rand(s, generator=gen).sub_(0.5).mul_(0.04) for s in shapes]
    w16 = [w.to(torch.bfloat16) for w in w32]
    for r in rows:
        x32 = [torch.randn(r, s[1], generator=gen) for s in shapes]
        x16 = [x.to(torch.bfloat16) for x in x32]
        out["fp32"][str(r)] = _best_ms(lambda: [linear(x, w) for x, w in zip(x32, w32)], repeats)
        out["bf16"][str(r)] = _best_ms(lambda: [torch.nn.functional.linear(x, w) for x, w in zip(x16, w16)], repeats)
        if 8 <= r <= 48:
            out["bf16_transposed"][str(r)] = _best_ms(lambda: [torch.mm(w, x.T).T for x, w in zip(x16, w16)], repeats)
    return out


def decide(ms: dict[str, dict[str, float]]) -> tuple[str, bool]:
    """(dtype, bf16_transposed) from :func:`measure`'s numbers (see the module docstring for the rule)."""
    rows = sorted(ms["fp32"], key=int)
    one, many = rows[0], rows[-1]
    transposed = many in ms.get("bf16_transposed", {}) and (
        ms["bf16_transposed"][many] <= TRANSPOSE_GAIN * ms["bf16"][many]
    )
    bf16_many = ms["bf16_transposed"][many] if transposed else ms["bf16"][many]
    fp32_many, fp32_one, bf16_one = ms["fp32"][many], ms["fp32"][one], ms["bf16"][one]
    ok = bf16_many <= BF16_GAIN * fp32_many and bf16_one <= ONE_ROW_SLACK * fp32_one
    return ("bf16" if ok else "fp32"), bool(transposed)


def probe(cfg: ModelConfig, use_cache: bool = True, repeats: int = REPEATS) -> ProbeResult | None:
    """The cached or freshly measured result for ``cfg``'s layer shapes; None when the model is too small to
    probe (fp32). Applies the bf16 orientation choice to :func:`specexec.formats.dense.linear`."""
    shapes = layer_shapes(cfg)
    if sum(o * i for o, i in shapes) < MIN_LAYER_PARAMS:
        return None
    key = probe_key(shapes)
    result = _cached(key, ProbeResult, use_cache)
    if result is None:
        log.info("measuring fp32 vs bf16 matmuls on this CPU (once; cached in %s)", cache_path())
        t0 = time.perf_counter()
        ms = measure(shapes, repeats=repeats)
        dtype, transposed = decide(ms)
        result = ProbeResult(
            key=key,
            cpu=cpu_name(),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            shapes=[list(s) for s in shapes],
            ms=ms,
            dtype=dtype,
            bf16_transposed=transposed,
            seconds=round(time.perf_counter() - t0, 2),
        )
        log.info("CPU dtype probe: %s", result.summary())
        _write_cache(result)
    set_cpu_transposed(torch.bfloat16, result.bf16_transposed)
    return result


@dataclass(frozen=True)
class OrientResult:
    """Per-layer milliseconds of both matmul orientations by row count, and the row counts that use ``w @ x.T``."""

    key: str
    dtype: str
    ms: dict[str, dict[str, float]]  # "linear" / "transposed" -> rows -> ms
    transposed_rows: list[int]
    seconds: float = 0.0

    def summary(self) -> str:
        runs: list[str] = []
        rows = self.transposed_rows
        i = 0
        while i < len(rows):
            j = i
            while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
                j += 1
            runs.append(str(rows[i]) if i == j else f"{rows[i]}-{rows[j]}")
            i = j + 1
        return f"{self.dtype} w @ x.T at rows {', '.join(runs) or 'none'} (else F.linear)"


def measure_orientation(
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    rows: tuple[int, ...] = ORIENT_ROWS,
    repeats: int = ORIENT_REPEATS,
) -> dict[str, dict[str, float]]:
    """Per-layer ms (min of ``repeats``) of ``F.linear`` and ``w @ x.T`` over ``shapes`` at each row count."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.rand(s, generator=gen).sub_(0.5).mul_(0.04).to(dtype) for s in shapes]
    out: dict[str, dict[str, float]] = {"linear": {}, "transposed": {}}
    for r in rows:
        xs = [torch.randn(r, s[1], generator=gen).to(dtype) for s in shapes]
        out["linear"][str(r)], out["transposed"][str(r)] = _best_ms_pair(
            lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, ws)],
            lambda: [torch.mm(w, x.T).T for x, w in zip(xs, ws)],
            repeats,
        )
    return out


def decide_orientation(ms: dict[str, dict[str, float]], max_rows: int = ORIENT_MAX_ROWS) -> list[int]:
    """The row counts (2..max_rows) that use ``w @ x.T``: those whose nearest measured row count at or below them
    ran it in at most :data:`ORIENT_GAIN` of ``F.linear``'s time. One row always uses ``F.linear``."""
    measured = sorted(int(r) for r in ms["linear"] if str(r) in ms["transposed"])
    wins = {r for r in measured if ms["transposed"][str(r)] <= ORIENT_GAIN * ms["linear"][str(r)]}
    out = []
    for r in range(2, max_rows + 1):
        below = [m for m in measured if m <= r]
        if below and below[-1] in wins:
            out.append(r)
    return out


def orientation(cfg: ModelConfig, dtype: torch.dtype, use_cache: bool = True) -> OrientResult | None:
    """Measure (once per machine, dtype and shapes; cached) and apply :func:`specexec.formats.dense.linear`'s
    orientation
    table for ``cfg``'s layer shapes in ``dtype``. None (nothing changed) for models too small to matter."""
    shapes = layer_shapes(cfg)
    if sum(o * i for o, i in shapes) < MIN_LAYER_PARAMS or dtype not in (torch.float32, torch.bfloat16):
        return None
    name = "fp32" if dtype == torch.float32 else "bf16"
    key = f"orient {name}|{probe_key(shapes)}"
    result = _cached(key, OrientResult, use_cache)
    if result is None:
        log.info("measuring the CPU's matmul orientations for %s (once; cached in %s)", name, cache_path())
        t0 = time.perf_counter()
        ms = measure_orientation(shapes, dtype)
        result = OrientResult(key, name, ms, decide_orientation(ms), round(time.perf_counter() - t0, 2))
        log.info("CPU orientation probe: %s", result.summary())
        _write_cache(result)
    set_cpu_orientation(dtype, result.transposed_rows)
    return result


INT8_GAIN = 0.75  # an int8 draft is chosen when its layer costs at most this fraction of the dense one ...
INT8_ROWS = (1, 8)  # ... at each of these row counts (one-row chain steps, a few-beam tree level)


@dataclass(frozen=True)
class DraftProbe:
    """Per-layer ms of the draft's linears, dense (its compute dtype) vs int8 weights, and the choice."""

    key: str
    dense: str  # "fp32" / "bf16"
    ms: dict[str, dict[str, float]]  # "dense" / "int8" -> rows -> ms
    int8: bool
    kernel: str
    seconds: float = 0.0

    def summary(self) -> str:
        d, q = self.ms.get("dense", {}), self.ms.get("int8", {})
        parts = [f"{r} rows {self.dense} {d[r]:.1f} / int8 {q[r]:.1f} ms" for r in d if r in q]
        return f"{'int8' if self.int8 else self.dense} weights ({'; '.join(parts)} per layer, {self.kernel} kernel)"


def measure_int8(
    shapes: list[tuple[int, int]], dtype: torch.dtype, rows: tuple[int, ...] = INT8_ROWS, repeats: int = REPEATS
) -> dict[str, dict[str, float]]:
    """Per-layer ms (min of ``repeats``) of the dense linears in ``dtype`` and of :class:`Int8Linear` copies."""
    from specexec.formats.int8 import Int8Linear

    gen = torch.Generator().manual_seed(0)
    w32 = [torch.rand(s, generator=gen).sub_(0.5).mul_(0.04) for s in shapes]
    dense = [w.to(dtype) for w in w32]
    q = [Int8Linear(w) for w in w32]
    out: dict[str, dict[str, float]] = {"dense": {}, "int8": {}}
    for r in rows:
        xs = [torch.randn(r, s[1], generator=gen) for s in shapes]
        xd = [x.to(dtype) for x in xs]
        out["dense"][str(r)], out["int8"][str(r)] = _best_ms_pair(
            lambda: [linear(x, w) for x, w in zip(xd, dense)], lambda: [w.linear(x) for x, w in zip(xs, q)], repeats
        )
    return out


def choose_draft(cfg: ModelConfig) -> tuple[torch.dtype, bool]:
    """A CPU draft's (compute dtype, int8 weights), measured once per machine and cached: int8 weights when this
    CPU runs them clearly faster (:data:`INT8_GAIN`) than the dense dtype :func:`choose_dtype` picks, at one row
    and at a few rows. The draft only proposes, so its format moves speed and acceptance, never the output."""
    from specexec.formats.int8 import _int8_kernel

    dense = choose_dtype(cfg)
    shapes = layer_shapes(cfg)
    kernel = _int8_kernel()
    if sum(o * i for o, i in shapes) < MIN_LAYER_PARAMS or kernel == "dequant":
        return dense, False
    name = "fp32" if dense == torch.float32 else "bf16"
    key = f"draft int8 vs {name}|{kernel}|{probe_key(shapes)}"
    result = _cached(key, DraftProbe)
    if result is None:
        log.info("measuring int8 vs %s draft weights on this CPU (once; cached in %s)", name, cache_path())
        t0 = time.perf_counter()
        ms = measure_int8(shapes, dense)
        ok = all(ms["int8"][r] <= INT8_GAIN * ms["dense"][r] for r in ms["dense"])
        result = DraftProbe(key, name, ms, ok, kernel, round(time.perf_counter() - t0, 2))
        log.info("CPU draft probe: %s", result.summary())
        _write_cache(result)
    return (torch.float32, True) if result.int8 else (dense, False)


TARGET_FORMATS = {"int8": torch.bfloat16, "q4": torch.float32}  # low-bit CPU target formats -> compute dtype


@dataclass(frozen=True)
class TargetProbe:
    """Per-layer ms of the target's linears, dense (its compute dtype) vs each low-bit CPU format in its compute
    dtype (int8: the weight-only ``int8pack`` kernel on bf16; q4: our 4-bit kernel on fp32), and the choice."""

    key: str
    dense: str  # "fp32" / "bf16"
    ms: dict[str, dict[str, float]]  # "dense" / "int8" / "q4" -> rows -> ms
    fmt: str  # the chosen format: "dense", "int8" or "q4"
    seconds: float = 0.0

    def summary(self) -> str:
        d = self.ms.get("dense", {})
        parts = [
            f"{r} rows {self.dense} {d[r]:.1f}"
            + "".join(f" / {f} {self.ms[f][r]:.1f}" for f in TARGET_FORMATS if r in self.ms.get(f, {}))
            for r in d
        ]
        name = self.dense if self.fmt == "dense" else self.fmt
        return f"target {name} weights ({'; '.join(parts)} ms per layer)"


def target_formats() -> tuple[str, ...]:
    """The low-bit CPU target formats that run here: int8 where this torch has the ``int8pack`` kernel, q4 where
    the package's C kernels build."""
    from specexec.formats import q4

    return tuple(f for f, ok in (("int8", hasattr(torch, "_weight_int8pack_mm")), ("q4", q4.available() is None)) if ok)


def measure_target(
    shapes: list[tuple[int, int]], dtype: torch.dtype, rows: tuple[int, ...] = INT8_ROWS, repeats: int = REPEATS
) -> dict[str, dict[str, float]]:
    """Per-layer ms (min of ``repeats``) of the dense linears in ``dtype`` and of each low-bit CPU target format
    that runs here (:func:`target_formats`), fed activations in its compute dtype, timed alternately with the
    dense ones."""
    from specexec.formats.int8 import Int8Linear
    from specexec.formats.q4 import Q4Linear

    gen = torch.Generator().manual_seed(0)
    w32 = [torch.rand(s, generator=gen).sub_(0.5).mul_(0.04) for s in shapes]
    dense = [w.to(dtype) for w in w32]
    make = {"int8": lambda w: Int8Linear(w, kernel="int8pack"), "q4": Q4Linear}
    low: dict[str, list[Any]] = {f: [make[f](w) for w in w32] for f in target_formats()}
    out: dict[str, dict[str, float]] = {"dense": {}, **{f: {} for f in low}}
    for r in rows:
        xs = [torch.randn(r, s[1], generator=gen) for s in shapes]
        xd = [x.to(dtype) for x in xs]
        for f, ws in low.items():
            xq = [x.to(TARGET_FORMATS[f]) for x in xs]
            dense_ms, out[f][str(r)] = _best_ms_pair(
                lambda: [linear(x, w) for x, w in zip(xd, dense)],
                lambda ws=ws, xq=xq: [w.linear(x, invariant=True) for x, w in zip(xq, ws)],  # type: ignore[misc]
                repeats,
            )
            out["dense"][str(r)] = min(dense_ms, out["dense"].get(str(r), dense_ms))
    return out


def pick_target(ms: dict[str, dict[str, float]]) -> str:
    """The format whose layer costs least summed over the measured row counts, among the dense one and the low-bit
    ones that cost at most :data:`INT8_GAIN` of dense at every row count (a clear gain, not noise)."""
    dense = ms["dense"]
    ok = [f for f in TARGET_FORMATS if f in ms and all(ms[f][r] <= INT8_GAIN * dense[r] for r in dense)]
    return min(ok, key=lambda f: sum(ms[f][r] for r in dense), default="dense")


def choose_target(cfg: ModelConfig) -> tuple[str, torch.dtype]:
    """A CPU target's (weight format, compute dtype) for ``--target-dtype auto``, measured once per machine and
    cached: a low-bit format (:func:`measure_target`'s) when it runs the layer's linears clearly faster than
    the dense dtype :func:`choose_dtype` picks, at one row (plain decoding) and at a few rows (verification)
    (:func:`pick_target`); else ``("dense", that dtype)``. A token costs reading the weights: int8 weights are a
    quarter of fp32's bytes, 4-bit ones a sixth."""
    dense = choose_dtype(cfg)
    shapes = layer_shapes(cfg)
    if sum(o * i for o, i in shapes) < MIN_LAYER_PARAMS:
        return "dense", dense
    name = "fp32" if dense == torch.float32 else "bf16"
    key = f"target formats {'+'.join(target_formats())} vs {name}|{probe_key(shapes)}"
    result = _cached(key, TargetProbe)
    if result is None:
        log.info("measuring low-bit vs %s target weights on this CPU (once; cached in %s)", name, cache_path())
        t0 = time.perf_counter()
        ms = measure_target(shapes, dense)
        result = TargetProbe(key, name, ms, pick_target(ms), round(time.perf_counter() - t0, 2))
        log.info("CPU target probe: %s", result.summary())
        _write_cache(result)
    return (result.fmt, TARGET_FORMATS[result.fmt]) if result.fmt != "dense" else ("dense", dense)


def choose_dtype(cfg: ModelConfig) -> torch.dtype:
    """The CPU compute dtype for ``cfg`` on this machine (fp32 or bf16), measured once and cached."""
    result = probe(cfg)
    return torch.bfloat16 if result is not None and result.dtype == "bf16" else torch.float32


def cached_results() -> list[ProbeResult]:
    """Every cached probe result for this CPU, torch version and thread count (for ``doctor``)."""
    prefix = f"{cpu_name()}|torch {torch.__version__}|threads {torch.get_num_threads()}|"
    out = []
    for key, val in _read_cache().items():
        if key.startswith(prefix):
            try:
                out.append(ProbeResult(**val))
            except TypeError:
                continue
    return out


def doctor_lines(cfgs: dict[str, ModelConfig] | None = None, run: bool = False) -> list[str]:
    """Human-readable lines on the CPU dtype choice: for each named config (probed now when ``run``, else only
    when cached), or every cached result when ``cfgs`` is None."""
    lines = []
    if cfgs is None:
        for r in cached_results():
            lines.append(f"cpu dtype for layer shapes {r.shapes}: {r.summary()}")
        return lines or ["cpu dtype: not probed yet on this machine (the first --dtype auto load on CPU does it)"]
    cache = _read_cache()
    for name, cfg in cfgs.items():
        shapes = layer_shapes(cfg)
        if sum(o * i for o, i in shapes) < MIN_LAYER_PARAMS:
            lines.append(f"cpu dtype for {name}: fp32 (too small to probe)")
            continue
        if run or probe_key(shapes) in cache:
            r = probe(cfg)  # type: ignore[assignment]
            lines.append(f"cpu dtype for {name}: {r.summary()}" if r else f"cpu dtype for {name}: fp32")
            for dt in ("fp32", "bf16"):
                o = cache.get(f"orient {dt}|{probe_key(shapes)}")
                if o:
                    try:
                        lines.append(f"cpu matmuls for {name}: {OrientResult(**o).summary()}")
                    except TypeError:
                        pass
        else:
            lines.append(f"cpu dtype for {name}: not probed yet (the first --dtype auto load on CPU does it)")
    return lines
