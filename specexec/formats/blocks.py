"""GGUF Q6_K weights run on their own blocks, and fused weights whose parts are of different block types.

A Q4_K_M file stores most linears as Q4_K (:func:`specexec.formats.q4.from_q4_k` takes them losslessly), but the
output layer, attn_v and half of ffn_down as Q6_K: re-quantizing those to 4 bits loses most of what separates our
weights from the file's. :class:`Q6KLinear` keeps the file's blocks as they are stored and multiplies them with the
C kernel ``q6k.c`` (8-bit activations, one exact integer a block, the scheme of llama.cpp's Q6_K x Q8_K product;
every row's result is the same in any pass). :class:`Fused` is a linear made of parts of different types -- a
q/k/v weight whose v is Q6_K -- whose outputs the C function ``block_matmul`` writes side by side, so a layer pass
(:mod:`specexec.formats.layers`) runs any mix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specexec.formats import native
from specexec.formats.q4 import Q4Linear

Q6_K_BYTES = 210  # bytes of a Q6_K block of 256 values: ql[128], qh[64], 16 int8 sub-scales, fp16 d
Q6_K = 1  # block_matmul's type numbers: 0 the q4 format, 1 Q6_K


def dequantize_q6_k(blocks: Tensor, k: int) -> Tensor:
    """Rows (n, k / 256 * 210) uint8 of Q6_K blocks -> their values (n, k) in fp32: ``d * sc * (q - 32)``, the
    product rounded to fp32 as ``gguf``'s dequantization rounds it (``d * sc`` first)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, k // 256, Q6_K_BYTES)
    ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 1, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # (n, blocks, 16)
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # (n, blocks, 1)
    lo = torch.stack((ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4), -2)
    hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3  # (n, blocks, 2, 4, 32)
    q = (lo | (hi << 4)).reshape(n, -1, 16, 16).float() - 32
    return ((d * sc)[..., None] * q).reshape(n, k)


class Q6KLinear:
    """A linear weight (out, in) as GGUF Q6_K blocks, rows (out, in / 256 * 210) uint8, on the CPU: the same
    interface as :class:`~specexec.formats.q4.Q4Linear`."""

    kernel = "q6k"

    def __init__(self, blocks: Tensor, shape: tuple[int, int]) -> None:
        n, k = int(shape[0]), int(shape[1])
        if k % 256 or blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, k // 256 * Q6_K_BYTES):
            raise ValueError(f"blocks {tuple(blocks.shape)} do not hold a {shape} Q6_K weight")
        self.shape = (n, k)
        self.packed = blocks.contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_q6_k(self.packed, self.shape[1]).to(dtype)

    def rows(self, ids: Tensor) -> Tensor:
        """Dequantized rows ``ids`` (n, in) in fp32 (embedding lookups)."""
        return dequantize_q6_k(self.packed[ids], self.shape[1])

    def subset(self, ids: Tensor) -> Q6KLinear:
        return Q6KLinear(self.packed[ids], (int(ids.shape[0]), self.shape[1]))

    def to(self, device: torch.device) -> Q6KLinear:
        if torch.device(device).type != "cpu":
            raise ValueError("Q6_K weights run on the CPU here")
        return self

    def linear(self, x: Tensor, invariant: bool = False) -> Tensor:
        """x (T, in) -> (T, out) in x's dtype; every row's result is independent of the others."""
        w, (n, k) = self.packed.data_ptr(), self.shape
        return _product(x, self.shape, lambda xp, rows, out: native.kernel().q6k_matmul(w, n, k, xp, rows, out, n))

    def nbytes(self) -> int:
        return self.packed.numel()


class Fused:
    """A linear whose rows are ``parts`` (:class:`Q4Linear` / :class:`Q6KLinear` of one width) one after another:
    one call computes every part's columns of the output (``block_matmul``)."""

    kernel = "blocks"

    def __init__(self, parts: list[Any]) -> None:
        widths = {p.shape[1] for p in parts}
        if len(widths) != 1:
            raise ValueError(f"fused parts of different widths {sorted(widths)}")
        self.parts = list(parts)
        self.shape = (sum(p.shape[0] for p in parts), widths.pop())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def to(self, device: torch.device) -> Fused:
        if torch.device(device).type != "cpu":
            raise ValueError("block weights run on the CPU here")
        return self

    def linear(self, x: Tensor, invariant: bool = False) -> Tensor:
        t, k = table(self), self.shape[1]  # t: alive through the call (it holds the parts' addresses)
        return _product(x, self.shape, lambda xp, n, out: native.kernel().block_matmul(t.data_ptr(), k, xp, n, out))

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def _product(x: Tensor, shape: tuple[int, int], call: Any) -> Tensor:
    """x (..., in) times a CPU block weight of ``shape`` (out, in), in x's dtype: ``call(x address, rows, out
    address)`` runs the C product on x's rows in fp32 and returns nonzero when its scratch memory cannot be had."""
    n, k = shape
    xf = x.detach().reshape(-1, k).to(torch.float32).contiguous()
    out = torch.empty(xf.shape[0], n)
    if xf.shape[0] and call(xf.data_ptr(), xf.shape[0], out.data_ptr()):
        raise MemoryError("the block kernels could not allocate their scratch memory")
    return out.reshape(*x.shape[:-1], n).to(x.dtype)


BLOCK_LINEARS = (Q4Linear, Q6KLinear, Fused)  # the CPU weights the C layer pass runs


def leaves(w: Any) -> list[Any]:
    """The single-type weights (:class:`Q4Linear`, :class:`Q6KLinear`) ``w`` is made of."""
    return list(w.parts) if isinstance(w, Fused) else [w]


def table(w: Any) -> Tensor:
    """``block_matmul``'s description of ``w``: int64 [parts, then per part: address, rows, type, sub-blocks]. It
    holds addresses: build it after the weights have moved (:func:`specexec.formats.q4.gather`) and keep ``w``
    alive while it is used."""
    out = [0]
    for p in leaves(w):
        q4 = isinstance(p, Q4Linear)
        out += [p.packed.data_ptr(), p.shape[0], 0 if q4 else Q6_K, p.ns if q4 else 0]
    out[0] = (len(out) - 1) // 4
    return torch.tensor(out, dtype=torch.int64)


def join(parts: list[Any]) -> Any:
    """One weight of ``parts``' rows one after another: neighbours of the same type merge (their packed rows
    concatenated), and a single remaining part is returned as it is, else a :class:`Fused`."""
    merged: list[Any] = []
    for p in parts:
        last = merged[-1] if merged else None
        if isinstance(p, Q4Linear) and isinstance(last, Q4Linear) and last.shape[1] == p.shape[1]:
            rows = (last.shape[0] + p.shape[0], p.shape[1])
            merged[-1] = Q4Linear.from_blocks(torch.cat((last.packed, p.packed)), rows)
        elif isinstance(p, Q6KLinear) and isinstance(last, Q6KLinear) and last.shape[1] == p.shape[1]:
            merged[-1] = Q6KLinear(torch.cat((last.packed, p.packed)), (last.shape[0] + p.shape[0], p.shape[1]))
        else:
            merged.append(p)
    return merged[0] if len(merged) == 1 else Fused(merged)
