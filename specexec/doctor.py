"""``specexec doctor``: what this machine offers (GPU, VRAM, RAM, CPU, host→device and disk bandwidth, library
versions) and, for a target model, a placement recommendation computed from its ``config.json`` alone.

The recommendation mirrors the offload manager's rules (DESIGN.md, :mod:`offload.plan`): keep everything on the
GPU in 16-bit if it fits; otherwise store the target in NF4 (3.6x fewer bytes per streamed pass), keep as many
leading layers resident as VRAM allows after the globals, KV cache, workspace and a ring of two streamed-layer
buffers, and stream the rest from pinned RAM if it fits there, else from SSD. The floor of one target pass is the
streamed bytes over the bandwidth that feeds them (pinned H2D for RAM, min(disk, H2D) for SSD).
Bandwidths are measured here where possible, else assumed and labelled so. GB = 1e9 bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from specexec.errors import SpecexecError
from specexec.memory import global_params, kv_bytes_per_token, layer_bytes, param_count
from specexec.model import ModelConfig

log = logging.getLogger(__name__)

GB = 1e9
MIB = 1 << 20
ASSUMED_H2D_GBPS = 25.0  # pinned host→device, PCIe 4.0 x16, when not measured
ASSUMED_RAM_GBPS = 20.0  # CPU-only: memory bandwidth a decoder pass reads its weights at (rough)
VRAM_HEADROOM = 1 << 29  # allocator fragmentation, cuBLAS workspaces
RING_BUFFERS = 2  # streamed-layer buffers on the GPU
TREE_TOKENS = 256  # tree size the workspace is sized for
LIBRARIES = ("torch", "transformers", "bitsandbytes", "safetensors", "accelerate", "huggingface_hub", "specexec")


@dataclass
class GpuInfo:
    """One CUDA device and its measured host→device copy bandwidth (GB/s; None when not measurable)."""

    name: str
    vram_total: int
    vram_free: int
    pinned_h2d_gbps: float | None = None
    pageable_h2d_gbps: float | None = None
    note: str = ""


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


@dataclass
class DoctorReport:
    system: SystemInfo
    recommendation: Recommendation | None = None

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
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=pinned)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start.record()
        dst.copy_(src, non_blocking=pinned)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best / GB


def gpu_info(measure: bool = True) -> GpuInfo | None:
    """The first CUDA device (None without one), with pinned and pageable H2D bandwidth if ``measure``."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", 0)
    free, total = torch.cuda.mem_get_info(dev)
    info = GpuInfo(name=torch.cuda.get_device_name(dev), vram_total=int(total), vram_free=int(free))
    if measure:
        try:
            info.pinned_h2d_gbps = h2d_gbps(dev, pinned=True)
        except RuntimeError as e:  # pinning refused (e.g. WSL caps pinned memory)
            info.note = f"pinned allocation failed ({str(e).splitlines()[0]}): the offload manager stages copies"
        info.pageable_h2d_gbps = h2d_gbps(dev, pinned=False)
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
            return DiskInfo(str(directory), nbytes / _timed_read(path, 0) / GB, "fadvise(DONTNEED)",
                            note="page cache dropped for the file; a RAM-backed filesystem still reads at RAM speed")
        return DiskInfo(str(directory), nbytes / _timed_read(path, 0) / GB, "buffered",
                        note="could not bypass the page cache: the figure is optimistic")
    except OSError as e:
        return DiskInfo(str(directory), None, "none", note=f"disk test failed: {e.strerror or e}")
    finally:
        path.unlink(missing_ok=True)


def system_info(disk_dir: Path | None = None, disk_mb: int = 256, measure: bool = True) -> SystemInfo:
    """Everything about this machine the planner cares about (``measure=False`` skips the timed tests)."""
    from specexec import hub

    vm = psutil.virtual_memory()
    gpu = gpu_info(measure)
    disk = disk_read(disk_dir or hub.cache_home(), disk_mb) if measure and disk_mb > 0 else None
    return SystemInfo(
        cpu_model=cpu_model(), cpu_cores=psutil.cpu_count(logical=False), cpu_threads=psutil.cpu_count(),
        ram_total=int(vm.total), ram_available=int(vm.available), gpu=gpu,
        cuda_note="" if gpu else "no CUDA GPU: CPU-only mode", disk=disk, versions=versions(),
    )


# ---------------------------------------------------------------------------------------------- the model


def locate_config(spec: str) -> tuple[Path | None, str]:
    """The local config.json of a model spec (alias, path, HF id) without downloading; else (None, why)."""
    from specexec import hub

    try:
        path = hub.resolve(spec, pull_missing=False, progress=False)
    except SpecexecError as e:
        cached = _cached_hf_config(spec)
        if cached is not None:
            return cached, ""
        return None, f"{spec} is not present locally ({e})"
    if path.is_file():
        path = path.parent
    cfg = path / "config.json"
    if not cfg.is_file():
        return None, f"no config.json in {path} (a GGUF file gets one when specexec first converts it)"
    return cfg, ""


