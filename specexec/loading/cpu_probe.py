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
the shapes, so the second start skips the measurement. Each measurement runs under :func:`specexec.quiet.watch`:
one taken while the machine was busy is stored provisional, with the load it saw, and measured again at the next
start (replaced when that start is quiet, kept provisional while the machine stays busy); a format whose
one-row pass at run time disagrees with the probe's figures by more than :data:`specexec.quiet.DRIFT`
(:func:`check_pass`) is marked stale and measured again at the next start. Models too small for the dtype to
matter (tests' tiny models) are not probed: fp32. ``doctor`` shows the cached results, when and how each was
measured (:func:`doctor_lines`, :func:`entries`), and drops them on request (:func:`forget`).
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from specexec import quiet
from specexec.formats.dense import ORIENT_MAX_ROWS, linear, set_cpu_orientation, set_cpu_transposed
from specexec.home import write_json
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
LLC_DEFAULT = 32 << 20  # the last-level cache assumed where sysfs does not say
FLUSH_MAX = 2 << 30  # the most bytes read to push a layer out of the cache
PROBE_VERSION = 3  # of the format probes: results of older kernels or rules are measured again


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
    provisional: bool = False  # measured while the machine was busy (specexec.quiet): measured again when quiet
    load: dict[str, Any] = field(default_factory=dict)  # what the measurement saw (quiet.Load.figures)
    measured_at: float = 0.0  # unix seconds (0: written before load was recorded)
    stale: str = ""  # why run-time figures contradicted it ("": they did not)

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


def _write_cache(result: ProbeResult | OrientResult | FormatProbe) -> None:
    path = cache_path()
    data = _read_cache()
    data[result.key] = asdict(result)
    try:
        write_json(path, data)
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


Result = TypeVar("Result", "ProbeResult", "OrientResult", "FormatProbe")


def _measured(key: str, cls: type[Result], run: Callable[[], Result], use_cache: bool = True) -> Result:
    """The cached ``cls`` under ``key`` unless it must be measured again (:func:`specexec.quiet.needs_measuring`:
    provisional, stale, or from before load was recorded); else ``run()`` under :func:`specexec.quiet.watch`,
    stamped with the load it saw and cached. A provisional entry measured again under load is kept as it was."""
    old = _cached(key, cls, use_cache)
    if old is not None and not quiet.needs_measuring(old):
        return old
    with quiet.watch() as w:
        new = run()
    if quiet.keep_old(old, w.load):
        log.info("the machine is still busy (%s): keeping the provisional choice", "; ".join(w.load.reasons()))
        return old  # type: ignore[return-value]
    if w.load.busy:
        log.warning(
            "the machine was busy while measuring (%s): the choice is provisional, measured again at the next "
            "quiet start",
            "; ".join(w.load.reasons()),
        )
    new = replace(new, **quiet.stamp(w.load))
    _write_cache(new)
    return new


def _best_ms_pair(
    a: Callable[[], Any], b: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None
) -> tuple[float, float]:
    """Best-of-``repeats`` ms of two alternatives timed alternately (A, B, A, B, ...), so a busy spell on the
    machine slows both rather than biasing the comparison; the minimum discards the interrupted repeats.
    ``before``: run (untimed) before every timed call (:func:`cold`)."""
    a()
    b()
    best_a = best_b = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        a()
        best_a = min(best_a, time.perf_counter() - t)
        if before is not None:
            before()
        t = time.perf_counter()
        b()
        best_b = min(best_b, time.perf_counter() - t)
    return best_a * 1e3, best_b * 1e3


def llc_bytes() -> int:
    """The CPU's last-level cache in bytes (Linux sysfs), else :data:`LLC_DEFAULT`."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            best = max(best, int(size.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or LLC_DEFAULT


def cold(model_bytes: int) -> Callable[[], Any] | None:
    """A model whose weights exceed the last-level cache streams them from memory in every pass, but one layer
    timed over and over sits in the cache (a 480 MB L3 holds a 1.5B model's bf16 layer): then each timed call
    is preceded by reading a buffer twice the cache's size, so the layer comes from memory as in the real pass.
    None (no flush) for a model that fits."""
    llc = llc_bytes()
    if model_bytes <= llc:
        return None
    buf = torch.ones(min(2 * llc, FLUSH_MAX) // 4)
    return lambda: float(buf.sum())


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

    def run() -> ProbeResult:
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
        return result

    result = _measured(key, ProbeResult, run, use_cache)
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
    provisional: bool = False  # measured while the machine was busy (specexec.quiet): measured again when quiet
    load: dict[str, Any] = field(default_factory=dict)  # what the measurement saw (quiet.Load.figures)
    measured_at: float = 0.0  # unix seconds (0: written before load was recorded)
    stale: str = ""  # why run-time figures contradicted it ("": they did not)

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

    def run() -> OrientResult:
        log.info("measuring the CPU's matmul orientations for %s (once; cached in %s)", name, cache_path())
        t0 = time.perf_counter()
        ms = measure_orientation(shapes, dtype)
        result = OrientResult(key, name, ms, decide_orientation(ms), round(time.perf_counter() - t0, 2))
        log.info("CPU orientation probe: %s", result.summary())
        return result

    result = _measured(key, OrientResult, run, use_cache)
    set_cpu_orientation(dtype, result.transposed_rows)
    return result


LOW_BIT_GAIN = 0.75  # a low-bit format's one-row pass must cost at most this fraction of the dense one
INT8_ROWS = (1, 8)  # the row counts timed: one-row passes (plain decoding, chain steps), a few-row verification

# low-bit CPU formats -> their compute dtype: a target's int8 is the weight-only ``int8pack`` kernel on bf16; a
# draft's int8 (fbgemm's dynamic kernel) and both q4 compute in fp32
TARGET_FORMATS = {"int8": torch.bfloat16, "q4": torch.float32}
DRAFT_FORMATS = {"int8": torch.float32, "q4": torch.float32}


def pick_format(ms: dict[str, dict[str, float]], formats: Any) -> str:
    """The format whose layer costs least summed over the measured row counts, among the dense one and the low-bit
    ones (of ``formats``) that are clearly cheaper at one row (:data:`LOW_BIT_GAIN`: a token costs reading the
    weights) and no dearer than dense at any other row count (a verification or a tree level must not get
    dearer)."""
    dense = ms["dense"]
    one = min(dense, key=int)

    def ok(f: str) -> bool:
        return ms[f][one] <= LOW_BIT_GAIN * dense[one] and all(ms[f][r] <= dense[r] for r in dense if r != one)

    return min((f for f in formats if f in ms and ok(f)), key=lambda f: sum(ms[f][r] for r in dense), default="dense")


def _low_bit(fmt: str, w: torch.Tensor, target: bool) -> Any:
    from specexec.formats.int8 import Int8Linear
    from specexec.formats.q4 import Q4Linear

    if fmt == "q4":
        return Q4Linear(w)
    return Int8Linear(w, kernel="int8pack") if target else Int8Linear(w)


def measure_formats(
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    formats: dict[str, torch.dtype],
    rows: tuple[int, ...] = INT8_ROWS,
    repeats: int = REPEATS,
    before: Callable[[], Any] | None = None,
    target: bool = True,
) -> dict[str, dict[str, float]]:
    """Per-layer ms (min of ``repeats``) of the dense linears in ``dtype`` and of each low-bit format in
    ``formats`` (fed activations in its compute dtype), timed alternately with the dense ones; ``before``: run
    before every timed call (:func:`cold`). ``target``: a target's int8 kernel, else a draft's."""
    gen = torch.Generator().manual_seed(0)
    w32 = [torch.rand(s, generator=gen).sub_(0.5).mul_(0.04) for s in shapes]
    dense = [w.to(dtype) for w in w32]
    low: dict[str, list[Any]] = {f: [_low_bit(f, w, target) for w in w32] for f in formats}
    if "q4" in low:  # as a loaded model holds them (specexec.formats.q4.gather)
        from specexec.formats.q4 import gather

        gather(low["q4"])
    out: dict[str, dict[str, float]] = {"dense": {}, **{f: {} for f in low}}
    for r in rows:
        xs = [torch.randn(r, s[1], generator=gen) for s in shapes]
        xd = [x.to(dtype) for x in xs]
        for f, ws in low.items():
            xq = [x.to(formats[f]) for x in xs]
            dense_ms, out[f][str(r)] = _best_ms_pair(
                lambda: [linear(x, w) for x, w in zip(xd, dense)],
                lambda ws=ws, xq=xq: [w.linear(x, invariant=True) for x, w in zip(xq, ws)],  # type: ignore[misc]
                repeats,
                before,
            )
            out["dense"][str(r)] = min(dense_ms, out["dense"].get(str(r), dense_ms))
    return out


@dataclass(frozen=True)
class FormatProbe:
    """Per-layer ms of a model's linears, dense (its compute dtype) vs each low-bit CPU format that runs here, timed
    from memory where the model outgrows the last-level cache (``cold``), and the chosen format."""

    key: str
    dense: str  # "fp32" / "bf16"
    ms: dict[str, dict[str, float]]  # "dense" / "int8" / "q4" -> rows -> ms
    fmt: str  # the chosen format: "dense", "int8" or "q4"
    cold: bool = False
    seconds: float = 0.0
    pass_s: dict[str, float] = field(default_factory=dict)  # format -> a whole one-row pass, s (:func:`pass_seconds`)
    provisional: bool = False  # measured while the machine was busy (specexec.quiet): measured again when quiet
    load: dict[str, Any] = field(default_factory=dict)  # what the measurement saw (quiet.Load.figures)
    measured_at: float = 0.0  # unix seconds (0: written before load was recorded)
    stale: str = ""  # why run-time figures contradicted it ("": they did not)

    def summary(self, what: str = "target") -> str:
        d = self.ms.get("dense", {})
        parts = [
            f"{r} rows {self.dense} {d[r]:.1f}"
            + "".join(f" / {f} {self.ms[f][r]:.1f}" for f in ("int8", "q4") if r in self.ms.get(f, {}))
            for r in d
        ]
        name = self.dense if self.fmt == "dense" else self.fmt
        where = ", from memory" if self.cold else ""
        return f"{what} {name} weights ({'; '.join(parts)} ms per layer{where})"


def target_formats() -> tuple[str, ...]:
    """The low-bit CPU target formats that run here: int8 where this torch has the ``int8pack`` kernel, q4 where
    the package's C kernels build."""
    from specexec.formats import q4

    return tuple(f for f, ok in (("int8", hasattr(torch, "_weight_int8pack_mm")), ("q4", q4.available() is None)) if ok)


def draft_formats() -> tuple[str, ...]:
    """The low-bit CPU draft formats that run here: int8 where its kernel is not a dequantizing fallback, q4 where
    the package's C kernels build."""
    from specexec.formats import q4
    from specexec.formats.int8 import _int8_kernel

    return tuple(f for f, ok in (("int8", _int8_kernel() != "dequant"), ("q4", q4.available() is None)) if ok)


def measure_target(
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    rows: tuple[int, ...] = INT8_ROWS,
    repeats: int = REPEATS,
    before: Callable[[], Any] | None = None,
) -> dict[str, dict[str, float]]:
    """:func:`measure_formats` for a target: every low-bit target format that runs here."""
    formats = {f: TARGET_FORMATS[f] for f in target_formats()}
    return measure_formats(shapes, dtype, formats, rows, repeats, before)


def _choose(cfg: ModelConfig, what: str, formats: tuple[str, ...]) -> FormatProbe | None:
    """The cached or freshly measured :class:`FormatProbe` of ``cfg`` as a ``what`` ("target" / "draft"); None for
    models too small to probe."""
    dense = choose_dtype(cfg)
    shapes = layer_shapes(cfg)
    if sum(o * i for o, i in shapes) < MIN_LAYER_PARAMS or not formats:
        return None
    name = "fp32" if dense == torch.float32 else "bf16"
    key = f"{what} formats {PROBE_VERSION} {'+'.join(formats)} vs {name}|{probe_key(shapes)}"

    def run() -> FormatProbe:
        log.info("measuring low-bit vs %s %s weights on this CPU (once; cached in %s)", name, what, cache_path())
        t0 = time.perf_counter()
        flush = cold(sum(o * i for o, i in shapes) * cfg.num_layers * dense.itemsize)
        if what == "target":
            ms = measure_target(shapes, dense, before=flush)
            table = TARGET_FORMATS
        else:
            table = DRAFT_FORMATS
            ms = measure_formats(shapes, dense, {f: table[f] for f in formats}, before=flush, target=False)
        fmt = pick_format(ms, table)
        secs = round(time.perf_counter() - t0, 2)
        result = FormatProbe(key, name, ms, fmt, flush is not None, secs, pass_seconds(cfg, ms))
        log.info("CPU %s probe: %s", what, result.summary(what))
        return result

    return _measured(key, FormatProbe, run)


def pass_seconds(cfg: ModelConfig, ms: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per format of ``ms`` (:func:`measure_formats`' figures), the seconds of a whole one-row pass of ``cfg``
    expected from them: its layers' linears plus the output head (in the same format, priced per weight as a
    layer's linears are: a one-row pass reads each weight once), the rest (norms, attention at a short context)
    left out."""
    layer = sum(o * i for o, i in layer_shapes(cfg))
    layers = cfg.num_layers + cfg.vocab_size * cfg.hidden_size / layer
    one = str(min(INT8_ROWS))
    return {f: round(v[one] * layers / 1e3, 6) for f, v in ms.items() if one in v}


def contradicts(cached: FormatProbe, measured_s: float, fmt: str | None = None) -> bool:
    """Whether a one-row pass measured at run time (``measured_s``, of a model in ``fmt``, default the probe's
    choice) disagrees with what the probe's figures expect (:attr:`FormatProbe.pass_s`) by more than
    :data:`specexec.quiet.DRIFT` either way. False where the probe has no figure for that format."""
    expected = cached.pass_s.get(fmt or cached.fmt)
    return expected is not None and quiet.contradicts(expected, measured_s)


def weight_format(model: Any) -> str:
    """A CPU model's layer weight format: ``q4``, ``int8`` or ``dense``."""
    from specexec.formats.blocks import BLOCK_LINEARS
    from specexec.formats.int8 import Int8Linear
    from specexec.model.transformer import ResidentLayers

    if not isinstance(model.layers, ResidentLayers) or not model.layers.layers:
        return "dense"
    w = model.layers.layer(0).get("w2")
    return "q4" if isinstance(w, BLOCK_LINEARS) else "int8" if isinstance(w, Int8Linear) else "dense"


def check_pass(model: Any, what: str, measured_s: float, load: quiet.Load | None = None) -> list[str]:
    """Run-time check of the cached format probes of ``model`` as a ``what`` ("target" / "draft"): where a one-row
    pass measured now (``measured_s``, on a quiet machine: a busy ``load`` says nothing about the probe) contradicts
    the probe's figures for the model's format (:func:`contradicts`), the probe is marked stale and measured
    again at the next start. Returns the keys marked."""
    if load is not None and load.busy:
        return []
    cfg, fmt = model.cfg, weight_format(model)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(model.dtype)
    table = TARGET_FORMATS if what == "target" else DRAFT_FORMATS
    data = _read_cache()
    marked = []
    for key, val in data.items():
        if not (
            key.startswith(f"{what} formats {PROBE_VERSION} ") and key.endswith(f"|{probe_key(layer_shapes(cfg))}")
        ):
            continue
        try:
            entry = FormatProbe(**val)
        except TypeError:
            continue
        runs_as = entry.dense if fmt == "dense" else {torch.float32: "fp32", torch.bfloat16: "bf16"}[table[fmt]]
        if entry.stale or runs_as != dtype or not contradicts(entry, measured_s, fmt):
            continue
        why = (
            f"a one-row {what} pass in {fmt} ran in {measured_s * 1e3:.1f} ms at run time, the probe's figures "
            f"expected {entry.pass_s[fmt] * 1e3:.1f} ms"
        )
        log.info("%s: measuring the CPU %s formats again at the next start", why, what)
        data[key] = {**val, "stale": why}
        marked.append(key)
    if marked:
        try:
            write_json(cache_path(), data)
        except OSError as e:
            log.warning("could not mark the CPU probe stale in %s: %s", cache_path(), e)
    return marked


def choose_target(cfg: ModelConfig) -> tuple[str, torch.dtype]:
    """A CPU target's (weight format, compute dtype) for ``--target-dtype auto``, measured once per machine and
    cached: a low-bit format (:func:`measure_target`'s) when it runs the layer's linears clearly faster than
    the dense dtype :func:`choose_dtype` picks at one row (plain decoding) and no slower at a few rows
    (verification) (:func:`pick_format`); else ``("dense", that dtype)``. A token costs reading the weights: int8
    weights are a quarter of fp32's bytes, 4-bit ones a sixth."""
    result = _choose(cfg, "target", target_formats())
    if result is None or result.fmt == "dense":
        return "dense", choose_dtype(cfg)
    return result.fmt, TARGET_FORMATS[result.fmt]


def choose_draft(cfg: ModelConfig) -> tuple[torch.dtype, str]:
    """A CPU draft's (compute dtype, weight format: dense | int8 | q4), measured once per machine and cached, by
    the rule of :func:`choose_target`. The draft only proposes, so its format moves speed and acceptance, never
    the output."""
    result = _choose(cfg, "draft", draft_formats())
    if result is None or result.fmt == "dense":
        return choose_dtype(cfg), "dense"
    return DRAFT_FORMATS[result.fmt], result.fmt


def choose_dtype(cfg: ModelConfig) -> torch.dtype:
    """The CPU compute dtype for ``cfg`` on this machine (fp32 or bf16), measured once and cached."""
    result = probe(cfg)
    return torch.bfloat16 if result is not None and result.dtype == "bf16" else torch.float32


def cached_results() -> list[ProbeResult]:
    """Every cached probe result for this CPU, torch version and thread count (for ``doctor``)."""
    return [r for r in entries() if isinstance(r, ProbeResult)]


def _machine_prefix() -> str:
    return f"{cpu_name()}|torch {torch.__version__}|threads {torch.get_num_threads()}|"


def entries() -> list[ProbeResult | OrientResult | FormatProbe]:
    """Every readable cached measurement for this CPU, torch version and thread count: dtype, orientation and
    format probes (for ``doctor``)."""
    prefix, out = _machine_prefix(), []
    for key, val in _read_cache().items():
        head, _, rest = key.partition("|")
        if not (key.startswith(prefix) or rest.startswith(prefix)):
            continue
        cls: Any = (
            ProbeResult if key.startswith(prefix) else OrientResult if head.startswith("orient ") else FormatProbe
        )
        try:
            out.append(cls(**val))
        except TypeError:
            continue
    return out


def entry_line(r: ProbeResult | OrientResult | FormatProbe) -> str:
    """One line on a cached measurement: what it chose, for which shapes, when, and how (``doctor``)."""
    shapes = r.key.rsplit("|", 1)[-1]
    if isinstance(r, OrientResult):
        what = f"cpu matmuls: {r.summary()}"
    elif isinstance(r, FormatProbe):
        kind = r.key.split(" ", 1)[0]
        what = f"cpu {kind} format: {r.summary(kind)}"
    else:
        what = f"cpu dtype: {r.summary()}"
    return f"{what}, layer shapes {shapes}; {quiet.describe(r)}"


def forget() -> int:
    """Drop every cached measurement of this file (all machines' keys): the next start measures again. Returns how
    many were dropped. Raises OSError where the cache cannot be written."""
    data = _read_cache()
    if data:
        cache_path().unlink(missing_ok=True)
    return len(data)


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
