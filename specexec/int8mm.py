"""A fused weight-only int8 GEMM for a draft's linears on CUDA (Triton): ``y = (x @ q.T) * scale``.

A draft's passes multiply a few dozen to a few hundred rows by every weight, so they are bound by reading the
weights. bitsandbytes' int8 path reads 1 byte a weight too, but it is W8A8: each linear casts its input to fp16,
quantizes it row-wise, runs the int8 GEMM, dequantizes and casts back -- four extra kernels a linear, which made
an int8 7B pass on an H200 cost 8.6 ms of kernels against the 16-bit pass's 7.1 (docs/BENCHMARKS.md, "where the
draft's time goes"). This kernel reads the int8 codes tile by tile, widens them to the activations' dtype in
registers (every code in -127..127 is exact in bf16/fp16), accumulates in fp32 and applies the per-output-channel
scale in the epilogue: one kernel a linear, 1 byte a weight, activations never quantized (so it is also closer
to the dense weights than W8A8).

Measured on an H200 (docs/BENCHMARKS.md, fifth H200 session): a 7B layer's linears at 16 rows took 79 us against
bitsandbytes' 138 and 16-bit's 110, at 32 rows 108 against 135 and 111, but at 64 rows 160 against 148 and at 128
262 against 175 (its tiles use mma.sync; no warp-group MMA, no split-K), and end to end it did not beat
bitsandbytes' even up to 32 rows only. So it is opt-in (``specexec.model.CUDA_INT8_KERNEL = "triton"``: this
kernel up to ``TRITON_MAX_ROWS`` rows a call, bitsandbytes' beyond).

Only drafts use it: a draft's numbers change what it proposes, never the output. Weights are the
:class:`~specexec.model.Int8Linear` codes (out, in) int8 row-major with an fp32 scale per output channel.

Triton is imported lazily (CUDA builds of PyTorch ship it; CPU builds usually do not): :func:`available` says
whether this build has it. Tests run the same kernel on the CPU through Triton's interpreter (:func:`matmul` with
``interpret=True``; the process must have ``TRITON_INTERPRET=1`` set before Triton's first import, since Triton
builds its own helpers then: tests/conftest.py sets it where there is no GPU).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


def available() -> bool:
    """Whether this build can run the kernel on CUDA (Triton importable)."""
    return importlib.util.find_spec("triton") is not None


def tile(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for ``m`` rows and ``n`` outputs.

    Bound by the weights' bytes for the row counts a draft's levels use: the row tile covers all rows up to 64
    (each weight tile is read once), and the column tile is narrow enough that even a 4096-output linear spreads
    over ~128 programs (a GPU's SMs); beyond 64 rows (prefill) bigger tiles reuse each weight tile more.
    """
    if m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        bn_narrow, bn_wide, bk, warps, stages = SMALL_TILE
        return bm, bn_narrow if n <= 8192 else bn_wide, bk, warps, stages
    return 64, 128, 64, 4, 3


# up to 64 rows: (BLOCK_N up to 8192 outputs, BLOCK_N beyond, BLOCK_K, num_warps, num_stages); a module constant so
# that scripts/bench_int8mm.py can time alternatives (its small-tiles option)
SMALL_TILE: tuple[int, ...] = (32, 64, 256, 4, 3)  # the best of four tried on an H200 at 16-32 rows


@contextlib.contextmanager
def _interpreted(on: bool) -> Iterator[None]:
    """Triton's CPU interpreter on (``TRITON_INTERPRET=1``) for the block: it is read when a kernel is built and
    again by modules Triton imports while it runs one."""
    prev = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if on:
            if prev is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = prev


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool) -> Any:
    """The jitted kernel; ``interpret`` builds it under Triton's CPU interpreter (tests)."""
    with _interpreted(interpret):
        import triton
        import triton.language as tl

        @triton.jit  # type: ignore[misc]
        def int8_mm(
            x_ptr,
            w_ptr,
            s_ptr,
            y_ptr,
            M,
            N,
            K: tl.constexpr,  # a draft has 2-3 inner sizes; N changes with a growing subset head
            stride_xm,
            stride_ym,
            BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr,
            EVEN_K: tl.constexpr,
            WIDEN_FP32: tl.constexpr,
        ):
            pid_m = tl.program_id(0)
            pid_n = tl.program_id(1)
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rk = tl.arange(0, BLOCK_K)
            m_ok = rm < M
            n_ok = rn < N
            x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
            w_ptrs = w_ptr + rn[None, :] * K + rk[:, None]  # a (BLOCK_K, BLOCK_N) view of the (N, K) codes
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                    b = tl.load(w_ptrs, mask=n_ok[None, :], other=0)
                else:
                    k_ok = (k0 + rk) < K
                    a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0)
                if WIDEN_FP32:  # the interpreter's int8 -> bf16 cast is wrong; fp32 is exact for the codes too
                    acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
                else:
                    acc += tl.dot(a, b.to(a.dtype))
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            s = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
            acc = acc * s[None, :]
            y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

        return int8_mm


_WARM: set[tuple[Any, ...]] = set()  # (device, dtype, K, wide outputs, outputs % 16 == 0) compiled for every tile
WARM_ROWS = (1, 16, 32, 64, 65)  # one row count per tile :func:`tile` picks (Triton specializes 1 row apart)


def _warm(x: Tensor, qweight: Tensor, scale: Tensor, interpret: bool) -> None:
    """Compile every row tile for this weight's kind once, at its first call: a draft's first pass runs eagerly
    (prefill, warm-up), while later level widths may first appear inside a CUDA graph capture or a timed step."""
    n, k = qweight.shape
    key = (x.device, x.dtype, k, n > 8192, n % 16 == 0, interpret)
    if key in _WARM:
        return
    _WARM.add(key)
    for m in WARM_ROWS:
        _launch(torch.zeros((m, k), dtype=x.dtype, device=x.device), qweight, scale, interpret)


def matmul(x: Tensor, qweight: Tensor, scale: Tensor, interpret: bool = False) -> Tensor:
    """x (T, in) in fp16/bf16/fp32 @ (qweight (out, in) int8 * scale (out,) fp32).T -> (T, out) in x's dtype."""
    if x.shape[1] != qweight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {qweight.shape[1]}")
    _warm(x, qweight, scale, interpret)
    return _launch(x, qweight, scale, interpret)


def _launch(x: Tensor, qweight: Tensor, scale: Tensor, interpret: bool) -> Tensor:
    m, k = x.shape
    n = qweight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps, stages = tile(m, n)
    grid = ((m + bm - 1) // bm, (n + bn - 1) // bn)
    widen = interpret or x.dtype == torch.float32
    kern = _kernel(interpret)
    kw: dict[str, Any] = {} if interpret else {"num_warps": warps, "num_stages": stages}
    with _interpreted(interpret):
        kern[grid](
            x, qweight, scale, y, m, n, k, x.stride(0), y.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, WIDEN_FP32=widen, **kw,
        )  # fmt: skip
    return y
