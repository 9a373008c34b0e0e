"""``specexec doctor``: what this machine offers (GPU, VRAM, RAM, CPU, host→device and disk bandwidth, library
versions) and, for a target model, a placement recommendation computed from its ``config.json`` alone.

On a GPU the recommendation IS the offload manager's plan (:func:`offload.plan.make_plan` fed this machine's
figures): 16-bit on the GPU if it fits; otherwise NF4 (3.6x fewer bytes per streamed pass), as many layers resident
(spread among the streamed ones) as VRAM allows after the globals, KV cache, tree buffers and the ring of
streamed-layer buffers, the rest streamed from pinned RAM if it fits there, else from SSD. Models need not be
downloaded: an alias that is not present is planned from the architecture recorded in configs/models.toml. The floor
of one target pass is the streamed bytes over the bandwidth that feeds them (pinned H2D for RAM, min(disk, H2D) for
SSD).
Bandwidths are measured here where possible, else assumed and labelled so. GB = 1e9 bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from specexec.config import TreeConfig
from specexec.errors import SpecexecError
from specexec.loading import draft_choice
from specexec.model import sizes
from specexec.model.sizes import layer_bytes, param_count
from specexec.model.transformer import ModelConfig

log = logging.getLogger(__name__)

GB = 1e9
MIB = 1 << 20
ASSUMED_H2D_GBPS = 25.0  # pinned host→device, PCIe 4.0 x16, when not measured
ASSUMED_RAM_GBPS = 20.0  # CPU-only: memory bandwidth a decoder pass reads its weights at (rough)
LIBRARIES = ("torch", "transformers", "bitsandbytes", "safetensors", "accelerate", "huggingface_hub", "specexec")


@dataclass
class GpuInfo:
    """One CUDA device and its measured host→device copy bandwidth (GB/s; None when not measurable)."""

    name: str
    vram_total: int
    vram_free: int
    pinned_h2d_gbps: float | None = None
    pageable_h2d_gbps: float | None = None
    device_gbps: float | None = None  # device memory bandwidth (what a resident draft's passes read)
    note: str = ""
    capability: tuple[int, int] | None = None  # CUDA compute capability (None: unknown)


@dataclass
class DiskInfo:
    """Sequential read bandwidth of the cache directory's disk and how page-cache effects were avoided."""

    directory: str
    read_gbps: float | None
    method: str  # "O_DIRECT", "fadvise(DONTNEED)" or "buffered"
    note: str = ""


@dataclass
class SystemInfo:
    cpu_model: str
    cpu_cores: int | None  # physical
    cpu_threads: int | None  # logical
    ram_total: int
    ram_available: int
    gpu: GpuInfo | None
    cuda_note: str  # "" when a CUDA GPU is present, else "no CUDA GPU: CPU-only mode"
    disk: DiskInfo | None
    versions: dict[str, str | None] = field(default_factory=dict)
    cache_disk_free: int | None = None  # free bytes on the cache's filesystem (None: unknown)
    cpu_kernels: str = ""  # the package's C kernels (4-bit weights, CPU attention): "built" or why not


@dataclass
class Recommendation:
    """Where a target's layers should live on this machine, from its config.json."""

    target: str
    present: bool
    config_path: str | None = None
    note: str = ""  # why no recommendation (not present locally), or remarks
    params: int | None = None
    num_layers: int | None = None
    layer_gb_bf16: float | None = None
    layer_gb_nf4: float | None = None
    dtype: str | None = None  # bf16 | nf4 | fp32 (CPU)
    tier: str | None = None  # none | ram | ssd | cpu | does-not-fit
    resident_layers: int | None = None
    streamed_layers: int | None = None
    streamed_gb_per_pass: float | None = None
    floor_s_per_pass: float | None = None
    bandwidth_gbps: float | None = None
    bandwidth: str = ""  # what the floor's bandwidth is and whether it was measured
    notes: list[str] = field(default_factory=list)
    draft: str | None = None  # the draft the plan charged (``--draft``), if any
    draft_dtype: str | None = None  # its weight format that ``--draft-dtype auto`` would load: 16-bit, int8, nf4
    # per draft precision: draft GB, resident target layers, streamed GB and floor per pass (None: does not fit)
    draft_options: list[dict[str, Any]] = field(default_factory=list)
    max_budget: int | None = None  # --budget auto's largest tree when load must lower --max-budget to fit (GPU)
    draft_choice: str | None = None  # which draft --draft auto loads beside this target, and why (one line)


