"""The memory plan: where each target layer lives (GPU, pinned RAM, SSD), decided before anything is loaded.

:func:`make_plan` is pure: its inputs are a :class:`Resources` (free VRAM, capped by ``gpu_memory_gb``; RAM; free
disk where the cache goes; :meth:`Resources.probe` reads them from this machine) and a :class:`PlanModel` (config,
compute dtype, the VRAM the draft and the KV/step buffers take, the model's layer caches). Byte counts come from
:mod:`specexec.model.sizes`; the exact packed layer size from :func:`~offload.layout.layer_layout`. ``load_offloaded``
and
``specexec doctor`` both call it.
Fixed VRAM: the globals (embeddings, final norm, lm_head), the draft, the KV cache and a workspace for a pass of
``max_tokens`` tokens. What is left holds the ring of streamed-layer buffers, then as many resident layers as fit,
spread among the streamed ones (:func:`spread`). ``mode=auto``: ``none`` (all resident) if everything fits in VRAM,
else ``ram`` if RAM minus a safety margin holds the streamed layers, else ``ssd``. ``target_dtype=auto``: 16-bit
when the model fits in VRAM, else NF4 (3.6x fewer bytes to stream per pass). On a CPU device (tests) the "VRAM"
budget is ``gpu_memory_gb`` or unlimited, so ``auto`` gives ``none`` unless a cap is set. When the model cannot fit
as asked, :func:`make_plan` raises an :class:`~specexec.errors.OutOfMemory` saying what is short and what to change
— before any weight is read.

Time floor of one forward = streamed bytes / pinned host→device bandwidth (25 GB/s, a PCIe 4.0 x16 desktop, unless
measured with :func:`measure_h2d_bandwidth`).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from offload.layout import LayerFormat, layer_layout
from offload.packing import max_linear_numel
from offload.store import CHUNK_BYTES, SsdStore, cache_dir_for, default_cache_dir
from specexec.errors import ConfigError, OutOfMemory, check_finite, setting
from specexec.model import sizes
from specexec.model.transformer import ModelConfig

log = logging.getLogger(__name__)

GB = 1e9
GIB = 1 << 30
MODES = ("auto", "none", "ram", "ssd")
TARGET_DTYPES = ("auto", "bf16", "fp16", "nf4", "int8", "q4")
DEFAULT_H2D_GBPS = 25.0  # pinned host->device GB/s assumed when not measured (PCIe 4.0 x16)
VRAM_HEADROOM = GIB // 2  # bytes kept free on the GPU (allocator fragmentation, cuBLAS workspaces)
RAM_MARGIN_FRACTION = 0.10  # of total RAM kept free for the OS and everything else ...
RAM_MARGIN_MIN = 2 * GIB  # ... but at least this many bytes
DISK_MARGIN = GIB  # bytes kept free on the cache disk
STAGING_BUFFERS = 4  # pinned chunk buffers for the staged (SSD) path


@dataclass(frozen=True)
class OffloadConfig:
    """How the target model's layers may be placed (validated here; resolved by :func:`make_plan`)."""

    mode: str = "auto"  # auto | none (all on GPU) | ram (stream from pinned RAM) | ssd (stream from disk)
    gpu_memory_gb: float | None = None  # cap on the VRAM the target may use (GB = 1e9 bytes); None: all free
    target_dtype: str = "auto"  # auto | bf16 | fp16 | nf4 | int8, q4 (CPU, resident): how target layers are stored
    cache_dir: Path | None = None  # specexec's cache root (packed layers: <cache_dir>/offload); None: hub.cache_home()
    lookahead: int = 1  # streamed layers in flight while one computes
    ring_size: int | None = None  # GPU layer buffers for streaming; None: lookahead + 1
    resident_layers: int | None = None  # force this many layers to stay on the GPU (spread); None: as many as fit

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError("OffloadConfig.mode", self.mode, f"must be one of {', '.join(MODES)}")
        if self.target_dtype not in TARGET_DTYPES:
            raise ConfigError(
                "OffloadConfig.target_dtype", self.target_dtype, f"must be one of {', '.join(TARGET_DTYPES)}"
            )
        check_finite("OffloadConfig.gpu_memory_gb", self.gpu_memory_gb)
        if self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0:
            raise ConfigError("OffloadConfig.gpu_memory_gb", self.gpu_memory_gb, "must be > 0")
        if self.lookahead < 1:
            raise ConfigError("OffloadConfig.lookahead", self.lookahead, "must be >= 1")
        if self.ring_size is not None and self.ring_size < max(2, self.lookahead + 1):
            raise ConfigError(
                "OffloadConfig.ring_size",
                self.ring_size,
                f"must be >= max(2, lookahead + 1) = {max(2, self.lookahead + 1)}",
            )
        if self.resident_layers is not None and self.resident_layers < 0:
            raise ConfigError("OffloadConfig.resident_layers", self.resident_layers, "must be >= 0")
        if self.cache_dir is not None and not isinstance(self.cache_dir, Path):
            object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())

    @property
    def offload_root(self) -> Path:
        """Where packed-layer caches (SSD tier, NF4) live: ``<cache_dir>/offload``."""
        return self.cache_dir / "offload" if self.cache_dir is not None else default_cache_dir()

    @property
    def ring(self) -> int:
        """GPU layer buffers used for streaming."""
        return self.ring_size if self.ring_size is not None else max(2, self.lookahead + 1)


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype of non-quantized compute: bf16 on CUDA (fp16 without bf16 support), fp32 on CPU (tests)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def globals_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Embedding + final norm + lm_head (unless tied) in ``dtype``."""
    return sizes.globals_bytes(cfg, _itemsize(dtype))


def workspace_bytes(cfg: ModelConfig, fmt: LayerFormat, device: torch.device, max_tokens: int) -> int:
    """One target pass over ``max_tokens`` tokens: activations and logits (:mod:`specexec.model.sizes`) + the NF4
    dequantization scratch on CUDA."""
    isz = _itemsize(fmt.dtype)
    act = sizes.pass_activation_bytes(cfg, max_tokens, isz) + sizes.logits_bytes(cfg, max_tokens, isz)
    scratch = max_linear_numel(layer_layout(cfg, fmt)) * isz if fmt.kind == "nf4" and device.type == "cuda" else 0
    return act + scratch


def invariant_reservation(
    cfg: ModelConfig, fmt: LayerFormat, device: torch.device, context: int = 0, rows: int = 2048, attn_rows: int = 16
) -> dict[str, int]:
    """GPU bytes shape-invariant passes need beyond :func:`workspace_bytes`, by part (CUDA; {} elsewhere):
    ``check``, the load-time invariance check's peak (:func:`specexec.model.sizes.check_bytes`: it runs
    beside the placed layers, before any pass); ``attention``, a pass's attention temporaries over ``context``
    positions, ``rows`` rows a pass (:func:`specexec.model.sizes.invariant_attention_bytes`); ``scratch``, the NF4
    dequantization buffer (one layer's largest linear in 16-bit, already part of the workspace: shown, not added
    again). The plan adds
    ``max(check, attention)``: the check's tensors are freed before the first pass."""
    if device.type != "cuda":
        return {}
    isz = _itemsize(fmt.dtype)
    return {
        "check": sizes.check_bytes(cfg, fmt.dtype),
        "attention": sizes.invariant_attention_bytes(cfg, context, rows, attn_rows),
        "scratch": max_linear_numel(layer_layout(cfg, fmt)) * isz if fmt.kind == "nf4" else 0,
    }


