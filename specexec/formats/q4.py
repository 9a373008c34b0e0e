"""4-bit CPU weights: blocks of 32 values with an fp16 scale and minimum, run by our own C kernel.

A CPU token costs reading the weights: int8 weights are 8.5 bits a value, these 5 (the bytes llama.cpp's 4-bit
files read). The kernel (``q4.c`` beside this file) quantizes each activation row by blocks of 32 to int8 and
takes integer dot products with the 4-bit values, block by block: the scheme of llama.cpp's Q4_1 x Q8_1 dot
product. Each output element is one thread's fixed sequence of operations, so a row's result is the same in
every pass (the target's exactness rests on that; :mod:`specexec.loading.invariance` checks it anyway).

The kernel is compiled for this CPU on first use with the system C compiler (``cc``, or ``$CC``) and kept under
the cache home (``kernels/``); it shares torch's OpenMP threads. Without a compiler :func:`available` says why
and nothing chooses this format. ``--target-dtype auto`` does not pick it yet (see
:func:`specexec.loading.cpu_probe.measure_target`).
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

import torch
from torch import Tensor

log = logging.getLogger(__name__)

QK = 32  # values per block
SOURCE = Path(__file__).with_name("q4.c")
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
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + version.encode() + _cpu_id().encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = cache_home(home) / "kernels" / f"q4-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        log.info("compiling the 4-bit CPU kernel (once; kept in %s)", out)
        proc = subprocess.run(
            [*cc.split(), *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"the C compiler failed: {proc.stderr.strip()[-400:]}")
        tmp.replace(out)
    lib = ctypes.CDLL(str(out))
    P, I = ctypes.c_void_p, ctypes.c_int64
    N = ctypes.c_int
    lib.q8_rows.argtypes = [P, I, I, N, P, P, P]
    lib.q8_rows.restype = None
    lib.q4_linear.argtypes = [P, I, I, N, P, P, P, I, P]
    lib.q4_linear.restype = None
    return lib


def kernel() -> ctypes.CDLL:
    """The compiled kernel (built on first use); RuntimeError naming why when it cannot be."""
    global _lib, _why_not
    if _lib is None:
        if _why_not is not None:
            raise RuntimeError(_why_not)
        try:
            _lib = _build()
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why_not = f"the 4-bit CPU kernel is unavailable: {e}"
            raise RuntimeError(_why_not) from None
    return _lib


def available() -> str | None:
    """None when the 4-bit CPU kernel can run here, else why not (one line)."""
    try:
        kernel()
    except RuntimeError as e:
        return str(e)
    return None


def sub_blocks(k: int) -> int:
    """Sub-blocks of 32 in a super-block of a row of ``k`` values: the most of 8, 4, 2, 1 that divides it."""
    if k % QK:
        raise ValueError(f"4-bit weights need rows of a multiple of {QK} values, not {k}")
    return next(ns for ns in (8, 4, 2, 1) if k % (QK * ns) == 0)


def row_bytes(k: int) -> int:
    """Bytes of one packed row of ``k`` values."""
    ns = sub_blocks(k)
    return k // (QK * ns) * (4 + 18 * ns)


def _up(x: Tensor) -> Tensor:
    """x as fp16, rounded up where rounding to nearest went down (a stored scale then never shrinks a range)."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def quantize(w: Tensor) -> Tensor:
    """A weight (out, in) as packed super-blocks (out, :func:`row_bytes`) uint8 (layout: ``q4.c``). Per sub-block
    of 32 the minimum is rounded down to an int8 multiple of its super-block's ``dmin`` and the step that then
    spans the values in 15 up to a uint8 multiple of ``d``; the values round to the nearest step."""
    n, k = w.shape
    ns = sub_blocks(k)
    b = w.detach().float().reshape(n, k // (QK * ns), ns, QK)
    tiny = torch.finfo(torch.float32).tiny
    lo, hi = b.amin(-1), b.amax(-1)  # (n, super-blocks, ns)
    dmin = _up(lo.abs().amax(-1) / 127)
    dmf = dmin.float().clamp(min=tiny)[..., None]
    mn = torch.floor(lo / dmf).clamp_(-127, 127)
    m = mn * dmf
    step = (hi - m) / 15
    d = _up(step.amax(-1) / 255)
    df = d.float().clamp(min=tiny)[..., None]
    sc = torch.ceil(step / df).clamp_(0, 255)
    s = (sc * df).clamp(min=tiny)
    q = torch.round((b - m[..., None]) / s[..., None]).clamp_(0, 15).to(torch.uint8)
    if ns == 1:
        nib = q[..., :16] | (q[..., 16:] << 4)
    else:
        nib = q[..., 0::2, :] | (q[..., 1::2, :] << 4)
    head = torch.stack((d, dmin), -1).view(torch.uint8)  # (n, super-blocks, 4)
    scales = torch.cat((sc.to(torch.uint8), mn.to(torch.int8).view(torch.uint8)), -1)
    nsb = k // (QK * ns)
    return torch.cat((head, scales, nib.reshape(n, nsb, -1)), -1).reshape(n, -1).contiguous()


def dequantize_blocks(packed: Tensor, k: int) -> Tensor:
    """Packed rows (n, :func:`row_bytes`) -> their values (n, k) in fp32."""
    n, ns = packed.shape[0], sub_blocks(k)
    b = packed.reshape(n, k // (QK * ns), 4 + 18 * ns)
    dm = b[..., :4].contiguous().view(torch.float16).float()  # (n, super-blocks, 2)
    sc = b[..., 4 : 4 + ns].float()
    mn = b[..., 4 + ns : 4 + 2 * ns].contiguous().view(torch.int8).float()
    nib = b[..., 4 + 2 * ns :]
    if ns == 1:
        q = torch.cat((nib & 15, nib >> 4), -1).reshape(n, -1, 1, QK)
    else:
        pairs = nib.reshape(n, -1, ns // 2, 1, QK)
        q = torch.cat((pairs & 15, pairs >> 4), -2).reshape(n, -1, ns, QK)
    vals = q.float() * (dm[..., :1] * sc)[..., None] + (dm[..., 1:] * mn)[..., None]
    return vals.reshape(n, k)


class Q4Linear:
    """A linear weight (out, in) in 4 bits (see the module docstring), on the CPU.

    ``linear(x)`` returns x's dtype; the product runs in fp32 from int8-quantized rows of x. ``rows(ids)``
    dequantizes embedding rows (a tied lm_head doubles as the embedding)."""

    kernel = "q4"

    def __init__(self, w: Tensor) -> None:
        self.shape = (int(w.shape[0]), int(w.shape[1]))
        self.packed = quantize(w)

    @classmethod
    def _from(cls, packed: Tensor, shape: tuple[int, int]) -> Q4Linear:
        out = cls.__new__(cls)
        out.shape, out.packed = shape, packed
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_blocks(self.packed, self.shape[1]).to(dtype)

    def rows(self, ids: Tensor) -> Tensor:
        """Dequantized rows ``ids`` (n, in) in fp32 (embedding lookups)."""
        return dequantize_blocks(self.packed[ids], self.shape[1])

    def subset(self, ids: Tensor) -> Q4Linear:
        return Q4Linear._from(self.packed[ids].contiguous(), (int(ids.shape[0]), self.shape[1]))

    def to(self, device: torch.device) -> Q4Linear:
        if torch.device(device).type != "cpu":
            raise ValueError("4-bit q4 weights are a CPU format")
        return self

    def linear(self, x: Tensor, invariant: bool = False) -> Tensor:
        """x (T, in) -> (T, out) in x's dtype; every row's result is independent of the others (``invariant`` is
        accepted for the common weight interface: this kernel always is)."""
        lib = kernel()
        n, k = self.shape
        xf = x.detach().reshape(-1, k).to(torch.float32).contiguous()
        rows = xf.shape[0]
        ns = sub_blocks(k)
        qa = torch.empty(rows, k, dtype=torch.int8)
        dx = torch.empty(rows, k // (QK * ns))
        bs = torch.zeros(rows * (k // QK) + 8, dtype=torch.int16)  # the kernel reads sums 8 at a time
        out = torch.empty(rows, n)
        if rows:
            ptrs = (qa.data_ptr(), dx.data_ptr(), bs.data_ptr())
            lib.q8_rows(xf.data_ptr(), rows, k, ns, *ptrs)
            lib.q4_linear(self.packed.data_ptr(), n, k, ns, *ptrs, rows, out.data_ptr())
        return out.reshape(*x.shape[:-1], n).to(x.dtype)

    def nbytes(self) -> int:
        return self.packed.numel()