@dataclass
class ProbeInfo:
    """One cached one-time measurement: what it chose (``line``), when, and whether the machine was busy then."""

    kind: str  # "cpu dtype", "cpu matmuls", "cpu target format", "cpu draft format", "pass costs"
    line: str
    measured_at: float  # unix seconds (0: unknown)
    provisional: bool = False  # measured under load: measured again at the next quiet start
    stale: str = ""  # why run-time figures contradicted it
    load: dict[str, Any] = field(default_factory=dict)


@dataclass
class DoctorReport:
    system: SystemInfo
    recommendation: Recommendation | None = None
    probes: list[ProbeInfo] = field(default_factory=list)
    remeasured: str = ""  # what ``--remeasure`` dropped and measured again

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo on Linux, else platform)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def versions() -> dict[str, str | None]:
    """Installed versions of the libraries that matter (None: not installed), plus CUDA as torch sees it."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["cuda (torch)"] = torch.version.cuda
    out["python"] = platform.python_version()
    return out


def h2d_gbps(device: torch.device, pinned: bool, nbytes: int = 256 * MIB, repeats: int = 3) -> float:
    """Host→device copy bandwidth (GB/s), best of ``repeats`` copies of ``nbytes``, timed with CUDA events."""
    from offload.plan import best_copy_seconds

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / best_copy_seconds(dst, src, repeats, warmup=1) / GB


def gpu_info(measure: bool = True) -> GpuInfo | None:
    """The first CUDA device (None without one), with pinned and pageable H2D bandwidth if ``measure``."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", 0)
    free, total = torch.cuda.mem_get_info(dev)
    info = GpuInfo(
        name=torch.cuda.get_device_name(dev),
        vram_total=int(total),
        vram_free=int(free),
        capability=tuple(torch.cuda.get_device_capability(dev)),  # type: ignore[arg-type]
    )
    if measure:
        try:
            info.pinned_h2d_gbps = h2d_gbps(dev, pinned=True)
        except RuntimeError as e:  # pinning refused (e.g. WSL caps pinned memory)
            info.note = f"pinned allocation failed ({str(e).splitlines()[0]}): the offload manager stages copies"
        info.pageable_h2d_gbps = h2d_gbps(dev, pinned=False)
        try:
            info.device_gbps = draft_choice.device_memory_gbps(dev)
        except RuntimeError:  # no room for the test buffers: the draft choice assumes a consumer card's
            info.device_gbps = None
        torch.cuda.empty_cache()
    return info


def _write_file(path: Path, nbytes: int) -> None:
    chunk = os.urandom(16 * MIB)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())


def _timed_read(path: Path, flags: int) -> float:
    """Seconds to read ``path`` sequentially in 16 MiB chunks into a page-aligned buffer."""
    buf = mmap.mmap(-1, 16 * MIB)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()


def _drop_cached(path: Path) -> bool:
    """Ask the kernel to evict ``path``'s pages from the page cache (the file is fsynced, so they are clean)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def disk_read(directory: Path, size_mb: int = 256) -> DiskInfo:
    """Write a ``size_mb`` MiB temp file in ``directory``, then time reading it back without the page cache:
    O_DIRECT where the filesystem allows it, else after posix_fadvise(DONTNEED), else plain (optimistic)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".doctor-", suffix=".bin", dir=directory)
    os.close(fd)
    path = Path(name)
    nbytes = size_mb * MIB
    try:
        _write_file(path, nbytes)
        direct = getattr(os, "O_DIRECT", 0)
        if direct:
            try:
                return DiskInfo(str(directory), nbytes / _timed_read(path, direct) / GB, "O_DIRECT")
            except OSError as e:  # tmpfs and some overlay filesystems refuse O_DIRECT
                log.debug("O_DIRECT read failed: %s", e)
        if _drop_cached(path):
            return DiskInfo(
                str(directory),
                nbytes / _timed_read(path, 0) / GB,
                "fadvise(DONTNEED)",
                note="page cache dropped for the file; a RAM-backed filesystem still reads at RAM speed",
            )
        return DiskInfo(
            str(directory),
            nbytes / _timed_read(path, 0) / GB,
            "buffered",
            note="could not bypass the page cache: the figure is optimistic",
        )
    except OSError as e:
        return DiskInfo(str(directory), None, "none", note=f"disk test failed: {e.strerror or e}")
    finally:
        path.unlink(missing_ok=True)


