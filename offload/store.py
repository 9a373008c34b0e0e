"""Host side of the offload: packed layers in (pinned) RAM, or one packed file per layer on SSD.

Both tiers hold each layer as ONE flat buffer laid out by :class:`~offload.layout.LayerLayout` and answer two
questions for the streamer: ``source(i)`` — a buffer the GPU can DMA from directly (pinned RAM), or None — and
``fill(i, chunk, dst)`` — copy one chunk of layer i into a (pinned) staging buffer, blocking, from any thread.

Pinning: a layer buffer is page-locked once, at load, with ``cudaHostRegister`` on a page-aligned CPU tensor (the
way torch's own checkpoint stager pins): exact size, ~0.07 s/GiB. torch's pinned allocator (``pin_memory=True``)
rounds every block up to a power of two (a 1.71 GB bf16 70B layer would take 2.15 GB) and costs ~0.6 s/GB. If
pinning fails (WSL caps pinned memory near 1 GiB), the layer stays pageable and the streamer stages it through a
small ring of pinned chunk buffers instead — pageable H2D copies run 7.5x slower than pinned ones.

SSD tier (also the NF4 cache): ``<cache>/offload/<model>-<format>-<key>/layer_00000.bin ...`` plus ``manifest.json``
(format version, layout, per-file size and one CRC32 per chunk), written last so that its presence marks a
complete cache. Files are read with large sequential ``readinto`` calls by worker threads into pinned staging
buffers (never mmapped to the GPU); every chunk's CRC is checked the first time this process reads it, and file
sizes are checked when the cache is opened, so a truncated or corrupt file is a clear :class:`SpecexecError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from offload.layout import PAGE, LayerFormat, LayerLayout
from specexec.errors import SpecexecError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the packed file format changes (part of the cache key)
CHUNK_BYTES = 64 << 20  # bytes: staging chunk and CRC granularity
MANIFEST = "manifest.json"
LAYER_SOURCE = "layer-source.json"
"""In a model directory whose layer weights live elsewhere (a GGUF conversion without its layers): what identifies
them, as text; :func:`cache_key` hashes it in place of the directory's files."""


def default_cache_dir() -> Path:
    """Where packed layers are cached by default: ``<specexec cache>/offload`` (:func:`specexec.home.cache_home`)."""
    from specexec.home import cache_home

    return cache_home() / "offload"


def writable_dir(path: Path, what: str) -> Path:
    """Create ``path`` if needed and check that a file can be written in it (see :func:`specexec.home.writable_dir`)."""
    from specexec.home import writable_dir as _writable

    return _writable(path, what)


def _cuda_clear_error() -> None:
    """Consume CUDA's per-thread 'last error' left by a runtime call that failed and that we handled ourselves.

    Otherwise torch's next kernel-launch check (``cudaGetLastError``) would report it as its own failure. A
    trivial kernel launch makes torch read — and so reset — the error; it raises once, here, and is ignored.
    """
    try:
        torch.ones(1, device="cuda").add_(1)
    except RuntimeError:
        pass


def _host_register(t: Tensor) -> bool:
    """Page-lock ``t`` (a contiguous CPU tensor) for DMA with cudaHostRegister; False if the driver refuses."""
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    except (AttributeError, RuntimeError) as e:  # no CUDA runtime binding in this torch build
        log.warning("cannot pin host memory (%s)", e)
        return False
    if err != 0:
        _cuda_clear_error()
        return False
    return True


