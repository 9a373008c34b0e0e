"""Shape-invariant attention on a GPU in one Triton kernel launch a layer.

The rule is the CPU kernel's (``attn.c``, :func:`specexec.model.attention.native`): every query row reduces its
keys in position order, here over fixed blocks of :data:`BLOCK` positions tied to absolute positions (block ``b``
covers positions ``[BLOCK*b, BLOCK*b + BLOCK)``), with an online softmax carried across the blocks in that order
and fp32 arithmetic throughout. One program per (row, query head): it reads only its own row's query and keys, so
its sequence of operations depends only on the row's positions, never on the pass (how many rows, which other
rows, where the row's keys sit in the cache). Within a block, a key's lane is its position modulo ``BLOCK``;
lanes the row does not see load zeros and score ``-inf``, so they add exact zeros (``exp(-inf) = 0``) to sums
whose reduction tree is fixed by the compiled kernel. Scores and weighted values are elementwise products
reduced with ``tl.sum``, not ``tl.dot`` (whose tiling could follow the rows sharing a tile).

Each row finds its keys through a per-row table (:class:`TreeKeys`): its visible slots in position order, all
rows' lists end to end, and the position of its first one. Nothing assumes a row's prefix sits at slots
``[0, V)``: a row's keys may be anywhere in the cache (a tree's ancestors, several requests in one pass).

Triton is imported on first use only (:func:`ready`), never when the package is imported. Under
``TRITON_INTERPRET=1`` the kernel runs on the CPU (the tests do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

BLOCK = 64  # positions per key block (the same blocks as ``blocked``'s key_block)


@dataclass(frozen=True)
class TreeKeys:
    """Where each row of a pass finds its keys (made once a pass, used by every layer)."""

    idx: Tensor  # (N,) int64: every row's visible slots in position order, end to end
    start: Tensor  # (P + 1,) int64: row r's slots are idx[start[r]:start[r + 1]] (at least one)
    first: Tensor  # (P,) int64: the position of row r's first visible slot (its later ones follow one by one)


def tree_keys(mask: Tensor, positions: Tensor, padded: int, window: int | None = None) -> TreeKeys:
    """The :class:`TreeKeys` of ``mask`` (T, L) bool and ``positions`` (T,), on the mask's device, for a pass
    padded to ``padded`` rows (padding rows see slot 0 at position 0). A row sees one slot per position up to its
    own, in increasing slot order (causal prefill, a tree's ancestry). ``window``: only the row's latest
    ``window`` positions (a sliding layer)."""
    T, L = mask.shape
    dev = mask.device
    m = torch.zeros(padded, L, dtype=torch.bool, device=dev)
    m[:T] = mask
    m[T:, 0] = True
    pos = torch.zeros(padded, dtype=torch.long, device=dev)
    pos[:T] = positions
    if window is not None:
        m &= m.cumsum(1) - 1 > pos[:, None] - window
    count = m.sum(1)
    start = torch.zeros(padded + 1, dtype=torch.long, device=dev)
    torch.cumsum(count, 0, out=start[1:])
    return TreeKeys(m.nonzero()[:, 1].contiguous(), start, pos + 1 - count)


_kernel: Any = None
_error: str | None = None


def _build() -> Any:
    """The jitted kernel (Triton imported here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def tree_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, idx_ptr, start_ptr, first_ptr, head_stride, scale, cap,
                         H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                         BLK: tl.constexpr, CAP: tl.constexpr):  # fmt: skip
        r = tl.program_id(0)
        h = tl.program_id(1)
        g = h // G
        s0 = tl.load(start_ptr + r)
        n = tl.load(start_ptr + r + 1) - s0
        p0 = tl.load(first_ptr + r)
        d = tl.arange(0, DP)
        dok = d < D
        q = tl.load(q_ptr + (r * H + h) * D + d, mask=dok, other=0.0).to(tl.float32)
        lane = tl.arange(0, BLK)
        m = tl.max(tl.full([BLK], float("-inf"), tl.float32), 0)
        den = tl.sum(tl.zeros([BLK], tl.float32), 0)
        acc = tl.zeros([DP], tl.float32)
        kbase = k_ptr + g * head_stride
        vbase = v_ptr + g * head_stride
        for b in range(p0 // BLK, (p0 + n - 1) // BLK + 1):
            j = b * BLK + lane - p0  # the lanes' entries in the row's list
            ok = (j >= 0) & (j < n)
            slot = tl.load(idx_ptr + s0 + j, mask=ok, other=0)
            off = slot[:, None] * D + d[None, :]
            both = ok[:, None] & dok[None, :]
            kk = tl.load(kbase + off, mask=both, other=0.0).to(tl.float32)
            s = tl.sum(kk * q[None, :], 1) * scale
            if CAP:
                s = cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)
            s = tl.where(ok, s, float("-inf"))
            top = tl.maximum(m, tl.max(s, 0))  # finite: every block in range holds one of the row's keys
            alpha = tl.exp(m - top)
            e = tl.exp(s - top)
            vv = tl.load(vbase + off, mask=both, other=0.0).to(tl.float32)
            den = den * alpha + tl.sum(e, 0)
            acc = acc * alpha + tl.sum(e[:, None] * vv, 0)
            m = top
        tl.store(o_ptr + (r * H + h) * D + d, (acc / den).to(o_ptr.dtype.element_ty), mask=dok)

    return tree_attn_kernel


def ready(device: torch.device) -> bool:
    """Does shape-invariant attention on ``device`` run :func:`tree_attention` (a CUDA device, Triton importable;
    or any device under ``TRITON_INTERPRET=1``, which the tests use)? Builds the kernel on first use."""
    global _kernel, _error
    if device.type != "cuda":
        return False
    return kernel() is not None


def kernel() -> Any:
    """The jitted kernel, or None where Triton cannot be imported (the reason in :data:`_error`)."""
    global _kernel, _error
    if _kernel is None and _error is None:
        try:
            _kernel = _build()
        except Exception as e:  # no Triton, or one that cannot build here
            _error = f"{type(e).__name__}: {e}"
    return _kernel


launches = 0  # kernel launches so far (:func:`specexec.decoding.loop.pass_ops` counts a pass's)


def launch(grid: tuple[int, int], *args: Any, **meta: Any) -> None:
    """One launch of the kernel (the dispatch test counts the calls)."""
    global launches
    launches += 1
    kernel()[grid](*args, **meta)


def tree_attention(
    q: Tensor, keys: Tensor, values: Tensor, rows: TreeKeys, scale: float | None = None, cap: float | None = None
) -> Tensor:
    """Shape-invariant attention (see the module docstring) in one kernel launch. q (P, H, hd) for the pass's
    padded rows; keys/values (KVH, slots, hd), rows and heads contiguous: the layer's cache after this pass's
    writes -> (P, H*hd) in q's dtype. ``scale``: the scores' scale (default 1/sqrt(hd)); ``cap``: tanh
    soft-capping of the scores."""
    P, H, hd = q.shape
    KVH = keys.shape[0]
    assert H % KVH == 0 and values.shape == keys.shape and values.stride() == keys.stride()
    assert keys.stride(2) == 1 and keys.stride(1) == hd
    q = q.contiguous()
    out = torch.empty(P, H, hd, dtype=q.dtype, device=q.device)
    launch(
        (P, H), q, keys, values, out, rows.idx, rows.start, rows.first, keys.stride(0),
        1.0 / math.sqrt(hd) if scale is None else float(scale), 1.0 if cap is None else float(cap),
        H=H, G=H // KVH, D=hd, DP=1 << max(hd - 1, 0).bit_length(), BLK=BLOCK, CAP=cap is not None,
    )  # fmt: skip
    return out.view(P, H * hd)