def _free_disk(path: Path) -> int | None:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return int(shutil.disk_usage(p).free)
    except OSError:
        return None


def system_info(disk_dir: Path | None = None, disk_mb: int = 256, measure: bool = True) -> SystemInfo:
    """Everything about this machine the planner cares about (``measure=False`` skips the timed tests)."""
    from specexec.loading import hub

    vm = psutil.virtual_memory()
    gpu = gpu_info(measure)
    disk = disk_read(disk_dir or hub.cache_home(), disk_mb) if measure and disk_mb > 0 else None
    return SystemInfo(
        cache_disk_free=_free_disk(disk_dir or hub.cache_home()),
        cpu_model=cpu_model(),
        cpu_cores=psutil.cpu_count(logical=False),
        cpu_threads=psutil.cpu_count(),
        ram_total=int(vm.total),
        ram_available=int(vm.available),
        gpu=gpu,
        cuda_note="" if gpu else "no CUDA GPU: CPU-only mode",
        disk=disk,
        versions=versions(),
        cpu_kernels=_cpu_kernels(),
    )


def _cpu_kernels() -> str:
    """Whether the package's C kernels (:mod:`specexec.formats.native`) build and load here (compiled on the first
    call, then cached), and what runs without them."""
    from specexec.formats import native

    why = native.available()
    if why is None:
        return "built: 4-bit CPU weights (--target-dtype q4) and the CPU attention kernel"
    return f"{why}: no 4-bit CPU weights; attention runs in torch"


# ---------------------------------------------------------------------------------------------- the model


def model_config(spec: str, home: Path | None = None) -> tuple[ModelConfig | None, str, str]:
    """The architecture of a model spec without downloading anything: (config or None, where it came from, why
    None). A local path or a downloaded alias gives its config.json; an alias not downloaded gives the architecture
    recorded in configs/models.toml; an HF id gives its config.json if the HF cache holds it, else None with the
    reason. A spec that is none of these (unknown alias, missing path) raises :class:`SpecexecError`. ``home``:
    the cache root aliases are looked up in (default :func:`specexec.loading.hub.cache_home`)."""
    import json

    from specexec.loading import hub

    source: Path | None = None
    if spec in hub.aliases():
        if hub.is_present(spec, home):
            source = hub.local_path(spec, home) / "config.json"
        else:
            known = hub.known_config(spec)
            if known is None:
                return None, "", f"{spec} is not downloaded and configs/models.toml has no architecture for it"
            return _parse(known, "configs/models.toml"), f"configs/models.toml (alias {spec}, not downloaded)", ""  # type: ignore[arg-type]
    else:
        try:
            path = hub.resolve(spec, pull_missing=False, progress=False, home=home)
        except SpecexecError as e:
            if not hub._HF_ID.match(spec) or hub._looks_like_path(spec):
                raise  # an unknown alias or a missing path: a user error, not a missing download
            source = _cached_hf_config(spec)
            if source is None:
                return None, "", f"{spec} is not present locally ({e})"
        else:
            directory = path.parent if path.is_file() else path
            source = directory / "config.json"
            if not source.is_file():
                return (
                    None,
                    "",
                    (f"no config.json in {directory} (a GGUF file gets one when specexec first converts it)"),
                )
    try:
        raw = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        raise SpecexecError(f"cannot read {source}: {e}") from None
    return _parse(raw, str(source)), str(source), ""


