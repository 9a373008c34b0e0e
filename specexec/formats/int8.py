"""int8 weights: one fp32 scale per output channel, several kernels (CPU and CUDA)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specexec.formats.dense import linear


def _int8_kernel(device: torch.device | None = None) -> str:
    """The best int8 linear for weights on ``device`` (default CPU) in this build (see :class:`Int8Linear`): on
    CUDA bitsandbytes' W8A8."""
    if device is not None and device.type == "cuda":
        return "bnb"
    ops = getattr(torch.ops, "quantized", None)
    engines = torch.backends.quantized.supported_engines
    if ops is not None and hasattr(ops, "linear_dynamic") and ("fbgemm" in engines or "x86" in engines):
        return "dynamic"
    if hasattr(torch, "_weight_int8pack_mm"):
        return "int8pack"
    return "dequant"


INT8_KERNELS = ("dynamic", "int8pack", "dequant", "bnb")


class Int8Linear:
    """A linear weight (out, in) as int8 with one fp32 scale per output channel (symmetric, round to nearest).

    ``linear(x)`` runs one of four kernels (``kernel``; default: ``bnb`` for weights on CUDA, else the first
    available CPU one):

    - ``dynamic``: fbgemm's ``quantized::linear_dynamic`` (activations quantized per pass to 8 bits as well, int8
      GEMM with fp32 accumulation; the fast AVX2/AVX512 path);
    - ``int8pack``: ``torch._weight_int8pack_mm`` (weight-only, what gpt-fast uses on CPU);
    - ``dequant``: dequantize to ``x``'s dtype, then the dense :func:`linear`;
    - ``bnb``: bitsandbytes' LLM.int8() matmul without outlier decomposition (threshold 0): activations quantized
      row-wise to int8, an int8 GEMM (cuBLASLt on CUDA), rescaled by both absmax vectors. The weight's int8 codes
      and scales are exactly bitsandbytes' ``CB``/``SCB`` (``SCB = 127 * scale``). On CUDA the activations pass
      through fp16 (bitsandbytes' CUDA quantizer takes fp16 only).

    On a 2-core AVX2 EPYC ``int8pack`` with fp32 activations runs 3-30x slower than fp32 dense beyond one row, but
    with bf16 activations it is the fastest CPU kernel at 1-64 rows (a one-row product of the demo target's MLP
    matrix: 0.8 ms, fp32 dense 3.3 ms), and its results do not depend on the pass's row count. So a CPU target in
    int8 (``--target-dtype int8``) computes in bf16 through ``int8pack``; the exact output is then the int8
    target's own. A draft uses ``dynamic`` (2-5x faster than fp32 at 16-128 rows): its results differ from the
    dense weights' by the quantization error, which only changes what the draft proposes.
    ``rows(ids)`` dequantizes embedding rows (a tied lm_head doubles as the embedding).
    """

    def __init__(self, w: Tensor, kernel: str | None = None) -> None:
        w = w.detach().float()
        self.shape = tuple(w.shape)
        self.scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (out,) fp32
        self.qweight = torch.round(w / self.scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.kernel = kernel or _int8_kernel(w.device)
        if self.kernel not in INT8_KERNELS:
            raise ValueError(f"unknown int8 kernel {self.kernel!r}")
        self._packed: Any = None
        self._scb = self.scale * 127.0  # bitsandbytes' SCB, made once: not a kernel in every (graphed) pass

    def _prepacked(self) -> Any:
        if self._packed is None:
            import warnings

            with warnings.catch_warnings():  # torch warns that quantized tensor creation is deprecated
                warnings.simplefilter("ignore")
                q = torch._make_per_channel_quantized_tensor(
                    self.qweight, self.scale.double(), torch.zeros(self.shape[0], dtype=torch.long), 0
                )
                self._packed = torch.ops.quantized.linear_prepack(q, None)
        return self._packed

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense weight (out, in) these int8 values stand for."""
        return (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)

    def rows(self, ids: Tensor) -> Tensor:
        """Dequantized rows ``ids`` (n, in) in fp32 (embedding lookups)."""
        return self.qweight[ids].to(torch.float32) * self.scale[ids][:, None]

    def subset(self, ids: Tensor) -> Int8Linear:
        """The output channels ``ids`` as their own int8 weight (same values and scales, same kernel)."""
        out = Int8Linear.__new__(Int8Linear)
        out.shape = (int(ids.shape[0]), self.shape[1])
        out.scale, out.qweight = self.scale[ids].contiguous(), self.qweight[ids].contiguous()
        out.kernel, out._packed, out._scb = self.kernel, None, out.scale * 127.0
        return out

    def to(self, device: torch.device) -> Int8Linear:
        """The same int8 weight on ``device`` (the kernel re-chosen for it: ``bnb`` on CUDA)."""
        out = Int8Linear.__new__(Int8Linear)
        out.shape, out.qweight, out.scale = self.shape, self.qweight.to(device), self.scale.to(device)
        out.kernel = self.kernel if device.type == self.qweight.device.type else _int8_kernel(device)
        out._packed, out._scb = None, out.scale * 127.0
        return out

    def linear(self, x: Tensor, invariant: bool = False) -> Tensor:
        """x (T, in) -> (T, out) in x's dtype. ``invariant``: each row's result independent of the other rows. The
        ``int8pack`` kernel is weight-only (each row's activations stay as they are), so a target's weights run it
        as they are (whether this machine's build gives every row count the same bits is checked by
        :mod:`specexec.loading.invariance`); the others quantize a whole pass's activations together, so they
        dequantize and run the dense product instead."""
        if invariant and self.kernel == "int8pack" and x.device.type == "cpu":
            return torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale.to(x.dtype))
        if invariant:
            return torch.nn.functional.linear(x, self.dequantize(x.dtype))
        if self.kernel == "bnb":
            import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes; imported once, then cached)

            a = x.to(torch.float16) if x.device.type == "cuda" else x
            qa, row_stats, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(a.contiguous())
            return torch.ops.bitsandbytes.int8_scaled_mm(qa, self.qweight, row_stats, self._scb, dtype=x.dtype)
        if self.kernel == "dynamic":
            y = torch.ops.quantized.linear_dynamic(x.float(), self._prepacked(), True)
            return y.to(x.dtype)
        if self.kernel == "int8pack":
            return torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale.to(x.dtype))
        return linear(x, self.dequantize(x.dtype))

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4
