"""Dense linears and embedding lookups (the dispatch every weight format goes through).

Two ways to run a linear:

- :func:`linear`, the fastest kernel for each pass's shape: on a CPU, passes of a few rows may run ``w @ x.T``
  instead of ``F.linear`` (which row counts do is measured per machine, :mod:`specexec.loading.cpu_probe`). A
  row's result then depends on how many rows its pass has: matrix libraries pick their kernel and blocking by
  shape, and different blockings sum in different orders. Drafts run this way (they only propose).
- :func:`tiled_linear`, shape-invariant: every pass is padded to a multiple of a fixed row tile and runs one
  kernel configuration (:class:`Tiling`), so each row's result is bit-identical in a one-token step, a tree of
  any size and a prefill. Targets run this way unless told not to. Which tile gives invariance, and which is
  fastest, is measured on the machine (:mod:`specexec.loading.invariance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# Which CPU passes go through ``w @ x.T`` instead of ``F.linear`` (see :func:`linear`), per dtype, by row count.
# The BLAS picks its kernel by shape, and which orientation wins depends on the CPU, the build and the row count
# (by 2-3x at a few rows, either way, even between CPUs of one class). So :mod:`specexec.loading.cpu_probe` measures
# both on the model's own layer shapes (:func:`set_cpu_orientation`); until it has, fp32 uses ``w @ x.T`` for 8..48
# rows (a 9-token pass of the demo target 1.6x faster on an AVX2 EPYC; see docs/BENCHMARKS.md) and other dtypes
# ``F.linear``.
ORIENT_MAX_ROWS = 64  # larger passes (prefill, big trees) always use F.linear
_DEFAULT_FP32_ROWS = (8, 48)
_CPU_ORIENT: dict[torch.dtype, tuple[bool, ...]] = {
    torch.float32: tuple(_DEFAULT_FP32_ROWS[0] <= r <= _DEFAULT_FP32_ROWS[1] for r in range(ORIENT_MAX_ROWS + 1))
}


def set_cpu_orientation(dtype: torch.dtype, transposed_rows: Sequence[int] | None) -> None:
    """CPU passes in ``dtype`` with a row count in ``transposed_rows`` use ``w @ x.T`` (process-wide); None
    restores the default rule."""
    if transposed_rows is None:
        if dtype == torch.float32:
            lo, hi = _DEFAULT_FP32_ROWS
            _CPU_ORIENT[dtype] = tuple(lo <= r <= hi for r in range(ORIENT_MAX_ROWS + 1))
        else:
            _CPU_ORIENT.pop(dtype, None)
        return
    rows = set(transposed_rows)
    _CPU_ORIENT[dtype] = tuple(r in rows for r in range(ORIENT_MAX_ROWS + 1))


def cpu_orientation(dtype: torch.dtype) -> list[int]:
    """The row counts whose CPU passes in ``dtype`` use ``w @ x.T``."""
    table = _CPU_ORIENT.get(dtype, ())
    return [r for r, on in enumerate(table) if on]


def set_cpu_transposed(dtype: torch.dtype, on: bool) -> None:
    """Whether CPU passes of 8..48 rows in ``dtype`` use the ``w @ x.T`` orientation (process-wide)."""
    set_cpu_orientation(dtype, range(8, 49) if on else [])


def cpu_transposed(x: Tensor) -> bool:
    """Does :func:`linear` run ``x`` (T, in) through ``w @ x.T``?"""
    if x.device.type != "cpu" or x.dim() != 2:
        return False
    table = _CPU_ORIENT.get(x.dtype)
    r = x.shape[0]
    return table is not None and r <= ORIENT_MAX_ROWS and table[r]


def linear(x: Tensor, w: Any) -> Tensor:
    """x (T, in) @ w.T -> (T, out). ``w`` is a dense tensor or any object with ``.linear(x)`` (e.g. NF4, int8).

    On a CPU, passes of a few rows (tree verification, draft levels) may go through ``w @ x.T``: the BLAS often
    picks a far better kernel for that orientation. Which row counts do is measured per machine and dtype by
    :mod:`specexec.loading.cpu_probe` (:func:`set_cpu_orientation`; the numbers it saw are in ``doctor``).
    """
    if isinstance(w, Tensor):
        if cpu_transposed(x):
            return torch.mm(w, x.T).T
        return F.linear(x, w)
    return w.linear(x)


def embed_rows(w: Any, tokens: Tensor) -> Tensor:
    """Embedding lookup: rows ``tokens`` of a dense (V, D) tensor or of a quantized weight (``.rows(tokens)``)."""
    if isinstance(w, Tensor):
        return w[tokens]
    return w.rows(tokens)


@dataclass(frozen=True)
class Tiling:
    """How a shape-invariant model runs its passes.

    Every linear pads its rows (zeros) to a multiple of ``rows`` and runs them through one kernel configuration:
    one call (``loop`` False: this machine's library gives every row of a padded pass the same result whatever
    the pass's size) or one fixed-shape call per tile of ``rows`` (``loop`` True: it does not, but a fixed shape
    always gets the same kernel). ``transposed``: the calls are ``w @ x.T`` (CPU). Attention reads each row's
    keys in blocks of ``key_block`` positions (:func:`specexec.model.attention.blocked`), its products padded to
    ``attn_rows`` (its own tile: it computes in fp32 whatever the model's dtype). Passes of more than
    ``max_rows`` rows run as consecutive passes of at most that many (the row counts the invariance was checked
    up to).
    """

    rows: int = 4
    transposed: bool = False
    loop: bool = False
    key_block: int = 64
    max_rows: int = 256
    attn_rows: int = 4  # the row tile of the attention's products (their rows: a pass's queries, head by head)

    def pad(self, n: int) -> int:
        """``n`` rows rounded up to whole tiles."""
        return -(-n // self.rows) * self.rows

    def describe(self) -> str:
        how = f"{'w @ x.T' if self.transposed else 'F.linear'}, {'a call per tile' if self.loop else 'one call'}"
        return f"row tile {self.rows} ({how}), attention row tile {self.attn_rows}, key block {self.key_block}"


def invariant_weight(w: Any) -> Any:
    """The weight :func:`tiled_linear` multiplies: a quantized weight that can give its dense (16-bit) form
    (``.invariant_weight()``: NF4 dequantizes, once, into its scratch buffer) gives it, so the tiles that follow
    all multiply the same dense tensor in one fixed configuration; others (dense tensors, CPU kernels with their
    own invariant path: int8, q4) are returned as they are."""
    get = getattr(w, "invariant_weight", None)
    return get() if get is not None else w


def _mm(x: Tensor, w: Any, transposed: bool) -> Tensor:
    if isinstance(w, Tensor):
        return torch.mm(w, x.T).T if transposed else F.linear(x, w)
    return w.linear(x, invariant=True)


def tiled_linear(x: Tensor, w: Any, tiling: Tiling) -> Tensor:
    """x (T, in) @ w.T -> (T, out), each row's result independent of T and of the row's place (see :class:`Tiling`).
    ``w``: a dense tensor, or a quantized weight whose ``.linear(x, invariant=True)`` uses one kernel for every
    row count. A weight with ``.invariant_weight()`` (NF4) is dequantized once a call, before the tiles
    (:func:`invariant_weight`), and the tiles run the dense product."""
    w = invariant_weight(w)
    T = x.shape[0]
    P = tiling.pad(T)
    if P != T:
        x = torch.cat((x, x.new_zeros(P - T, x.shape[1])))
    if tiling.loop and P > tiling.rows:
        out = torch.cat([_mm(x[i : i + tiling.rows], w, tiling.transposed) for i in range(0, P, tiling.rows)])
    else:
        out = _mm(x, w, tiling.transposed)
    return out[:T] if P != T else out