def _parse(raw: dict, where: str) -> ModelConfig:
    try:
        return ModelConfig.from_hf(raw)
    except (ValueError, KeyError) as e:
        raise SpecexecError(f"cannot use the model config in {where}: {e}") from None


def _cached_hf_config(spec: str) -> Path | None:
    """config.json of an HF id if that one file is in the HF cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(spec, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def recommend(
    spec: str,
    system: SystemInfo,
    context: int = 4096,
    home: Path | None = None,
    draft: str | None = None,
) -> Recommendation:
    """Dtype, tier, resident layers and the per-pass floor for target ``spec`` on this machine (config only:
    nothing is downloaded). Unknown specs raise :class:`SpecexecError`. ``draft``: a draft model (alias, id or
    path) charged to the plan: on a GPU each of its precisions (16-bit, int8, nf4) is planned, and the one
    ``--draft-dtype auto`` would load (the first that fits, as :func:`specexec.loading.offloaded.plan_with_draft`)
    sets the recommendation. ``draft`` "self": a self-derived draft (the target's own weights), planned in nf4,
    what ``--draft self`` loads on a GPU."""
    from specexec.loading.checkpoint import SELF_DRAFT

    cfg, source, why = model_config(spec, home)
    if cfg is None:
        return Recommendation(target=spec, present=False, note=why)
    d_cfg = None
    if draft == SELF_DRAFT:
        d_cfg = cfg
    elif draft is not None:
        d_cfg, _, d_why = model_config(draft, home)
        if d_cfg is None:
            return Recommendation(target=spec, present=False, note=f"draft {draft}: {d_why}", draft=draft)
    rec = Recommendation(
        target=spec,
        present=True,
        config_path=source,
        params=param_count(cfg),
        num_layers=cfg.num_layers,
        layer_gb_bf16=layer_bytes(cfg, "bf16") / GB,
        layer_gb_nf4=layer_bytes(cfg, "nf4") / GB,
    )
    if "models.toml" in source:
        rec.notes.append("planned from the architecture in configs/models.toml (the model is not downloaded)")
    rec.draft = draft
    context = min(context, cfg.max_position_embeddings)
    if system.gpu is None:
        _recommend_cpu(rec, cfg, system, context)
        if draft is not None:
            rec.notes.append(f"draft {draft}: planned on a GPU only (here it shares the RAM with the target)")
    else:
        _recommend_gpu(rec, cfg, system, context, home, d_cfg)
    return rec


def _recommend_cpu(rec: Recommendation, cfg: ModelConfig, system: SystemInfo, context: int) -> None:
    """CPU-only: the whole model lives in RAM (fp32 if it fits, else bf16); a pass reads every weight."""
    from specexec.loading.memory import NotEnoughMemory, check_engine

    rec.tier, rec.resident_layers, rec.streamed_layers = "cpu", cfg.num_layers, 0
    tree = TreeConfig()
    for dtype, nbytes in (("fp32", 4), ("bf16", 2)):
        try:
            check_engine(cfg, None, torch.device("cpu"), context, nbytes, nbytes, tree, have=system.ram_available)
        except NotEnoughMemory:
            continue
        rec.dtype = dtype
        break
    else:
        rec.dtype, rec.tier = "bf16", "does-not-fit"
        rec.notes.append(
            f"even bf16 needs {param_count(cfg) * 2 / GB:.1f} GB of RAM, "
            f"{system.ram_available / GB:.1f} GB is available: use a CUDA GPU with offload"
        )
    weights = param_count(cfg) * (4 if rec.dtype == "fp32" else 2)
    rec.streamed_gb_per_pass = 0.0
    rec.bandwidth_gbps = ASSUMED_RAM_GBPS
    rec.bandwidth = f"RAM bandwidth {ASSUMED_RAM_GBPS:.0f} GB/s (assumed; CPU compute is usually slower still)"
    rec.floor_s_per_pass = weights / (ASSUMED_RAM_GBPS * GB)
    rec.notes.append("no CUDA GPU: CPU-only mode (offload tiers apply to GPUs only)")


def _recommend_gpu(
    rec: Recommendation,
    cfg: ModelConfig,
    system: SystemInfo,
    context: int,
    home: Path | None = None,
    d_cfg: ModelConfig | None = None,
) -> None:
    """GPU: the offload manager's own plan (:func:`offload.plan.make_plan`) for this machine's figures."""
    from offload.plan import OffloadConfig, PlanModel, Resources, make_plan

    gpu = system.gpu
    assert gpu is not None
    # the trees `generate`/`chat`/`serve` grow by default (--budget auto up to --max-budget 2048, n-gram branches
    # merged): what load reserves KV and workspace for before it places target layers
    tree = TreeConfig(auto=True)
    resources = Resources(
        device="cuda",
        vram_free=gpu.vram_free,
        ram_total=system.ram_total,
        ram_available=system.ram_available,
        disk_free=system.cache_disk_free,
        h2d_gbps=gpu.pinned_h2d_gbps,
    )
    h2d = gpu.pinned_h2d_gbps or ASSUMED_H2D_GBPS
    plan = None
    plans: dict[str, Any] = {}  # format -> its plan, for those that fit
    error: SpecexecError | None = None
    from specexec.loading.checkpoint import SELF_DRAFT

    self_draft = rec.draft == SELF_DRAFT
    # the formats load's --draft-dtype auto weighs on this GPU (int8 needs compute capability 7.5+)
    lighter = draft_choice.lighter_formats(gpu.capability) if gpu.capability is not None else ["int8", "nf4"]
    formats = ("nf4",) if self_draft else ("dense", *lighter) if d_cfg is not None else ("dense",)
    # as load does: where the default trees' reservation leaves no room for the streamed target beside any draft
    # format, smaller --max-budget caps are tried (sizes.fitting_caps)
    for cap in sizes.fitting_caps(tree):
        rec.draft_options, plans, plan = [], {}, None
        for fmt in formats:
            d_bytes = sizes.model_weight_bytes(d_cfg, fmt, 2) if d_cfg is not None else 0
            res = sizes.plan_reservations(cfg, d_cfg, context, 2, 2, cap, draft_weights=d_bytes)  # as load charges
            model = PlanModel(
                cfg, torch.bfloat16, draft_bytes=d_bytes, kv_bytes=res.kv_bytes, max_tokens=res.max_tokens,
                context=context,
            )  # fmt: skip
            name = {"dense": "16-bit"}.get(fmt, fmt)
            try:
                p = make_plan(resources, model, OffloadConfig(cache_dir=home))
            except SpecexecError as e:
                error = e  # the lightest draft's reason is the one to act on
                rec.draft_options.append({"draft_dtype": name, "draft_gb": d_bytes / GB, "fits": False, "why": str(e)})
                continue
            rec.draft_options.append(
                {
                    "draft_dtype": name,
                    "draft_gb": d_bytes / GB,
                    "fits": True,
                    "target_dtype": "nf4" if p.fmt.kind == "nf4" else "bf16",
                    "resident_layers": len(p.resident),
                    "streamed_gb_per_pass": p.bytes_per_forward / GB,
                    "floor_s_per_pass": p.bytes_per_forward / (h2d * GB),
                }
            )
            plans[fmt] = p
            if plan is None:
                plan, rec.draft_dtype = p, name if d_cfg is not None else None
        if plans:
            if cap.max_budget < tree.max_budget:
                rec.max_budget = cap.max_budget
                rec.notes.append(
                    f"--max-budget lowered to {cap.max_budget} (what load does): trees up to {tree.max_budget} "
                    "would leave no GPU memory for streaming the target"
                )
            break
    if d_cfg is None:
        rec.draft_options = []
    elif not self_draft and len(plans) > 1:  # what --draft-dtype auto weighs (specexec/loading/draft_choice.py)
        dev_gbps = gpu.device_gbps or draft_choice.ASSUMED_DEVICE_GBPS
        opts = draft_choice.plan_options(d_cfg, cfg, plans, h2d, dev_gbps)
        best = draft_choice.choose(opts)
        plan, rec.draft_dtype = plans[best.fmt], {"dense": "16-bit"}.get(best.fmt, best.fmt)
        by_name = {o["draft_dtype"]: o for o in rec.draft_options}
        for o in opts:
            by_name[{"dense": "16-bit"}.get(o.fmt, o.fmt)].update(
                modelled_ms_per_token=o.s_per_token * 1e3, keep_prior=o.keep, break_even_keep=o.break_even_keep
            )
    if plan is None:
        rec.tier = "does-not-fit"
        tried = f" (the draft in {', '.join(o['draft_dtype'] for o in rec.draft_options)})" if d_cfg else ""
        rec.notes.append(f"{error}{tried}")
        return
    if d_cfg is not None:
        alts = ", ".join(
            f"{o['draft_dtype']} {o['draft_gb']:.1f} GB -> "
            + (f"{o['resident_layers']} resident, {o['floor_s_per_pass']:.2f} s/pass" if o["fits"] else "does not fit")
            + (f", ~{o['modelled_ms_per_token']:.0f} ms/token modelled" if "modelled_ms_per_token" in o else "")
            for o in rec.draft_options
        )
        if self_draft:
            what = f"self-derived draft (the target's own weights) in {rec.draft_dtype}"
            auto = "what --draft self loads on a GPU"
        else:
            what = f"draft {rec.draft} in {rec.draft_dtype}"
            auto = (
                "what --draft-dtype auto loads: the least modelled time a token, streamed bytes against draft passes "
                "and acceptance"
                if len(plans) > 1
                else "what --draft-dtype auto loads: the first that fits"
            )
        rec.notes.append(f"{what} ({auto}); by draft precision: {alts}")
    rec.dtype = "nf4" if plan.fmt.kind == "nf4" else "bf16"
    rec.tier = plan.mode
    rec.resident_layers, rec.streamed_layers = len(plan.resident), len(plan.streamed)
    inv = plan.invariant_line()  # what the placement reserves for shape-invariant passes (load's default)
    if inv is not None:
        rec.notes.append(inv)
    n = cfg.num_layers
    if plan.fmt.kind == "nf4":
        bf16_floor = n * layer_bytes(cfg, "bf16") / ((gpu.pinned_h2d_gbps or ASSUMED_H2D_GBPS) * GB)
        rec.notes.append(f"streaming all layers in bf16 instead would take >= {bf16_floor:.2f} s per pass")
    streamed_bytes = plan.bytes_per_forward
    rec.streamed_gb_per_pass = streamed_bytes / GB
    h2d_src = "measured" if gpu.pinned_h2d_gbps else "assumed"
    if rec.tier == "ssd":
        disk = system.disk.read_gbps if system.disk and system.disk.read_gbps else None
        bw = min(h2d, disk) if disk else h2d
        rec.bandwidth = (
            f"disk {disk:.2f} GB/s (measured)" if disk and disk < h2d else f"pinned H2D {h2d:.1f} GB/s ({h2d_src})"
        )
    else:
        bw = h2d
        rec.bandwidth = f"pinned H2D {h2d:.1f} GB/s ({h2d_src})"
    rec.bandwidth_gbps = bw
    rec.floor_s_per_pass = streamed_bytes / (bw * GB)


# ---------------------------------------------------------------------------------------------- cached probes


def costs_dir(home: Path | None = None) -> Path:
    """Where the engines cache the policy's measured pass costs (as :func:`specexec.api.load` sets it)."""
    from specexec.loading import hub

    return hub.cache_home(home) / "costs"


def probes(home: Path | None = None) -> list[ProbeInfo]:
    """Every cached one-time measurement of this machine: the CPU probes (:mod:`specexec.loading.cpu_probe`, each
    with its load record) and the policy's pass costs (one file per machine and model; when each was written). The
    invariance check's cache is not listed: a correctness check, not a timing, which load cannot fool."""
    from specexec.loading import cpu_probe

    out = []
    for r in cpu_probe.entries():
        kind = (
            "cpu matmuls"
            if isinstance(r, cpu_probe.OrientResult)
            else f"cpu {r.key.split(' ', 1)[0]} format"
            if isinstance(r, cpu_probe.FormatProbe)
            else "cpu dtype"
        )
        out.append(ProbeInfo(kind, cpu_probe.entry_line(r), r.measured_at, r.provisional, r.stale, r.load))
    files = sorted(costs_dir(home).glob("*.json")) if costs_dir(home).is_dir() else []
    if files:
        newest = max(f.stat().st_mtime for f in files)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(newest))
        line = f"pass costs: {len(files)} cached in {costs_dir(home)} (newest {when}; re-measured when steps drift)"
        out.append(ProbeInfo("pass costs", line, newest))
    return out


