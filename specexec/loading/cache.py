"""What specexec keeps on disk under its cache root (:func:`specexec.loading.hub.cache_home`), listed and removed.

Entries: each converted model (``models/<alias>``), each packed-layer cache of the offload manager
(``offload/<model>-<format>-<key>``: SSD tier, NF4), each converted GGUF given by path (``converted/<name>``),
assembled GGUFs (``gguf/<alias>.gguf``), downloaded wheels (``wheels``, one entry) and unfinished temporary
directories left by an interrupted conversion. Hugging Face downloads live in the HF cache, not here.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from specexec.errors import SpecexecError
from specexec.loading import hub

log = logging.getLogger(__name__)

KINDS = {"models": "model", "offload": "layer cache", "converted": "converted GGUF", "gguf": "GGUF"}


@dataclass(frozen=True)
class CacheEntry:
    name: str  # "models/qwen2.5-coder-1.5b", "offload/...", "wheels"
    kind: str  # model | layer cache | converted GGUF | GGUF | wheels | unfinished
    path: Path
    size: int  # bytes on disk


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def entries(home: Path | None = None) -> list[CacheEntry]:
    """Every entry under the cache root, sorted by name (an empty list when the cache does not exist)."""
    root = hub.cache_home(home)
    out: list[CacheEntry] = []
    for sub, kind in KINDS.items():
        d = root / sub
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            k = "unfinished" if p.name.startswith(".") else kind
            out.append(CacheEntry(f"{sub}/{p.name}", k, p, _size(p)))
    wheels = root / "wheels"
    if wheels.is_dir() and any(wheels.iterdir()):
        out.append(CacheEntry("wheels", "wheels", wheels, _size(wheels)))
    return sorted(out, key=lambda e: e.name)


def find(name: str, home: Path | None = None) -> CacheEntry:
    """The entry called ``name`` (its full name, or its last part when that is unambiguous)."""
    all_ = entries(home)
    hits = [e for e in all_ if e.name == name] or [e for e in all_ if e.path.name == name]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        known = ", ".join(e.name for e in all_) or "the cache is empty"
        raise SpecexecError(f"no cache entry {name!r} in {hub.cache_home(home)} ({known})")
    raise SpecexecError(f"{name!r} is ambiguous: {', '.join(e.name for e in hits)}; give the full name")


def remove(entry: CacheEntry) -> None:
    """Delete one entry from disk."""
    log.info("removing %s (%s)", entry.path, entry.kind)
    try:
        if entry.path.is_dir() and not entry.path.is_symlink():
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink(missing_ok=True)
    except OSError as e:
        raise SpecexecError(f"cannot remove {entry.path}: {e.strerror or e}") from None