def _cached_hf_config(spec: str) -> Path | None:
    """config.json of an HF id (or an alias's upstream id) if that one file is in the HF cache."""
    from huggingface_hub import try_to_load_from_cache

    from specexec import hub

    repo = hub.aliases()[spec].hf_id if spec in hub.aliases() else spec
    if repo.count("/") != 1:
        return None
    try:
        found = try_to_load_from_cache(repo, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def recommend(spec: str, system: SystemInfo, context: int = 4096) -> Recommendation:
    """Dtype, tier, resident layers and the per-pass floor for target ``spec`` on this machine (config only)."""
    import json

    cfg_path, why = locate_config(spec)
    if cfg_path is None:
        return Recommendation(target=spec, present=False, note=why)
    try:
        cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    except (ValueError, KeyError) as e:
        return Recommendation(target=spec, present=True, config_path=str(cfg_path),
                              note=f"cannot read {cfg_path}: {e}")
    rec = Recommendation(target=spec, present=True, config_path=str(cfg_path), params=param_count(cfg),
                         num_layers=cfg.num_layers, layer_gb_bf16=layer_bytes(cfg, "bf16") / GB,
                         layer_gb_nf4=layer_bytes(cfg, "nf4") / GB)
    context = min(context, cfg.max_position_embeddings)
    if system.gpu is None:
        _recommend_cpu(rec, cfg, system, context)
    else:
        _recommend_gpu(rec, cfg, system, context)
    return rec


def _recommend_cpu(rec: Recommendation, cfg: ModelConfig, system: SystemInfo, context: int) -> None:
    """CPU-only: the whole model lives in RAM (fp32 if it fits, else bf16); a pass reads every weight."""
    rec.tier, rec.resident_layers, rec.streamed_layers = "cpu", cfg.num_layers, 0
    for dtype, nbytes in (("fp32", 4), ("bf16", 2)):
        need = param_count(cfg) * nbytes + kv_bytes_per_token(cfg, nbytes) * context
        if need <= system.ram_available:
            rec.dtype = dtype
            break
    else:
        rec.dtype, rec.tier = "bf16", "does-not-fit"
        rec.notes.append(f"even bf16 needs {param_count(cfg) * 2 / GB:.1f} GB of RAM, "
                         f"{system.ram_available / GB:.1f} GB is available: use a CUDA GPU with offload")
    weights = param_count(cfg) * (4 if rec.dtype == "fp32" else 2)
    rec.streamed_gb_per_pass = 0.0
    rec.bandwidth_gbps = ASSUMED_RAM_GBPS
    rec.bandwidth = f"RAM bandwidth {ASSUMED_RAM_GBPS:.0f} GB/s (assumed; CPU compute is usually slower still)"
    rec.floor_s_per_pass = weights / (ASSUMED_RAM_GBPS * GB)
    rec.notes.append("no CUDA GPU: CPU-only mode (offload tiers apply to GPUs only)")


def _recommend_gpu(rec: Recommendation, cfg: ModelConfig, system: SystemInfo, context: int) -> None:
    """GPU: 16-bit resident if it fits; else NF4 with resident layers + streaming from RAM, else SSD."""
    gpu = system.gpu
    assert gpu is not None
    n = cfg.num_layers
    fixed = (global_params(cfg) * 2 + kv_bytes_per_token(cfg, 2) * context
             + TREE_TOKENS * cfg.vocab_size * 6 + VRAM_HEADROOM)
    budget = gpu.vram_free - fixed
    lb16, lb4 = layer_bytes(cfg, "bf16"), layer_bytes(cfg, "nf4")
    if n * lb16 <= budget:
        rec.dtype, rec.tier, rec.resident_layers, rec.streamed_layers = "bf16", "none", n, 0
    elif n * lb4 <= budget:
        rec.dtype, rec.tier, rec.resident_layers, rec.streamed_layers = "nf4", "none", n, 0
        rec.notes.append(f"bf16 would need {n * lb16 / GB:.1f} GB of VRAM for the layers; "
                         f"{max(budget, 0) / GB:.1f} GB is left after globals, KV cache and workspace")
    else:
        k = max(0, min(n, (budget - RING_BUFFERS * lb4) // lb4))
        rec.dtype, rec.resident_layers, rec.streamed_layers = "nf4", int(k), int(n - k)
        streamed = (n - k) * lb4
        ram_room = system.ram_available - max(2 << 30, int(0.1 * system.ram_total))
        rec.tier = "ram" if streamed <= ram_room else "ssd"
        if budget < RING_BUFFERS * lb4:
            rec.tier = "does-not-fit"
            rec.notes.append("VRAM cannot even hold the ring of streamed-layer buffers: shorten --context")
        bf16_floor = (n * lb16) / ((gpu.pinned_h2d_gbps or ASSUMED_H2D_GBPS) * GB)
        rec.notes.append(f"streaming all layers in bf16 instead would take >= {bf16_floor:.2f} s per pass")
    streamed_bytes = (rec.streamed_layers or 0) * (lb4 if rec.dtype == "nf4" else lb16)
    rec.streamed_gb_per_pass = streamed_bytes / GB
    h2d = gpu.pinned_h2d_gbps or ASSUMED_H2D_GBPS
    h2d_src = "measured" if gpu.pinned_h2d_gbps else "assumed"
    if rec.tier == "ssd":
        disk = system.disk.read_gbps if system.disk and system.disk.read_gbps else None
        bw = min(h2d, disk) if disk else h2d
        rec.bandwidth = (f"disk {disk:.2f} GB/s (measured)" if disk and disk < h2d
                         else f"pinned H2D {h2d:.1f} GB/s ({h2d_src})")
    else:
        bw = h2d
        rec.bandwidth = f"pinned H2D {h2d:.1f} GB/s ({h2d_src})"
    rec.bandwidth_gbps = bw
    rec.floor_s_per_pass = streamed_bytes / (bw * GB)


def run_doctor(target: str | None = None, context: int = 4096, disk_mb: int = 256, measure: bool = True,
               disk_dir: Path | None = None) -> DoctorReport:
    """The whole report: the machine, plus a recommendation for ``target`` if given."""
    system = system_info(disk_dir, disk_mb, measure)
    return DoctorReport(system=system, recommendation=recommend(target, system, context) if target else None)
