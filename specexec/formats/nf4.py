"""4-bit NF4 weights through bitsandbytes: quantize a layer once, compute with it from a flat layer buffer.

NF4 (4-bit NormalFloat, Dettmers et al., QLoRA, arXiv 2305.14314): each block of ``blocksize`` consecutive values
of a weight is scaled by its absolute maximum (one fp32 ``absmax`` per block) and rounded to the nearest of 16 fixed
levels (quantiles of a normal distribution, bitsandbytes' ``get_4bit_type("nf4")``); two 4-bit codes per byte, the
first value in the high nibble. No nested ("double") quantization of the scales: 0.5625 bytes per weight.

Compute (:class:`NF4Linear`): on CUDA, up to :data:`FUSED_MAX_TOKENS` rows go through ``bnb.matmul_4bit``
(bitsandbytes 0.50's fused 4-bit kernels: a GEMV at one token, MMA kernels or dequantize+GEMM chosen per GPU
architecture up to 1536 rows); more rows dequantize the weight into one reusable 16-bit scratch buffer and run one
dense GEMM (what bnb does there too, minus a fresh weight-sized allocation per call). Measured on an H100 for the
four 70B linears of a layer: bnb 0.40 ms vs dequantize+GEMM 1.61 ms at 1 token, 1.02 vs 1.62 at 16, equal at
128, within 3-6% either way from 256 to 2048 (bf16: 0.60 / 0.64 / 2.6 ms at 1 / 128 / 1024). On CPU (tests) every
call dequantizes with bitsandbytes (0.50 has CPU quantize/dequantize kernels, no ``out=`` variant) and runs
``F.linear``, so the result equals a dense model whose weights are the dequantized NF4 weights, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

FUSED_MAX_TOKENS = 1536  # CUDA: up to this many rows bnb.matmul_4bit picks its kernel; above, scratch + one GEMM


def _bnb() -> Any:
    """bitsandbytes, imported on first use (its import is slow and logs about optional CPU kernels)."""
    import bitsandbytes

    return bitsandbytes


def nf4_code(device: torch.device | str) -> Tensor:
    """The 16 NF4 levels (16,) fp32 on ``device`` (bitsandbytes' table)."""
    return _bnb().functional.get_4bit_type("nf4", device=device)


def quantize_nf4(w: Tensor, blocksize: int = 64) -> tuple[Tensor, Tensor]:
    """Quantize a weight (any shape, 16/32-bit) -> (packed codes (ceil(n/2),) uint8, absmax (ceil(n/blocksize),) fp32).

    Runs on ``w``'s device (bitsandbytes has CUDA and CPU kernels).
    """
    packed, state = _bnb().functional.quantize_4bit(
        w.contiguous(), blocksize=blocksize, quant_type="nf4", compress_statistics=False
    )
    return packed.view(-1), state.absmax.float()


class DequantScratch:
    """One reusable buffer that the NF4 linears on a device dequantize into (CUDA, passes of > FUSED_MAX_TOKENS).

    Sized to the largest weight and allocated on first use (small trees never need it). Sharing is safe because
    every linear runs on the same (compute) stream, one after the other.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.buf: Tensor | None = None

    def get(self, shape: torch.Size) -> Tensor:
        n = math.prod(shape)
        if n > self.numel:
            raise ValueError(f"dequantization scratch holds {self.numel} values, {n} asked")
        if self.buf is None:
            self.buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return self.buf[:n].view(shape)


class NF4Linear:
    """A linear weight (out, in) stored as NF4 in (views of) a layer buffer. ``linear(x)``: (T, in) -> (T, out)."""

    def __init__(
        self,
        packed: Tensor,
        absmax: Tensor,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        blocksize: int,
        code: Tensor,
        scratch: DequantScratch | None = None,
    ) -> None:
        self.packed = packed  # (ceil(out*in/2),) uint8
        self.absmax = absmax  # (ceil(out*in/blocksize),) fp32
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.scratch = scratch
        self.state = _bnb().functional.QuantState(
            absmax=absmax, shape=self.shape, code=code, blocksize=blocksize, quant_type="nf4", dtype=dtype
        )
        # dequantization goes through the flat shape: bitsandbytes 0.50's CPU dequantize_4bit gets a 2-D weight wrong
        # when its rows are not a whole number of blocks (it blocks each row; quantize_4bit blocks the flat tensor:
        # a (40, 160) weight comes back up to 2.04 off instead of NF4's 0.45). Real models' rows are whole blocks.
        self._flat_state = _bnb().functional.QuantState(
            absmax=absmax, shape=torch.Size([self.shape.numel()]), code=code, blocksize=blocksize, quant_type="nf4",
            dtype=dtype,
        )  # fmt: skip

    def dequantize(self) -> Tensor:
        """The dense weight (out, in) in ``dtype`` (a fresh tensor)."""
        return _bnb().functional.dequantize_4bit(self.packed.view(-1, 1), self._flat_state).view(self.shape)

    def invariant_weight(self) -> Tensor:
        """The dense weight (out, in) that shape-invariant passes multiply, dequantized once per call of
        :func:`specexec.formats.dense.tiled_linear` (which then runs every row tile on it): on CUDA into the shared
        scratch buffer (valid until the next NF4 linear dequantizes), elsewhere a fresh tensor. Dequantization is
        elementwise, so the result is the same bits whatever the pass."""
        if self.packed.device.type != "cuda":
            return self.dequantize()
        w = self.scratch.get(self.shape) if self.scratch is not None else None
        return _bnb().functional.dequantize_4bit(self.packed.view(-1, 1), self.state, out=w)

    def linear(self, x: Tensor, invariant: bool = False) -> Tensor:
        """x (T, in) @ W.T -> (T, out) in x's dtype. ``invariant``: one kernel for every row count (dequantize, then
        one dense product), never bnb's few-row kernels. Shape-invariant passes do not come here: they go through
        :func:`specexec.formats.dense.tiled_linear`, which dequantizes once (:meth:`invariant_weight`) and pads."""
        if x.device.type != "cuda":
            from specexec.formats.dense import linear  # the dense path, CPU kernel choice included (bit-equal results)

            return F.linear(x, self.dequantize()) if invariant else linear(x, self.dequantize())
        if not invariant and x.numel() // x.shape[-1] <= FUSED_MAX_TOKENS:
            return _bnb().matmul_4bit(x, self.packed.view(-1, 1).t(), quant_state=self.state)
        return F.linear(x, self.invariant_weight())
