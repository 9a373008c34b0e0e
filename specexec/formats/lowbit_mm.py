"""Fused low-bit GEMMs for a draft's linears on CUDA (Triton): int8 and NF4 weights, one kernel a linear.

A draft's passes multiply a few dozen to a few hundred rows by every weight, so they are bound by reading the
weights. bitsandbytes' int8 path reads 1 byte a weight but is W8A8: each linear casts its input to fp16, quantizes
it row-wise, runs the int8 GEMM, dequantizes and casts back (four extra kernels). Its NF4 path beyond one row
dequantizes the whole weight to 16 bits in memory and runs a dense GEMM over it (the weight's bytes written and
read again: an NF4 7B pass cost ~17 ms on an H200 against 9 ms in 16 bits, docs/BENCHMARKS.md). These kernels
read the low-bit weight tile by tile, decode it in registers (int8 codes widen exactly; an NF4 code is looked up
in the 16-level table and scaled by its block's absmax, the value bitsandbytes' dequantization gives), multiply
in the activations' dtype with fp32 accumulation and write the output once.

Layout: "swap AB". Each program computes a (BLOCK_O outputs × BLOCK_T rows) tile of ``y.T = W @ x.T``: the decoded
weight tile is the MMA's A operand (registers), the rows of ``x`` its B operand. Few rows then still make a full
MMA tile on the weight side, and Hopper's warp-group MMA may take its A operand from registers (its B operand only
from shared memory: the first version of this kernel had the decoded weight tile there, stored it to shared memory
each step, and measured slower than bitsandbytes beyond 32 rows on an H200; why was not profiled).

Measured: the first (B-position) int8 version on an H200, a 7B layer's linears: 79 us at 16 rows against
bitsandbytes' 138 and 16-bit's 110; 108 / 135 / 111 at 32; but 160 / 148 / 114 at 64 and 262 / 175 / 123 at 128,
and end to end it did not beat bitsandbytes'. This version and the NF4 kernel are not GPU-measured yet
(``scripts/bench_lowbit_mm.py``). So both are opt-in: ``specexec.formats.int8.CUDA_INT8_KERNEL`` and
``specexec.formats.nf4.DRAFT_NF4_KERNEL`` (drafts only; a streamed target keeps bitsandbytes').

Only drafts use them: a draft's numbers change what it proposes, never the output.

Triton is imported lazily (CUDA builds of PyTorch ship it; CPU builds usually do not): :func:`available` says
whether this build has it. Tests run the same kernels on the CPU through Triton's interpreter (``interpret=True``;
the process must have ``TRITON_INTERPRET=1`` set before Triton's first import, since Triton builds its own helpers
then: tests/conftest.py sets it where there is no GPU).
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

INT8, NF4 = 0, 1
# the most rows a call the opt-in kernels take (a draft's widest level); more (a prefill) go to bitsandbytes'
MAX_ROWS = 256


def available() -> bool:
    """Whether this build can run the kernels on CUDA (Triton importable)."""
    return importlib.util.find_spec("triton") is not None


# (BLOCK_O, BLOCK_T at most, BLOCK_K, num_warps, num_stages); a module constant so that scripts/bench_lowbit_mm.py
# can time alternatives (its tiles option)
TILE: tuple[int, ...] = (64, 64, 128, 4, 3)


def tile(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_O, BLOCK_T, BLOCK_K, num_warps, num_stages) for ``m`` rows and ``n`` outputs: the row tile covers all
    rows up to :data:`TILE`'s cap (each weight tile is then decoded once a call); a narrow linear (up to 8192
    outputs) with few rows takes half-height output tiles so that it still spreads over a GPU's ~100+ SMs."""
    bo, bt_max, bk, warps, stages = TILE
    bt = min(max(16, 1 << (m - 1).bit_length()), bt_max)
    if m <= 32 and n <= 8192:
        bo = max(16, bo // 2)
    return bo, bt, bk, warps, stages


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

        # no specialization on the row and output counts (Triton would compile again for a count of 1 or a multiple
        # of 16, or for a subset head whose size crosses one): one compile a tile
        @triton.jit(do_not_specialize=["M", "N"])  # type: ignore[misc]
        def lowbit_mm(
            x_ptr,
            w_ptr,  # int8 codes (N, K) row-major, or NF4: two codes a byte over the flattened (N, K), high first
            s_ptr,  # int8: a scale per output (N,); NF4: an absmax per BLOCKSIZE consecutive values
            code_ptr,  # NF4: the 16 levels (fp32); unused for int8
            y_ptr,
            M,
            N,
            K: tl.constexpr,  # a draft has 2-3 inner sizes; N changes with a growing subset head
            stride_xm,
            stride_ym,
            FMT: tl.constexpr,
            BLOCKSIZE: tl.constexpr,
            BLOCK_O: tl.constexpr,
            BLOCK_T: tl.constexpr,
            BLOCK_K: tl.constexpr,
            ALIGNED: tl.constexpr,  # K % BLOCK_K == 0 and (NF4) BLOCK_K % BLOCKSIZE == 0: whole tiles, whole blocks
            WIDEN_FP32: tl.constexpr,
        ):
            pid_o = tl.program_id(0)
            pid_t = tl.program_id(1)
            ro = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
            rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
            rk = tl.arange(0, BLOCK_K)
            o_ok = ro < N
            t_ok = rt < M
            row = ro.to(tl.int64) * K  # flat offset of each output's first weight
            acc = tl.zeros((BLOCK_O, BLOCK_T), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                k_ok = kk < K
                xt = tl.load(
                    x_ptr + rt[None, :] * stride_xm + kk[:, None], mask=t_ok[None, :] & k_ok[:, None], other=0.0
                )  # (BLOCK_K, BLOCK_T)
                if FMT == 0:
                    # the int8 codes, widened below (exact in any float type; under the interpreter, whose
                    # int8 -> bf16 cast is wrong, through fp32)
                    w = tl.load(w_ptr + row[:, None] + kk[None, :], mask=o_ok[:, None] & k_ok[None, :], other=0)
                elif ALIGNED:
                    rb = tl.arange(0, BLOCK_K // 2)
                    b = tl.load(w_ptr + (row[:, None] + k0) // 2 + rb[None, :], mask=o_ok[:, None], other=0)
                    idx = tl.interleave((b >> 4) & 15, b & 15)  # (BLOCK_O, BLOCK_K), high nibble first
                    v = tl.load(code_ptr + idx.to(tl.int32))
                    rs = tl.arange(0, BLOCK_K // BLOCKSIZE)
                    am = tl.load(s_ptr + (row[:, None] + k0) // BLOCKSIZE + rs[None, :], mask=o_ok[:, None], other=0.0)
                    w = tl.reshape(
                        tl.reshape(v, (BLOCK_O, BLOCK_K // BLOCKSIZE, BLOCKSIZE)) * am[:, :, None], (BLOCK_O, BLOCK_K)
                    )
                else:  # any K: every value finds its byte, nibble and block on its own
                    flat = row[:, None] + kk[None, :]
                    wmask = o_ok[:, None] & k_ok[None, :]
                    b = tl.load(w_ptr + flat // 2, mask=wmask, other=0).to(tl.int32)
                    idx = (b >> ((1 - flat % 2) * 4).to(tl.int32)) & 15
                    v = tl.load(code_ptr + idx)
                    w = v * tl.load(s_ptr + flat // BLOCKSIZE, mask=wmask, other=0.0)
                if WIDEN_FP32:
                    acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
                else:
                    acc += tl.dot(w.to(xt.dtype), xt)
            if FMT == 0:
                acc = acc * tl.load(s_ptr + ro, mask=o_ok, other=0.0)[:, None]
            y_ptrs = y_ptr + rt[None, :] * stride_ym + ro[:, None]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=o_ok[:, None] & t_ok[None, :])

        return lowbit_mm


_WARM: set[tuple[Any, ...]] = set()  # (format, device, dtype, K, outputs > 8192, interpreted): tiles compiled
WARM_ROWS = (16, 32, 64)  # one row count per row tile :func:`tile` picks (up to 16, 32, 64 rows)


def int8_matmul(x: Tensor, qweight: Tensor, scale: Tensor, interpret: bool = False) -> Tensor:
    """x (T, in) in fp16/bf16/fp32 @ (qweight (out, in) int8 * scale (out,) fp32).T -> (T, out) in x's dtype."""
    n, k = qweight.shape
    return _matmul(INT8, x, qweight, scale, None, n, k, 0, interpret)


def nf4_matmul(
    x: Tensor,
    packed: Tensor,
    absmax: Tensor,
    code: Tensor,
    shape: tuple[int, int],
    blocksize: int,
    interpret: bool = False,
) -> Tensor:
    """x (T, in) @ W.T -> (T, out) in x's dtype, W (out, in) in bitsandbytes' NF4 (``packed`` (ceil(out*in/2),)
    uint8, high nibble first; ``absmax`` (ceil(out*in/blocksize),) fp32; ``code`` the 16 levels fp32). Each weight
    is ``code[q] * absmax[block]`` rounded to x's dtype, as bitsandbytes' dequantization gives it."""
    n, k = shape
    return _matmul(NF4, x, packed.view(-1), absmax, code, n, k, blocksize, interpret)


def _matmul(
    fmt: int, x: Tensor, w: Tensor, s: Tensor, code: Tensor | None, n: int, k: int, blocksize: int, interpret: bool
) -> Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}, the weight takes {k} columns")
    key = (fmt, x.device, x.dtype, k, n > 8192, interpret)
    if key not in _WARM:  # compile every row tile at the first call: a draft's first pass runs eagerly (prefill,
        _WARM.add(key)  # warm-up), while later level widths may first appear in a graph capture or a timed step
        for m in WARM_ROWS:
            _launch(fmt, torch.zeros((m, k), dtype=x.dtype, device=x.device), w, s, code, n, k, blocksize, interpret)
    return _launch(fmt, x, w, s, code, n, k, blocksize, interpret)


def _launch(
    fmt: int, x: Tensor, w: Tensor, s: Tensor, code: Tensor | None, n: int, k: int, blocksize: int, interpret: bool
) -> Tensor:
    m = x.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bo, bt, bk, warps, stages = tile(m, n)
    aligned = k % bk == 0 and (fmt == INT8 or bk % blocksize == 0)
    grid = ((n + bo - 1) // bo, (m + bt - 1) // bt)
    widen = interpret or x.dtype == torch.float32
    kw: dict[str, Any] = {} if interpret else {"num_warps": warps, "num_stages": stages}
    with _interpreted(interpret):
        _kernel(interpret)[grid](
            x, w, s, code if code is not None else s, y, m, n, k, x.stride(0), y.stride(0),
            FMT=fmt, BLOCKSIZE=max(blocksize, 1), BLOCK_O=bo, BLOCK_T=bt, BLOCK_K=bk, ALIGNED=aligned,
            WIDEN_FP32=widen, **kw,
        )  # fmt: skip
    return y


def compile_for(arch: int, fmt: int, m: int, n: int, k: int, blocksize: int = 64, dtype: str = "bf16") -> Any:
    """Compile (do not run) the kernel for a CUDA GPU of compute capability ``arch`` (80: A100, 89: RTX 40xx, 90:
    H100/H200) with the tile :func:`tile` picks for ``m`` rows and ``n`` outputs of inner size ``k``: Triton ships
    its own ptxas, so this needs no GPU (tests check that every tile a draft uses compiles). Returns Triton's
    compiled kernel (``.asm["ptx"]``, ``.metadata.shared``). Must run in a process without ``TRITON_INTERPRET``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = _kernel(False)
    bo, bt, bk, warps, stages = tile(m, n)
    consts = {
        "K": k, "FMT": fmt, "BLOCKSIZE": blocksize, "BLOCK_O": bo, "BLOCK_T": bt, "BLOCK_K": bk,
        "ALIGNED": k % bk == 0 and (fmt == INT8 or bk % blocksize == 0), "WIDEN_FP32": dtype == "fp32",
    }  # fmt: skip
    sig = {
        "x_ptr": f"*{dtype}", "w_ptr": "*i8" if fmt == INT8 else "*u8", "s_ptr": "*fp32", "code_ptr": "*fp32",
        "y_ptr": f"*{dtype}", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_ym": "i32",
    }  # fmt: skip
    names = list(kern.arg_names)
    signature = {a: sig.get(a, "constexpr") for a in names}
    src = ASTSource(fn=kern, signature=signature, constexprs={(names.index(a),): v for a, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