def _reserved_bytes(parts: Mapping[str, int]) -> int:
    return max(parts.get("check", 0), parts.get("attention", 0))


@dataclass(frozen=True)
class Resources:
    """What the machine offers the plan, in bytes: probed by :meth:`probe`, or given (doctor, tests)."""

    device: str = "cpu"  # "cuda" or "cpu" (a CPU "GPU" is unlimited unless gpu_memory_gb caps it)
    vram_free: int | None = None  # free VRAM of the CUDA device (None on a CPU)
    ram_total: int = 0
    ram_available: int = 0
    disk_free: int | None = None  # free bytes on the cache's filesystem (None: unknown)
    h2d_gbps: float | None = None  # measured pinned host->device bandwidth (None: assume DEFAULT_H2D_GBPS)

    @classmethod
    def probe(cls, device: torch.device, cache_root: Path | None = None, h2d_gbps: float | None = None) -> Resources:
        """This machine now: torch.cuda.mem_get_info, psutil, shutil.disk_usage of ``cache_root``."""
        vram = int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None
        vm = psutil.virtual_memory()
        disk = _free_disk(cache_root) if cache_root is not None else None
        return cls(
            device=device.type,
            vram_free=vram,
            ram_total=int(vm.total),
            ram_available=int(vm.available),
            disk_free=disk,
            h2d_gbps=h2d_gbps,
        )


