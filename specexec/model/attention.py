"""Attention over the static KV cache, three ways.

- :func:`sdpa`: PyTorch's fused kernel under an additive mask; the fastest. Its result for a row depends on the
  pass around it (how many rows, where the row's keys sit in the cache, how many slots it spans), because the
  kernel's blocking and vector lanes follow those. Drafts use it.
- :func:`blocked`: shape-invariant. Each row's keys are taken in *position* order, not slot order (a tree node's
  ancestors sit at the slots of their tree rows, not at their positions), in blocks of ``B`` positions that start
  at position 0. Two passes over the blocks: the row's maximum score (order-free), then per block the sum of
  ``exp(score - max)`` and its weighted values (fixed-size reductions and products), and the blocks are added
  in position order (a sequential sum: blocks a row does not see add exact zeros). Every such operation's
  result depends only on the row's query, positions and keys, so a row gets the same bits in a one-token step,
  a prefill or any tree row. Full blocks below the committed prefix (the same for every row) are scored for all
  rows at once; each row's last block and any block that holds its tree ancestors are gathered per row. Both
  run the same fixed-shape products, with query rows padded to the tiling's row tile (see
  :class:`~specexec.formats.dense.Tiling`; the invariance check runs this function).
- :func:`native`: shape-invariant on a CPU, by construction: a C kernel takes each row and head on its own over
  the row's keys in position order. One call a layer where :func:`blocked` runs some forty torch operations, whose
  dispatch cost more than the arithmetic in a one-token step. A CPU model's invariant passes use it wherever the
  package's C kernels build (:func:`native_ready`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's SDPA builds an execution plan per new (T, L) shape: 60-124 ms each on an H100 (L grows every step), and
# it runs 3x slower than needed for small T even when planned. The other backends handle our masks well.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive bias (1, 1, T, L) for ``mask`` (T, L) bool (True: may attend): 0 or -inf. Made once a pass
    (the same values SDPA would make from the boolean mask in every layer)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[None, None]


def sdpa(
    q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float | None = None, cap: float | None = None
) -> Tensor:
    """q (T, H, hd) over slots [0, L) of keys/values (KVH, >= L, hd) under ``bias`` (1, 1, T, L) -> (T, H*hd).
    ``scale``: the scores' scale (default 1/sqrt(hd)); ``cap``: tanh soft-capping of the scores (Gemma 2), which
    the fused kernel cannot do, so those scores are computed explicitly."""
    T, H, hd = q.shape
    L = bias.shape[-1]
    keys, values = keys[:, :L], values[:, :L]
    if keys.shape[0] != H:  # expand KV heads: SDPA's GQA mode falls back to the slow math kernel when a mask is given
        keys = keys.repeat_interleave(H // keys.shape[0], dim=0)
        values = values.repeat_interleave(H // values.shape[0], dim=0)
    qh = q.transpose(0, 1)  # (H, T, hd)
    if cap is not None:
        s = torch.matmul(qh, keys.transpose(-1, -2)) * (scale if scale is not None else hd**-0.5)
        s = torch.tanh(s / cap) * cap + bias[0]
        o = torch.matmul(s.softmax(-1, dtype=torch.float32).to(q.dtype), values)
        return o.transpose(0, 1).reshape(T, H * hd)
    with sdpa_kernel(_SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(qh[None], keys[None], values[None], attn_mask=bias, scale=scale)
    return o[0].transpose(0, 1).reshape(T, H * hd)


@dataclass(frozen=True)
class KeyPlan:
    """Where each row of a pass finds its keys in position order (made once a pass, used by every layer).

    Rows see positions 0..pos[r], one slot each. Below ``shared * block`` those are slots 0.. (the committed
    prefix: scored for all rows at once); row r uses shared block k when ``full[r, k]``. Its other positions, from
    block ``min(pos // block, shared)`` up to its own, are gathered per row: ``slots`` (P, R*block), ``seen``
    marks the positions it has."""

    block: int
    shared: int
    full: Tensor  # (P, shared) bool
    slots: Tensor  # (P, R*block) long
    seen: Tensor  # (P, R*block) bool
    rows: int  # the product row tile


def plan_keys(
    mask: Tensor, positions: Tensor, padded: int, block: int, rows: int, window: int | None = None
) -> KeyPlan:
    """The :class:`KeyPlan` for ``mask`` (T, L) bool and ``positions`` (T,), the pass padded to ``padded`` rows
    (padding rows see slot 0 only). Each row must see exactly one slot per position 0..positions[r], in
    increasing slot order (causal prefill, a tree's ancestry over a committed prefix).

    ``window``: the rows attend only to their latest ``window`` positions (a sliding layer). Every row then
    gathers its blocks from the one holding its first visible position (no shared blocks): the blocks below it
    would add exact zeros, and a shared block could not precede a row's gathered ones in position order."""
    T, L = mask.shape
    dev = mask.device
    pos = torch.zeros(padded, dtype=torch.long, device=dev)
    pos[:T] = positions
    m = torch.zeros(padded, L, dtype=torch.bool, device=dev)
    m[:T] = mask
    m[T:, 0] = True
    cols = torch.arange(L, device=dev)
    # slots [0, V) hold positions [0, V) for every row (what it sees there is exactly positions <= its own)
    bad = (m != (cols[None, :] <= pos[:, None])).any(0)
    V = int(bad.to(torch.uint8).argmax()) if bool(bad.any()) else L
    shared = V // block
    own = pos // block
    first = own.clamp(max=shared)
    low = torch.zeros_like(pos)
    if window is not None:
        shared = 0
        low = (pos - window + 1).clamp(min=0)
        first = low // block
    R = int((own - first).max()) + 1
    j = first[:, None] * block + torch.arange(R * block, device=dev)[None, :]  # (P, R*block) positions
    seen = (j <= pos[:, None]) & (j >= low[:, None])
    slots = j.clone()
    if V < L:  # positions >= V: the row's visible slots >= V, in order
        beyond = torch.where(m[:, V:], cols[V:][None, :], L + cols[V:][None, :]).sort(dim=1).values
        k = (j - V).clamp(0, L - V - 1)
        slots = torch.where(j < V, j, beyond.gather(1, k))
    slots = torch.where(seen, slots, torch.zeros_like(slots))
    full = torch.arange(shared, device=dev)[None, :] < own[:, None]
    return KeyPlan(block, shared, full, slots, seen, rows)


def _pad_rows(x: Tensor, rows: int, dim: int) -> Tensor:
    """Zero rows appended along ``dim`` up to a multiple of ``rows``."""
    n = x.shape[dim]
    p = -(-n // rows) * rows
    if p == n:
        return x
    shape = list(x.shape)
    shape[dim] = p - n
    return torch.cat((x, x.new_zeros(shape)), dim=dim)


def _fold(x: Tensor, dim: int) -> Tensor:
    """The sum along ``dim`` in index order, one term after another (a CPU cumsum is sequential); terms that are
    exact zeros leave it unchanged."""
    if x.device.type == "cpu":
        return x.cumsum(dim).select(dim, -1)
    out = x.select(dim, 0).clone()
    for i in range(1, x.shape[dim]):
        out += x.select(dim, i)
    return out


MIN_OUTPUTS = 1 << 22
"""On a GPU the attention's batched products always compute at least this many output values (zero matrices
appended where they would not): with few, cuBLAS splits each product's inner dimension between thread blocks to
fill the GPU (split-K), which sums in another order, so a row's bits would follow how many rows its pass has."""


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` over matching batch dimensions (either may be expanded). On a GPU: one batched product of at least
    :data:`MIN_OUTPUTS` outputs (see there); on a CPU, ``torch.matmul``."""
    if a.device.type == "cpu":
        return torch.matmul(a, b)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    n = a3.shape[0]
    need = -(-MIN_OUTPUTS // (a.shape[-2] * b.shape[-1]))
    if n < need:
        a3 = torch.cat((a3, a3.new_zeros(need - n, *a3.shape[1:])))
        b3 = torch.cat((b3, b3.new_zeros(need - n, *b3.shape[1:])))
    return torch.bmm(a3, b3)[:n].view(*batch, a.shape[-2], b.shape[-1])


def _cap(s: Tensor, cap: float | None) -> Tensor:
    return s if cap is None else torch.tanh(s / cap).mul_(cap)


CHUNK_ELEMENTS = 1 << 24  # a row chunk's largest working tensor, in fp32 elements (64 MB)


def blocked(
    q: Tensor, keys: Tensor, values: Tensor, plan: KeyPlan, scale: float | None = None, cap: float | None = None
) -> Tensor:
    """Shape-invariant attention (see the module docstring). q (P, H, hd) for the pass's padded rows; keys/values
    (KVH, slots, hd): the layer's cache after this pass's writes -> (P, H*hd) in q's dtype. ``scale``: the
    scores' scale (default 1/sqrt(hd)); ``cap``: tanh soft-capping of the scores (elementwise, on whole tiles).

    Rows run in chunks of whole row tiles so that the working tensors stay near :data:`CHUNK_ELEMENTS` (a big
    tree over a long prefix would otherwise score every row against every block at once); a row's result does
    not depend on the chunk it is in (the products give every row of a whole number of tiles the same bits)."""
    P, H, hd = q.shape
    blocks = plan.shared + plan.slots.shape[1] // plan.block
    # a row's scores over all its blocks, and its gathered keys and values (many blocks in a sliding layer, whose
    # rows gather their whole window)
    per_row = max(H * blocks * max(plan.block, hd), 2 * keys.shape[0] * plan.slots.shape[1] * hd)
    c = max(plan.rows, CHUNK_ELEMENTS // max(per_row, 1) // plan.rows * plan.rows)
    if c >= P:
        return _blocked(q, keys, values, plan, scale, cap)
    out = []
    for a in range(0, P, c):
        part = KeyPlan(plan.block, plan.shared, plan.full[a : a + c], plan.slots[a : a + c], plan.seen[a : a + c],
                       plan.rows)  # fmt: skip
        out.append(_blocked(q[a : a + c], keys, values, part, scale, cap))
    return torch.cat(out)


def _blocked(q: Tensor, keys: Tensor, values: Tensor, plan: KeyPlan, scale: float | None, cap: float | None) -> Tensor:
    P, H, hd = q.shape
    KVH = keys.shape[0]
    G = H // KVH
    B = plan.block
    if scale is None:
        scale = 1.0 / math.sqrt(hd)
    qf = q.float().view(P, KVH, G, hd).transpose(0, 1)  # (KVH, P, G, hd)
    # each row's own blocks, gathered in position order: (KVH, P, R, B, hd)
    R = plan.slots.shape[1] // B
    kr = keys[:, plan.slots].float().view(KVH, P, R, B, hd)
    vr = values[:, plan.slots].float().view(KVH, P, R, B, hd)
    qr = _pad_rows(qf, plan.rows, 2)[:, :, None].expand(-1, -1, R, -1, -1)  # (KVH, P, R, Gp, hd)
    sr = _cap(_mm(qr, kr.transpose(-1, -2)).mul_(scale), cap)  # (KVH, P, R, Gp, B)
    sr.masked_fill_(~plan.seen.view(1, P, R, 1, B), float("-inf"))
    top = sr.amax((2, 4))[..., :G]  # (KVH, P, G)
    ss = None
    if plan.shared:
        S = plan.shared
        ks = keys[:, : S * B].float().view(KVH, S, B, hd)
        vs = values[:, : S * B].float().view(KVH, S, B, hd)
        qs = _pad_rows(qf.reshape(KVH, P * G, hd), plan.rows, 1)  # (KVH, M, hd), rows (r, g)
        ss = _cap(_mm(qs[:, None].expand(-1, S, -1, -1), ks.transpose(-1, -2)).mul_(scale), cap)
        out_of_reach = ~plan.full.T[:, :, None].expand(-1, -1, G).reshape(S, P * G)  # (S, P*G)
        ss[:, :, : P * G].masked_fill_(out_of_reach[None, :, :, None], float("-inf"))
        top = torch.maximum(top, ss[:, :, : P * G].amax((1, 3)).view(KVH, P, G))
    # every row sees at least its own position, so ``top`` is finite
    # exp over whole padded tiles (a multiple of the thread count on a CPU: see Tiling), padding rows at 0
    er = torch.exp(sr - _pad_rows(top, plan.rows, 2)[:, :, None, :, None])  # (KVH, P, R, Gp, B)
    lr = er[..., :G, :].sum(-1)  # (KVH, P, R, G)
    orr = _mm(er, vr)[..., :G, :]  # (KVH, P, R, G, hd)
    l_parts = [lr.permute(0, 1, 3, 2)]  # (KVH, P, G, R)
    o_parts = [orr.permute(0, 1, 3, 2, 4)]  # (KVH, P, G, R, hd)
    if ss is not None:
        S = plan.shared
        topm = _pad_rows(top.reshape(KVH, P * G), plan.rows, 1)  # (KVH, M)
        es = torch.exp(ss - topm[:, None, :, None])  # (KVH, S, M, B)
        ls = es.sum(-1)[:, :, : P * G].view(KVH, S, P, G).permute(0, 2, 3, 1)  # (KVH, P, G, S)
        os_ = _mm(es, vs)[:, :, : P * G].view(KVH, S, P, G, hd).permute(0, 2, 3, 1, 4)
        l_parts.insert(0, ls)
        o_parts.insert(0, os_)
    # blocks in position order: the shared ones, then the row's own (a row's own first block follows its last
    # shared one it sees; shared blocks it does not see hold exact zeros)
    denom = _fold(torch.cat(l_parts, dim=-1), -1)  # (KVH, P, G)
    num = _fold(torch.cat(o_parts, dim=-2), -2)  # (KVH, P, G, hd)
    out = num / denom[..., None]
    return out.transpose(0, 1).reshape(P, H * hd).to(q.dtype)


@dataclass(frozen=True)
class RowKeys:
    """Each row's visible slots in position order, all rows' lists end to end (made once a pass, used by every
    layer of :func:`native`)."""

    idx: Tensor  # (N,) int64 slots
    start: Tensor  # (P + 1,) int64: row r's slots are idx[start[r]:start[r + 1]]


def row_keys(mask: Tensor, positions: Tensor, padded: int, window: int | None = None) -> RowKeys:
    """The :class:`RowKeys` of ``mask`` (T, L) bool and ``positions`` (T,) for a pass padded to ``padded`` rows
    (padding rows see slot 0). A row sees one slot per position 0..positions[r] in increasing slot order (causal
    prefill, a tree's ancestry), so its visible slots in slot order are in position order. ``window``: only the
    row's latest ``window`` positions (a sliding layer)."""
    T, L = mask.shape
    m = torch.zeros(padded, L, dtype=torch.bool)
    m[:T] = mask.cpu()
    m[T:, 0] = True
    if window is not None:
        pos = torch.zeros(padded, dtype=torch.long)
        pos[:T] = positions.cpu()
        m &= m.cumsum(1) - 1 > pos[:, None] - window
    start = torch.zeros(padded + 1, dtype=torch.long)
    torch.cumsum(m.sum(1), 0, out=start[1:])
    return RowKeys(m.nonzero()[:, 1].contiguous(), start)


NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # the caches :func:`native` reads


def native_ready(device: torch.device, dtype: torch.dtype) -> bool:
    """Do a model's shape-invariant passes on ``device`` in ``dtype`` run :func:`native` (a CPU, an fp32 or bf16
    cache, and the C kernels built here) rather than :func:`blocked`?"""
    if device.type != "cpu" or dtype not in NATIVE_DTYPES:
        return False
    from specexec.formats import native as kernels

    return kernels.available() is None


def native(q: Tensor, keys: Tensor, values: Tensor, rows: RowKeys, scale: float | None = None,
           cap: float | None = None) -> Tensor:  # fmt: skip
    """Shape-invariant attention on a CPU by the package's C kernel (``attn.c``, :mod:`specexec.formats.native`):
    every (row, head) is one thread's fixed sequence of fp32 operations over the row's keys in position order, so
    a row gets the same bits in any pass. q (P, H, hd); keys/values (KVH, slots, hd) fp32 or bf16, rows and heads
    contiguous; ``scale`` default 1/sqrt(hd), ``cap``: tanh soft-capping -> (P, H*hd) in q's dtype."""
    from specexec.formats import native as kernels

    P, H, hd = q.shape
    KVH = keys.shape[0]
    assert keys.dtype in NATIVE_DTYPES and values.dtype == keys.dtype and keys.stride() == values.stride()
    assert keys.stride(2) == 1 and keys.stride(1) == hd
    qf = q.float().contiguous()
    out = torch.empty(P, H, hd)
    kernels.kernel().attn_rows(
        qf.data_ptr(), P, H, KVH, hd, keys.data_ptr(), values.data_ptr(), int(keys.dtype == torch.bfloat16),
        keys.stride(0), rows.idx.data_ptr(), rows.start.data_ptr(), 1.0 / math.sqrt(hd) if scale is None else scale,
        0.0 if cap is None else cap, out.data_ptr(),
    )  # fmt: skip
    return out.view(P, H * hd).to(q.dtype)
