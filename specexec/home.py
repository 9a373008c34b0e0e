"""specexec's cache root (``--cache-dir``, ``$SPECEXEC_HOME``, ``~/.cache/specexec``) and writable-directory checks."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
from pathlib import Path

from specexec.errors import SpecexecError

logger = logging.getLogger(__name__)

HOME_ENV = "SPECEXEC_HOME"
"""The one environment variable that moves specexec's cache (models, offload layer caches)."""
_DEPRECATED_ENV = "SPECEXEC_CACHE"  # an older, undocumented name for the same thing (read with a warning)


class CacheDirError(SpecexecError):
    """The cache directory cannot be written (read-only file system, permissions, not a directory)."""


def cache_home(home: Path | str | None = None) -> Path:
    """Root of specexec's cache: ``home`` if given (``--cache-dir``), else ``$SPECEXEC_HOME``, else
    ``~/.cache/specexec``. ``$SPECEXEC_CACHE`` (deprecated) is honoured with a warning when SPECEXEC_HOME is unset."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser()
    old = os.environ.get(_DEPRECATED_ENV)
    if old:
        _warn_deprecated_env()
        return Path(old).expanduser()
    return Path.home() / ".cache" / "specexec"


@functools.lru_cache(maxsize=1)
def _warn_deprecated_env() -> None:
    logger.warning("%s is deprecated: set %s instead (it moves the whole specexec cache)", _DEPRECATED_ENV, HOME_ENV)


def writable_dir(path: Path, what: str) -> Path:
    """Create ``path`` (and parents) and check that a file can be written in it; else a :class:`CacheDirError`
    naming the directory, the reason and the fix. ``what`` says what goes there ("the NF4 layer cache")."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".specexec-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        reason = {
            errno.EROFS: "it is on a read-only file system",
            errno.EACCES: "permission denied",
            errno.EPERM: "permission denied",
            errno.ENOSPC: "the disk is full",
            errno.ENOTDIR: "a file is in the way",
        }.get(e.errno, e.strerror or str(e))  # type: ignore[arg-type]
        raise CacheDirError(
            f"cannot write {what} in {path}: {reason}; point specexec's cache at a writable directory "
            f"(--cache-dir DIR, or the {HOME_ENV} environment variable)"
        ) from None
    return path


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file renamed over it: a reader, or another process
    writing at the same time, never sees half a file. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