@dataclass(frozen=True)
class PlanModel:
    """The target as the plan sees it: its config, compute dtype, what else takes VRAM, and its caches."""

    cfg: ModelConfig
    dtype: torch.dtype  # compute dtype (target_dtype bf16/fp16 overrides it)
    draft_bytes: int = 0  # VRAM of the resident draft's weights
    kv_bytes: int = 0  # VRAM of the KV caches and the step's other buffers (see specexec.model.sizes.EngineMemory)
    max_tokens: int = 2048  # rows of the largest target pass (its activations, logits, NF4 scratch)
    cache_dirs: Mapping[str, Path] = field(default_factory=dict)  # layer format name -> this model's cache dir
    cached: frozenset[str] = frozenset()  # format names whose cache is complete on disk
    invariant: bool = True  # shape-invariant target passes: reserve their check and attention (invariant_reservation)
    context: int = 0  # positions a pass attends to at most (the invariant attention's chunk floor)
    attn_rows: int = 16  # the invariant attention's row tile assumed (the check's smallest CUDA candidate)

    @classmethod
    def from_checkpoint(
        cls, cfg: ModelConfig, dtype: torch.dtype, path: Path | None, cache_root: Path, **kw: Any
    ) -> PlanModel:
        """With the cache directories (and which are complete) of the checkpoint at ``path`` under ``cache_root``."""
        dirs: dict[str, Path] = {}
        done: set[str] = set()
        for fmt in (
            LayerFormat("dense", dtype),
            LayerFormat("nf4", dtype),
            LayerFormat("dense", torch.bfloat16),
            LayerFormat("dense", torch.float16),
        ):
            if path is None:
                dirs[fmt.name] = cache_root
                continue
            d = dirs[fmt.name] = cache_dir_for(cache_root, path, fmt)
            if SsdStore.open(d, layer_layout(cfg, fmt), cfg.num_layers) is not None:
                done.add(fmt.name)
        return cls(cfg=cfg, dtype=dtype, cache_dirs=dirs, cached=frozenset(done), **kw)