def remeasure(target: str | None = None, home: Path | None = None, gpu: bool = False) -> str:
    """Drop every cached one-time measurement (CPU probes and pass costs) so it is measured again; for a CPU
    ``target`` (config.json, or the architecture configs/models.toml records) and the draft ``--draft auto`` gives
    it, measure its CPU probes right away. Returns what was done (one line). Raises OSError where the cache
    cannot be written."""
    from specexec.loading import cpu_probe, pairing

    dropped = cpu_probe.forget()
    files = list(costs_dir(home).glob("*.json")) if costs_dir(home).is_dir() else []
    for f in files:
        f.unlink(missing_ok=True)
    done = f"dropped {dropped} cached CPU probe(s) and {len(files)} pass-cost file(s)"
    if target is None or gpu:
        return done + "; each is measured again at the next start that needs it"
    measured = []
    cfgs = {"target": model_config(target, home)[0]}
    draft = pairing.choose_draft(target, home).draft
    if draft is not None:
        cfgs["draft"] = model_config(draft, home)[0]
    for what, cfg in cfgs.items():
        if cfg is None:
            continue
        if what == "target":
            fmt, dt = cpu_probe.choose_target(cfg)
        else:
            dt, fmt = cpu_probe.choose_draft(cfg)
        cpu_probe.orientation(cfg, dt)
        measured.append(f"{what} {fmt if fmt != 'dense' else str(dt).removeprefix('torch.')}")
    fresh = [i for i in probes(home) if i.kind != "pass costs"]
    if not fresh:
        return done + f"; {target}'s models are too small to probe"
    busy = " (provisional: the machine is busy)" if any(i.provisional for i in fresh) else ""
    return done + f"; measured now: {', '.join(measured)}{busy}"


