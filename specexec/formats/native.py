"""The package's C kernels for CPUs: compiled on first use, kept under the cache home, loaded with ctypes.

``q4.c`` (4-bit weights, :mod:`specexec.formats.q4`), ``q6k.c`` (GGUF Q6_K blocks, :mod:`specexec.formats.blocks`),
``attn.c`` (a pass's attention row by row, :func:`specexec.model.attention.native`) and ``layers.c`` (a pass's decoder
layers with block weights in one call, :mod:`specexec.formats.layers`). They are built once per source, compiler and CPU
with the system C compiler (``cc``, or ``$CC``) for this CPU (``-O3 -march=native``, no fast-math and no contracted
multiply-adds: every result is a fixed sequence of operations), kept as ``<cache home>/kernels/cpu-<key>.so``, and share
torch's OpenMP runtime (its thread count). Without a compiler :func:`available` says why; callers then keep their torch
code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("q4.c", "q6k.c", "attn.c", "layers.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")

_lib: ctypes.CDLL | None = None
_why_not: str | None = None


def _compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return cc if cc and shutil.which(cc.split()[0]) else None


def _cpu_id() -> str:
    """What ``-march=native`` compiles for: the CPU's model name and instruction-set flags (Linux), else platform's
    names."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.lower().startswith(("model name", "flags"))][:2]
        if keep:
            return "\n".join(keep)
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _build(home: Path | None = None) -> ctypes.CDLL:
    from specexec.home import cache_home

    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc or clang, or set CC)")
    version = subprocess.run([*cc.split(), "--version"], capture_output=True, text=True, timeout=60).stdout
    src = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(src + version.encode() + _cpu_id().encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = cache_home(home) / "kernels" / f"cpu-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        log.info("compiling the CPU kernels (once; kept in %s)", out)
        cmd = [*cc.split(), *FLAGS, *map(str, SOURCES), "-lm", "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"the C compiler failed: {proc.stderr.strip()[-400:]}")
        tmp.replace(out)
    lib = ctypes.CDLL(str(out))
    P, I, N, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.q4_matmul.argtypes = [P, I, I, N, P, I, P]
    lib.q4_matmul.restype = N
    lib.attn_rows.argtypes = [P, I, I, I, I, P, P, N, I, P, P, F, F, P]
    lib.attn_rows.restype = None
    lib.q6k_matmul.argtypes = [P, I, I, P, I, P, I]
    lib.q6k_matmul.restype = N
    lib.q6k_matmul_scalar.argtypes = [P, I, I, P, I, P]
    lib.q6k_matmul_scalar.restype = N
    lib.block_matmul.argtypes = [P, I, P, I, P]
    lib.block_matmul.restype = N
    lib.q4_layers.argtypes = [I, I, I, I, I, I, I, P, P, P, P, P, P, I, I, P, P, P, F, F]
    lib.q4_layers.restype = N
    return lib


def kernel() -> ctypes.CDLL:
    """The compiled kernels (built on first use); RuntimeError naming why when they cannot be."""
    global _lib, _why_not
    if _lib is None:
        if _why_not is not None:
            raise RuntimeError(_why_not)
        try:
            _lib = _build()
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why_not = f"the CPU kernels are unavailable: {e}"
            raise RuntimeError(_why_not) from None
    return _lib


def available() -> str | None:
    """None when the CPU kernels can run here, else why not (one line)."""
    try:
        kernel()
    except RuntimeError as e:
        return str(e)
    return None