@dataclass(frozen=True)
class Plan:
    """Where every layer of the target lives and what that costs. Bytes are exact; GB = 1e9 bytes."""

    mode: str  # resolved: none | ram | ssd
    fmt: LayerFormat  # how layers are stored; fmt.dtype is the compute dtype
    num_layers: int
    layer_bytes: int  # one packed layer
    resident: tuple[int, ...]  # layers kept on the GPU
    streamed: tuple[int, ...]  # layers streamed every forward, in order
    ring_size: int
    lookahead: int
    device: str
    vram_budget: int | None  # bytes the target may use on the GPU (None: unlimited, CPU device)
    vram_need: int  # globals + draft + KV + workspace + ring + resident layers
    ram_available: int
    ram_need: int  # host bytes: RAM-tier layers, or the staging buffers
    disk_free: int | None
    disk_need: int  # bytes still to write into the cache (0 if it exists or is not used)
    cache_dir: Path | None  # the packed-layer cache directory (SSD tier and NF4), None if unused
    h2d_gbps: float = DEFAULT_H2D_GBPS
    h2d_measured: bool = False
    invariant_parts: Mapping[str, int] = field(default_factory=dict)  # invariant_reservation's parts ({}: none)
    check_fits: bool = True  # False: the load-time invariance check is not reserved (it does not fit)

    @property
    def invariant_reserved(self) -> int:
        """GPU bytes reserved for shape-invariant passes beyond the workspace (part of ``vram_need``)."""
        parts = dict(self.invariant_parts)
        if not self.check_fits:
            parts.pop("check", None)
        return _reserved_bytes(parts)

    @property
    def bytes_per_forward(self) -> int:
        return len(self.streamed) * self.layer_bytes

    def floor_seconds(self, h2d_gbps: float | None = None) -> float:
        """Lower bound on one forward: streamed bytes / pinned H2D bandwidth (GB/s)."""
        return self.bytes_per_forward / ((h2d_gbps or self.h2d_gbps) * GB)

    def invariant_line(self) -> str | None:
        """What the plan reserves for shape-invariant passes, in one line (None: nothing, e.g. a CPU device or
        invariant passes off); when the load-time check does not fit, the line says so and names the guarantee."""
        if not self.invariant_parts:
            return None
        p = self.invariant_parts
        if not self.check_fits:
            return (
                f"shape-invariant passes: {self.invariant_reserved / GB:.2f} GB reserved for the attention "
                "temporaries; "
                + sizes.unavailable_message(
                    f"the load-time check needs {p.get('check', 0) / GB:.2f} GB, which does not fit beside the ring; "
                    "a cached check result still applies"
                )
            )
        return (
            f"shape-invariant passes: {self.invariant_reserved / GB:.2f} GB reserved, the larger of the load-time "
            f"check's {p.get('check', 0) / GB:.2f} GB and the attention temporaries' "
            f"{p.get('attention', 0) / GB:.2f} GB"
            + (f" (the NF4 dequantization scratch, {p['scratch'] / GB:.2f} GB, is in the workspace)"
               if p.get("scratch") else "")
        )  # fmt: skip

    def describe(self, h2d_gbps: float | None = None) -> str:
        """A few lines for humans: placement, memory, bytes and the time floor per forward."""
        bw = h2d_gbps or self.h2d_gbps
        measured = "measured" if (h2d_gbps or self.h2d_measured) else "assumed; measure_h2d_bandwidth() measures it"
        n, k = self.num_layers, len(self.resident)
        budget = "unlimited" if self.vram_budget is None else f"{self.vram_budget / GB:.1f} GB"
        lines = [
            f"offload plan: mode={self.mode}, layers stored as {self.fmt.name} ({self.layer_bytes / GB:.3f} GB each) "
            f"on {self.device}",
            f"  GPU: {k} of {n} layers resident{_span(self.resident)}, {len(self.streamed)} streamed"
            + (f" through a ring of {self.ring_size} buffers (lookahead {self.lookahead})" if self.streamed else "")
            + f"; VRAM need {self.vram_need / GB:.1f} GB of {budget}",
        ]
        inv = self.invariant_line()
        if inv is not None:
            lines.append(f"  {inv}")
        if self.mode == "ram":
            lines.append(
                f"  host: {self.ram_need / GB:.1f} GB of pinned RAM ({self.ram_available / GB:.1f} GB available)"
            )
        if self.cache_dir is not None:
            todo = f", {self.disk_need / GB:.1f} GB to write" if self.disk_need else " (ready)"
            lines.append(f"  cache: {self.cache_dir}{todo}")
        lines.append(
            f"  per forward: {self.bytes_per_forward / GB:.2f} GB streamed, floor {self.floor_seconds(bw):.3f} s "
            f"at {bw:.1f} GB/s pinned H2D ({measured})"
        )
        return "\n".join(lines)