def run_doctor(
    target: str | None = None,
    draft: str | None = None,
    context: int = 4096,
    disk_mb: int = 256,
    measure: bool = True,
    disk_dir: Path | None = None,
    home: Path | None = None,
    remeasure_probes: bool = False,
) -> DoctorReport:
    """The whole report: the machine, plus a recommendation for ``target`` if given. ``home``: specexec's cache
    root (``--cache-dir``; default :func:`specexec.loading.hub.cache_home`), where models are looked up and whose disk
    is
    measured unless ``disk_dir`` is given. Without ``draft`` (or with ``"auto"``) the recommendation says which
    draft ``--draft auto`` would load (:func:`specexec.loading.pairing.choose_draft`); ``"auto"`` also charges it
    to the plan. ``remeasure_probes``: drop the cached one-time measurements first (:func:`remeasure`); the
    report lists what is cached (:func:`probes`)."""
    from specexec.loading import hub, pairing

    system = system_info(disk_dir or (hub.cache_home(home) if home is not None else None), disk_mb, measure)
    again = remeasure(target, home, gpu=system.gpu is not None) if remeasure_probes else ""
    if not target:
        return DoctorReport(system=system, probes=probes(home), remeasured=again)
    choice = pairing.choose_draft(target, home) if draft in (None, pairing.AUTO) else None
    planned = choice.draft if draft == pairing.AUTO and choice is not None else draft
    rec = recommend(target, system, context, home, planned)
    if choice is not None:
        rec.draft_choice = choice.line
    return DoctorReport(system=system, recommendation=rec, probes=probes(home), remeasured=again)