class HostBuffer:
    """A page-aligned uint8 CPU buffer of ``nbytes``, page-locked for the GPU when ``pin`` and the driver allows."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE
        self.tensor = raw[start : start + nbytes]  # (nbytes,) uint8
        self.pinned = pin and _host_register(self.tensor)

    def close(self) -> None:
        """Unpin (the memory itself is freed with the last reference to ``tensor``)."""
        if self.pinned:
            self.pinned = False
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the CUDA runtime may already be gone
            pass


def _chunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


class RamStore:
    """Streamed layers in host RAM, one packed :class:`HostBuffer` each.

    ``direct`` buffers (pinned, or any buffer when the compute device is the CPU) are copied straight into the GPU
    ring; the others are staged chunk by chunk through pinned buffers.
    """

    def __init__(
        self, layout: LayerLayout, buffers: dict[int, HostBuffer], cuda: bool, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.layout = layout
        self.buffers = buffers
        self.cuda = cuda
        self.chunk_bytes = chunk_bytes

    def source(self, i: int) -> Tensor | None:
        b = self.buffers[i]
        return b.tensor if (b.pinned or not self.cuda) else None

    def fill(self, i: int, chunk: int, dst: Tensor) -> None:
        off = chunk * self.chunk_bytes
        dst.copy_(self.buffers[i].tensor[off : off + dst.numel()])

    @property
    def nbytes(self) -> int:
        return sum(b.tensor.numel() for b in self.buffers.values())

    @property
    def pinned_layers(self) -> int:
        return sum(b.pinned for b in self.buffers.values())

    def close(self) -> None:
        for b in self.buffers.values():
            b.close()


def cache_key(model_path: Path, fmt: LayerFormat) -> str:
    """16 hex chars identifying a model's files (paths, sizes, mtimes) and the packed format. A directory whose
    layers live elsewhere is identified by its :data:`LAYER_SOURCE` file instead (a GGUF conversion without its
    layers: the GGUF's paths, sizes and mtimes), so rebuilding that small directory keeps the cache."""
    source = model_path / LAYER_SOURCE
    if source.is_file():
        blob = json.dumps([LAYER_SOURCE, source.read_text(), fmt.name, FORMAT_VERSION])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
    files = sorted([model_path / "config.json", *model_path.glob("*.safetensors")])
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    blob = json.dumps([str(model_path.resolve()), stats, fmt.name, FORMAT_VERSION])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_dir_for(root: Path, model_path: Path, fmt: LayerFormat) -> Path:
    """The cache directory of ``model_path``'s layers packed as ``fmt`` under ``root``."""
    return root / f"{model_path.name}-{fmt.name}-{cache_key(model_path, fmt)}"


def _layer_file(i: int) -> str:
    return f"layer_{i:05d}.bin"


def _np(t: Tensor) -> memoryview:
    """A writable byte view of a contiguous uint8 CPU tensor (shares memory)."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


@dataclass(frozen=True)
class LayerFile:
    path: Path
    size: int  # bytes
    crc32: tuple[int, ...]  # one per chunk


class SsdStore:
    """A complete packed-layer cache directory: one file per layer, read in chunks into staging buffers."""

    def __init__(self, root: Path, layout: LayerLayout, files: list[LayerFile], chunk_bytes: int) -> None:
        self.root = root
        self.layout = layout
        self.files = files
        self.chunk_bytes = chunk_bytes
        self._verified: set[tuple[int, int]] = set()  # (layer, chunk) whose CRC this process has checked

    @classmethod
    def open(cls, root: Path, layout: LayerLayout, num_layers: int) -> SsdStore | None:
        """Open the cache in ``root``; None if it was never completed. Checks format and every file's size."""
        mpath = root / MANIFEST
        if not mpath.is_file():
            return None
        fix = f"delete {root} to rebuild it"
        try:
            m = json.loads(mpath.read_text())
            version, mlayout = m["version"], LayerLayout.from_json(m["layout"])
            chunk_bytes = int(m["chunk_bytes"])
            files = [LayerFile(root / f["file"], int(f["size"]), tuple(f["crc32"])) for f in m["layers"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SpecexecError(f"corrupt offload cache manifest {mpath} ({e}): {fix}") from None
        if version != FORMAT_VERSION or mlayout != layout or len(files) != num_layers:
            raise SpecexecError(f"offload cache {root} does not match this model or version: {fix}")
        for f in files:
            size = f.path.stat().st_size if f.path.is_file() else -1
            if size != f.size:
                what = "missing" if size < 0 else f"truncated ({size} of {f.size} bytes)"
                raise SpecexecError(f"offload cache file {f.path} is {what}: {fix}")
        return cls(root, layout, files, chunk_bytes)

    def source(self, i: int) -> Tensor | None:
        return None  # always staged

    def fill(self, i: int, chunk: int, dst: Tensor) -> None:
        """Read chunk ``chunk`` of layer i into ``dst`` (uint8 CPU, the chunk's length) and check its CRC once."""
        f = self.files[i]
        off, n = chunk * self.chunk_bytes, dst.numel()
        view = _np(dst)
        with open(f.path, "rb", buffering=0) as fh:
            fh.seek(off)
            got = 0
            while got < n:
                r = fh.readinto(view[got:])
                if not r:
                    raise SpecexecError(
                        f"offload cache file {f.path} is truncated (ends at {off + got} bytes): "
                        f"delete {self.root} to rebuild it"
                    )
                got += r
            if hasattr(os, "posix_fadvise"):  # streamed bytes need not stay in the page cache
                os.posix_fadvise(fh.fileno(), off, n, os.POSIX_FADV_DONTNEED)
        if (i, chunk) not in self._verified:
            if zlib.crc32(view) != f.crc32[chunk]:
                raise SpecexecError(
                    f"offload cache file {f.path} is corrupt (checksum mismatch at bytes {off}..{off + n}): "
                    f"delete {self.root} to rebuild it"
                )
            self._verified.add((i, chunk))

    def read_layer(self, i: int, dst: Tensor, pool: ThreadPoolExecutor | None = None) -> None:
        """Read all of layer i into ``dst`` (uint8 CPU, >= layout.nbytes), chunks in parallel on ``pool``."""
        cb, n = self.chunk_bytes, self.layout.nbytes
        jobs = [(c, dst[c * cb : min(n, (c + 1) * cb)]) for c in range(_chunks(n, cb))]
        if pool is None:
            for c, d in jobs:
                self.fill(i, c, d)
        else:
            for fut in [pool.submit(self.fill, i, c, d) for c, d in jobs]:
                fut.result()

    def close(self) -> None:
        pass


class CacheWriter:
    """Writes a packed-layer cache one layer at a time; :meth:`finish` writes the manifest (completion mark)."""

    def __init__(
        self, root: Path, layout: LayerLayout, num_layers: int, source: dict[str, Any], chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.root, self.layout, self.num_layers = root, layout, num_layers
        self.source, self.chunk_bytes = source, chunk_bytes
        self.files: dict[int, LayerFile] = {}
        root.mkdir(parents=True, exist_ok=True)
        (root / MANIFEST).unlink(missing_ok=True)

    def write(self, i: int, buf: Tensor) -> None:
        """Write layer i's packed buffer (uint8 CPU, layout.nbytes)."""
        view = _np(buf[: self.layout.nbytes])
        cb = self.chunk_bytes
        crcs = tuple(zlib.crc32(view[c * cb : (c + 1) * cb]) for c in range(_chunks(len(view), cb)))
        path = self.root / _layer_file(i)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.write(view)
        os.replace(tmp, path)
        self.files[i] = LayerFile(path, len(view), crcs)

    def finish(self) -> SsdStore:
        if sorted(self.files) != list(range(self.num_layers)):
            raise RuntimeError(f"cache writer got layers {sorted(self.files)}, expected 0..{self.num_layers - 1}")
        files = [self.files[i] for i in range(self.num_layers)]
        manifest = {
            "version": FORMAT_VERSION,
            "source": self.source,
            "layout": self.layout.to_json(),
            "chunk_bytes": self.chunk_bytes,
            "layers": [{"file": f.path.name, "size": f.size, "crc32": list(f.crc32)} for f in files],
        }
        tmp = self.root / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.root / MANIFEST)
        return SsdStore(self.root, self.layout, files, self.chunk_bytes)
