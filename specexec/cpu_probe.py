"""Pick the CPU compute dtype (fp32 or bf16) for a model by measuring this machine, once.

Whether bf16 pays on a CPU depends on the CPU: with AMX-BF16 / AVX512-BF16 a 32-row bf16 pass over the demo
target's weights cost about half the fp32 one (issue 13's quiet-machine probe: 29 vs 63 ms per layer), while on an
AVX2-only CPU bf16 matmuls are emulated and slower than fp32 at every row count. So ``--dtype auto`` on a CPU times
one decoder layer's four weight matrices, in the model's own shapes (from its config), at 1 and 32 rows, in fp32
and bf16 (bf16 in both matmul orientations, see :func:`specexec.model.linear`), taking the minimum of a few
repeats (other processes only ever add time). It picks bf16 when the 32-row pass is clearly faster
(:data:`BF16_GAIN`) and the one-row pass is not clearly slower (:data:`ONE_ROW_SLACK`); else fp32.

The result is cached in ``<cache home>/cpu_probe.json``, keyed by CPU model, torch version, thread count and
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

from specexec.model import ModelConfig, linear, set_cpu_transposed

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 32)
BF16_GAIN = 0.8  # bf16 is chosen when its 32-row layer cost <= this fraction of fp32's ...
ONE_ROW_SLACK = 1.15  # ... and its one-row cost <= this multiple of fp32's
TRANSPOSE_GAIN = 0.9  # bf16 uses ``w @ x.T`` for 8..48 rows when that is at most this fraction of ``F.linear``
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
    from specexec import hub

    return hub.cache_home() / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(result: ProbeResult) -> None:
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
    """Per-layer ms (min of ``repeats``) for fp32 (:func:`~specexec.model.linear`'s rule) and bf16 in both
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
    probe (fp32). Applies the bf16 orientation choice to :func:`specexec.model.linear`."""
    shapes = layer_shapes(cfg)
    if sum(o * i for o, i in shapes) < MIN_LAYER_PARAMS:
        return None
    key = probe_key(shapes)
    cached = _read_cache().get(key) if use_cache else None
    result = None
    if cached:
        try:
            result = ProbeResult(**cached)
        except TypeError:
            result = None
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
        else:
            lines.append(f"cpu dtype for {name}: not probed yet (the first --dtype auto load on CPU does it)")
    return lines
