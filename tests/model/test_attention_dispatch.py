"""Kernel launches of the CUDA invariant path's attention at 70B head shapes (64 heads, 8 KV heads, head dim 128),
counted on the CPU: the layer's attention runs on meta tensors through the same function a CUDA pass calls
(:func:`specexec.model.tree_attn.tree_attention`), its torch operations counted by a dispatch mode and its Triton
launches by a stand-in for :func:`specexec.model.tree_attn.launch`.

For the record, today's fallback ``blocked`` (``specexec.model.attention``, counted the same way by
:func:`count_blocked`, attention row tile 16) grows with both: torch operations a layer (views included, so an
upper bound on its launches) at 1 / 64 / 256 / 1,024 / 2,048 tree rows are 191 / 182 / 563 / 1,869 / 3,539 over a
1k prefix and 383 / 1,513 / 6,049 / 24,193 / 48,385 over a 4k prefix. The tree kernel: 3 everywhere (an empty
output, a view, one launch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specexec.model import tree_attn
from specexec.model.attention import KeyPlan, blocked, plan_keys
from specexec.model.tree_attn import TreeKeys, tree_attention, tree_keys

H, KVH, HD = 64, 8, 128


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def tree(rows: int, prefix: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random draft tree of ``rows`` nodes over a committed ``prefix``: (mask (rows, prefix + rows), positions);
    node i sits at slot prefix + i, its parent an earlier node (or the prefix's last token)."""
    gen = torch.Generator().manual_seed(seed)
    parent = [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, rows)]
    mask = torch.zeros(rows, prefix + rows, dtype=torch.bool)
    mask[:, :prefix] = True
    depth = [0] * rows
    for i in range(rows):
        mask[i, prefix + i] = True
        if parent[i] >= 0:
            mask[i, prefix : prefix + rows] |= mask[parent[i], prefix : prefix + rows]
            depth[i] = depth[parent[i]] + 1
    return mask, prefix + torch.tensor(depth)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def count_tree(rows: int, prefix: int) -> int:
    """Torch operations plus Triton launches of one layer's tree attention."""
    mask, pos = tree(rows, prefix)
    keys = tree_keys(mask, pos, rows)
    mk = TreeKeys(_meta(keys.idx), _meta(keys.start), _meta(keys.first))
    q = torch.empty(rows, H, HD, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(KVH, prefix + rows, HD, dtype=torch.bfloat16, device="meta")
    launches = []
    real = tree_attn.launch
    tree_attn.launch = lambda grid, *a, **k: launches.append(grid)  # type: ignore[assignment]
    try:
        with Count() as c:
            out = tree_attention(q, cache, cache, mk)
    finally:
        tree_attn.launch = real  # type: ignore[assignment]
    assert out.shape == (rows, H * HD) and launches == [(rows, H)]
    return c.ops + len(launches)


def count_blocked(rows: int, prefix: int, block: int = 64, attn_rows: int = 16) -> int:
    """Torch operations of one layer's ``blocked`` attention on its CUDA code path (meta tensors take it)."""
    mask, pos = tree(rows, prefix)
    p = plan_keys(mask, pos, rows, block, attn_rows)
    mp = KeyPlan(p.block, p.shared, _meta(p.full), _meta(p.slots), _meta(p.seen), p.rows)
    q = torch.empty(rows, H, HD, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(KVH, prefix + rows, HD, dtype=torch.bfloat16, device="meta")
    with Count() as c:
        blocked(q, cache, cache, mp)
    return c.ops


@pytest.mark.parametrize("prefix", [1024, 4096])
def test_tree_attention_launches_do_not_grow(prefix: int) -> None:
    counts = {rows: count_tree(rows, prefix) for rows in (1, 64, 256, 1024, 2048)}
    assert len(set(counts.values())) == 1 and counts[1] <= 4, counts


def test_blocked_is_counted_the_same_way() -> None:
    """The counter sees the fallback's operations (and that they grow with the tree, which the tree kernel's
    do not): a small case, the full table in the module docstring."""
    assert count_blocked(256, 1024) > count_blocked(64, 1024) > count_tree(64, 1024)