def spread(k: int, n: int) -> tuple[int, ...]:
    """Which ``k`` of ``n`` layers stay resident: spread evenly among the streamed ones, the first layer streamed.

    A streamed pass is bound by its copies; each resident layer's compute then runs while the copy engine streams
    the next streamed layer, so it costs no time as long as a streamed layer's compute leaves room beside its copy
    (an NF4 70B layer copies in ~8.7 ms on a PCIe5 link and computes in ~0.2-3 ms for 1-1024 tokens on an H200).
    Resident layers placed first would compute while the copy engine, its ring of a few buffers already full, stands
    idle: the pass would cost its copies plus the resident layers' compute (~57 ms of a 0.6 s verify of 1024 nodes
    with 19 of 80 resident). The pass begins with the streamed layers the ring prefetched while the draft ran. On an
    H200 (70B NF4, int8 7B draft, 24 GB, 1024-node trees) a spread verify takes 0.524 s against 0.531 s of copies
    (measured; see docs/BENCHMARKS.md)."""
    if k >= n:
        return tuple(range(n))
    return tuple(((j + 1) * n) // (k + 1) for j in range(max(k, 0)))  # strictly increasing: n / (k + 1) >= 1


def _span(layers: tuple[int, ...]) -> str:
    if not layers:
        return ""
    if layers == tuple(range(layers[0], layers[-1] + 1)):
        return f" ({layers[0]}-{layers[-1]})" if len(layers) > 1 else f" ({layers[0]})"
    if len(layers) > 8:
        return f" (spread: {', '.join(map(str, layers[:3]))}, ..., {layers[-1]})"
    return f" {list(layers)}"


def _free_disk(path: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``path``."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def make_plan(resources: Resources, model: PlanModel, offload: OffloadConfig = OffloadConfig()) -> Plan:
    """Decide resident layers, ring, tier and storage format; raise OutOfMemory if it cannot fit as asked.

    Pure: everything it knows about the machine is in ``resources`` and about the model in ``model`` (so load and
    ``specexec doctor`` share it, and tests give it any machine).
    """
    cfg = model.cfg
    cuda = resources.device == "cuda"
    dtype = model.dtype
    if offload.target_dtype in ("bf16", "fp16"):
        dtype = torch.bfloat16 if offload.target_dtype == "bf16" else torch.float16
    n = cfg.num_layers
    R = offload.ring

    if cuda:
        budget: int | None = max(0, (resources.vram_free or 0) - VRAM_HEADROOM)
        if offload.gpu_memory_gb is not None:
            budget = min(budget, int(offload.gpu_memory_gb * GB))  # type: ignore[type-var]
    else:
        budget = int(offload.gpu_memory_gb * GB) if offload.gpu_memory_gb is not None else None
    device = torch.device(resources.device)

    def invariant_parts(fmt: LayerFormat) -> dict[str, int]:
        if not model.invariant:
            return {}
        return invariant_reservation(cfg, fmt, device, model.context, model.max_tokens, model.attn_rows)

    def fixed(fmt: LayerFormat, check: bool = True) -> int:
        parts = invariant_parts(fmt)
        if not check:
            parts.pop("check", None)
        return (
            globals_bytes(cfg, dtype)
            + model.draft_bytes
            + model.kv_bytes
            + workspace_bytes(cfg, fmt, device, model.max_tokens)
            + _reserved_bytes(parts)
        )

    def fits_all(fmt: LayerFormat) -> bool:
        return budget is None or fixed(fmt) + n * layer_layout(cfg, fmt).nbytes <= budget

    dense, nf4 = LayerFormat("dense", dtype), LayerFormat("nf4", dtype)
    if offload.target_dtype == "nf4":
        fmt = nf4
    elif offload.target_dtype == "auto" and cuda and not fits_all(dense):
        fmt = nf4
    else:
        fmt = dense
    lb = layer_layout(cfg, fmt).nbytes
    fixed_bytes = fixed(fmt)
    check_fits = True
    if budget is not None and offload.mode != "none" and fixed_bytes + R * lb > budget >= fixed(fmt, False) + R * lb:
        # the load-time check does not fit even beside a bare ring, the passes do: plan without it; the check then
        # reports in one line that it could not run, and which guarantee holds (sizes.unavailable_message)
        check_fits, fixed_bytes = False, fixed(fmt, False)

    mode = offload.mode
    if mode == "auto":
        mode = "none" if fits_all(fmt) else "stream"  # CPU without gpu_memory_gb: unlimited, always none
    if mode == "none":
        if not fits_all(fmt):
            raise OutOfMemory(
                f"the target needs {(fixed_bytes + n * lb) / GB:.1f} GB of VRAM with every layer on the GPU "
                f"({fmt.name}), but the budget is {(budget or 0) / GB:.1f} GB: use {setting('OffloadConfig.mode')} "
                "auto, ram or ssd"
                + ("" if fmt.kind == "nf4" else f", or {setting('OffloadConfig.target_dtype', 'nf4')}"),
                "GPU memory",
                fixed_bytes + n * lb,
                budget,
            )
        k = n
    else:
        k = _resident_count(offload, n, lb, R, fixed_bytes, budget, fmt)
    resident = spread(k, n)
    streamed = tuple(i for i in range(n) if i not in resident)
    vram_need = fixed_bytes + k * lb + (R * lb if streamed else 0)

    ram_avail = resources.ram_available
    ram_room = ram_avail - max(RAM_MARGIN_MIN, int(RAM_MARGIN_FRACTION * resources.ram_total))
    host_bytes = len(streamed) * lb
    staging = STAGING_BUFFERS * min(CHUNK_BYTES, lb)
    if mode == "stream":
        mode = "ram" if host_bytes <= ram_room else "ssd"
    if mode == "ram" and host_bytes > ram_room:
        raise OutOfMemory(
            f"{setting('OffloadConfig.mode', 'ram')} needs {host_bytes / GB:.1f} GB of RAM for {len(streamed)} "
            f"streamed {fmt.name} layers, but only {max(ram_room, 0) / GB:.1f} GB is available after a safety margin "
            f"({ram_avail / GB:.1f} GB free): use {setting('OffloadConfig.mode', 'ssd')}"
            + ("" if fmt.kind == "nf4" else f", {setting('OffloadConfig.target_dtype', 'nf4')}")
            + ", or free some memory",
            "RAM",
            host_bytes,
            max(ram_room, 0),
        )
    ram_need = host_bytes if mode == "ram" else (staging if streamed else 0)
    if mode == "ssd" and ram_need > ram_room:
        raise OutOfMemory(
            f"not enough RAM for {ram_need / GB:.2f} GB of staging buffers ({ram_avail / GB:.1f} GB free)",
            "RAM",
            ram_need,
            max(ram_room, 0),
        )

    cache_dir: Path | None = None
    disk_free: int | None = None
    disk_need = 0
    if mode == "ssd" or fmt.kind == "nf4":
        cache_dir = model.cache_dirs.get(fmt.name, offload.offload_root)
        disk_need = 0 if fmt.name in model.cached else n * lb
        disk_free = resources.disk_free
        if disk_need and disk_free is not None and disk_need + DISK_MARGIN > disk_free:
            why = "the SSD tier" if mode == "ssd" else "the NF4 cache (quantized once, reused by later starts)"
            raise OutOfMemory(
                f"{why} needs {disk_need / GB:.1f} GB of disk in {cache_dir}, but only {disk_free / GB:.1f} GB "
                f"is free: point the cache ({setting('OffloadConfig.cache_dir')}, or the SPECEXEC_HOME environment "
                "variable) at a disk with more space",
                "disk",
                disk_need,
                disk_free,
            )
    h2d = resources.h2d_gbps
    return Plan(
        mode=mode,
        fmt=fmt,
        num_layers=n,
        layer_bytes=lb,
        resident=resident,
        streamed=streamed,
        ring_size=R,
        lookahead=offload.lookahead,
        device=resources.device,
        vram_budget=budget,
        vram_need=vram_need,
        ram_available=ram_avail,
        ram_need=ram_need,
        disk_free=disk_free,
        disk_need=disk_need,
        cache_dir=cache_dir,
        h2d_gbps=h2d or DEFAULT_H2D_GBPS,
        h2d_measured=h2d is not None,
        invariant_parts=invariant_parts(fmt),
        check_fits=check_fits,
    )


def _resident_count(
    offload: OffloadConfig, n: int, lb: int, R: int, fixed: int, budget: int | None, fmt: LayerFormat
) -> int:
    """How many layers stay on the GPU when streaming; raises if even the ring does not fit."""
    if offload.resident_layers is not None:
        k = min(offload.resident_layers, n)
        need = fixed + k * lb + (R * lb if k < n else 0)
        if budget is not None and need > budget:
            raise OutOfMemory(
                f"{k} resident layers + a ring of {R} need {need / GB:.1f} GB of VRAM, "
                f"the budget is {budget / GB:.1f} GB: ask for fewer {setting('OffloadConfig.resident_layers')}",
                "GPU memory",
                need,
                budget,
            )
        return k
    if budget is None or fixed + n * lb <= budget:
        return n
    k = (budget - fixed - R * lb) // lb
    if k < 0:
        raise OutOfMemory(
            f"VRAM too small to stream the target: globals, draft, KV cache, workspace and reservations take "
            f"{fixed / GB:.1f} GB "
            f"and a ring of {R} {fmt.name} layer buffers {R * lb / GB:.1f} GB, but the budget is "
            f"{budget / GB:.1f} GB: lower {setting('context')}, use a smaller draft"
            + ("" if fmt.kind == "nf4" else f", or {setting('OffloadConfig.target_dtype', 'nf4')}"),
            "GPU memory",
            fixed + R * lb,
            budget,
        )
    return int(min(k, n))


def best_copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int, warmup: int = 3) -> float:
    """The fastest of ``repeats`` ``dst.copy_(src)`` on the current CUDA stream, timed with CUDA events, after
    ``warmup`` untimed copies (a PCIe link may idle in a low-power state)."""
    for _ in range(warmup):
        dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(dst.device)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measure_h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Pinned host→device copy bandwidth in GB/s (1e9 bytes/s): one big copy timed with CUDA events, best of
    ``repeats`` after three warm-up copies."""
    if device.type != "cuda":
        raise ValueError("measure_h2d_bandwidth needs a CUDA device")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / best_copy_seconds(dst, src, repeats) / GB
