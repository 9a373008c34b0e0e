"""4-bit CPU weights in super-blocks (integer sub-scales and sub-minimums), run by our own C kernel.

A CPU token costs reading the weights: int8 weights are 8.5 bits a value, these 4.625 where a row is a multiple
of 256 values (the bytes llama.cpp's Q4_K files read). A super-block holds up to 8 sub-blocks of 32 values, each
with a uint8 scale and an int8 minimum under the super-block's fp16 pair. The kernel (``q4.c`` beside this file)
quantizes each activation row by super-blocks to int8 and keeps a super-block's dot products in integers, with
one float multiply-add per super-block: the scheme of llama.cpp's Q4_K x Q8_K dot product. Each output element is
one thread's fixed sequence of operations, so a row's result is the same in every pass (the target's exactness
rests on that; :mod:`specexec.loading.invariance` checks it anyway).

The kernel is compiled with the package's other CPU kernels (:mod:`specexec.formats.native`). Without a compiler
:func:`available` says why and nothing chooses this format; else ``--target-dtype auto`` picks it where the CPU
probe measures it fastest (:func:`specexec.loading.cpu_probe.choose_target`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterable

import torch
from torch import Tensor

from specexec.formats import native

QK = 32  # values per sub-block
HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 huge page


def kernel() -> ctypes.CDLL:
    """The compiled CPU kernels (:mod:`specexec.formats.native`); RuntimeError naming why when they cannot be."""
    return native.kernel()


def available() -> str | None:
    """None when the 4-bit CPU kernel can run here, else why not (one line)."""
    return native.available()


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


Q4_K_BYTES = 144  # bytes of a GGUF Q4_K block of 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales, nibbles


def from_q4_k(blocks: Tensor, k: int) -> Tensor:
    """A GGUF Q4_K tensor's blocks, rows (n, k / 256 * 144) uint8, as packed super-blocks of this format, losslessly:
    Q4_K is this format's super-block of 8 sub-blocks (value ``d * sc * q - dmin * m``, ``sc`` and ``m`` 6-bit) with
    the sub-scales and minimums packed into 12 bytes and the nibbles in the same order, so the repack unpacks the
    12 bytes into 8 uint8 sub-scales and 8 int8 sub-minimums ``-m`` and copies the rest. Every value and every
    integer of the kernel's dot product is then the file's (:func:`dequantize_blocks` equals ``gguf``'s
    dequantization bit for bit)."""
    if k % 256:
        raise ValueError(f"Q4_K rows hold a multiple of 256 values, not {k}")
    n = blocks.shape[0]
    b = blocks.reshape(n, k // 256, Q4_K_BYTES)
    sm = b[..., 4:16].to(torch.int16).reshape(n, -1, 3, 4)
    d, m, md = sm[..., 0, :], sm[..., 1, :], sm[..., 2, :]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), -1)  # (n, super-blocks, 8): gguf's get_scale_min
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), -1)
    scales = torch.cat((sc.to(torch.uint8), (-mn).to(torch.int8).view(torch.uint8)), -1)
    return torch.cat((b[..., :4], scales, b[..., 16:]), -1).reshape(n, -1).contiguous()


class Q4Linear:
    """A linear weight (out, in) in 4 bits (see the module docstring), on the CPU.

    ``linear(x)`` returns x's dtype; the product runs in fp32 from int8-quantized rows of x. ``rows(ids)``
    dequantizes embedding rows (a tied lm_head doubles as the embedding)."""

    kernel = "q4"

    def __init__(self, w: Tensor) -> None:
        self.shape = (int(w.shape[0]), int(w.shape[1]))
        self.ns = sub_blocks(self.shape[1])
        self.packed = quantize(w)

    @classmethod
    def from_blocks(cls, packed: Tensor, shape: tuple[int, int]) -> Q4Linear:
        """A weight of ``shape`` from packed rows already in this format (e.g. :func:`from_q4_k`'s)."""
        if packed.shape != (shape[0], row_bytes(shape[1])) or packed.dtype != torch.uint8:
            raise ValueError(f"packed rows {tuple(packed.shape)} do not hold a {shape} 4-bit weight")
        return cls._from(packed.contiguous(), shape)

    @classmethod
    def _from(cls, packed: Tensor, shape: tuple[int, int]) -> Q4Linear:
        out = cls.__new__(cls)
        out.shape, out.packed, out.ns = shape, packed, sub_blocks(shape[1])
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
        n, k = self.shape
        xf = x.detach().reshape(-1, k).to(torch.float32).contiguous()
        rows = xf.shape[0]
        out = torch.empty(rows, n)
        if rows and kernel().q4_matmul(self.packed.data_ptr(), n, k, self.ns, xf.data_ptr(), rows, out.data_ptr()):
            raise MemoryError("the 4-bit kernel could not allocate its scratch memory")
        return out.reshape(*x.shape[:-1], n).to(x.dtype)

    def nbytes(self) -> int:
        return self.packed.numel()


def gather(weights: Iterable[Q4Linear]) -> None:
    """Move the packed bytes of ``weights`` (each once) into one block aligned to huge pages that the OS is asked to
    back with them (Linux's ``madvise(MADV_HUGEPAGE)``; elsewhere, or where refused, it is plain memory). A token's
    pass reads every weight once: with 4 KB pages the TLB misses cost a third of a one-row product (the demo
    target's gate/up weights: 30 ms a pass against 20 with huge pages)."""
    ws = list({id(w): w for w in weights}.values())
    sizes = [-(-w.packed.numel() // 64) * 64 for w in ws]
    total = sum(sizes)
    if not ws:
        return
    arena = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    off = (-arena.data_ptr()) % HUGE_PAGE
    _advise_huge_pages(arena.data_ptr() + off, -(-total // HUGE_PAGE) * HUGE_PAGE)
    for w, size in zip(ws, sizes):
        view = arena[off : off + w.packed.numel()].view(w.packed.shape)
        view.copy_(w.packed)
        w.packed = view  # the old bytes are freed as the next weight is copied
        off += size


def _advise_huge_pages(addr: int, length: int) -> None:
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(14))  # MADV_HUGEPAGE
    except (OSError, AttributeError):  # no libc to ask: plain pages
        pass
