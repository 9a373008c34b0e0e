"""Static, preallocated KV cache written by slot index (gpt-fast style).

One tensor each for keys and values, shape (layers, KVH, capacity, hd). A pass writes its keys/values at
explicit slots; attention reads slots [0, L) under an explicit mask, so tree nodes can sit in any slots.
After speculative acceptance the kept slots are gathered in place to the front (:meth:`compact`); the cache is
never rebuilt with ``cat``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: the cached positions of one that the other can keep."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class KVCache:
    """Keys/values for every layer. ``length`` is the number of committed (prefix) slots."""

    def __init__(
        self, num_layers: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_layers, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor, upto: int) -> tuple[Tensor, Tensor]:
        """Store k/v (T, KVH, hd) at ``slots`` (T,) of ``layer``; return that layer's (KVH, upto, hd) views."""
        self.k[layer][:, slots] = k.transpose(0, 1)
        self.v[layer][:, slots] = v.transpose(0, 1)
        return self.k[layer, :, :upto], self.v[layer, :, :upto]

    def compact(self, keep_slots: Tensor, dest_start: int) -> None:
        """Gather ``keep_slots`` (n,) into slots [dest_start, dest_start+n) of every layer, in place.

        Used after acceptance: the accepted tree nodes' entries move right behind the prefix. Advanced indexing
        materialises the gathered block first, so overlapping source/destination ranges are safe.
        """
        n = keep_slots.shape[0]
        if n == 0:
            return
        idx = keep_slots.to(self.k.device)
        self.k[:, :, dest_start : dest_start + n] = self.k[:, :, idx]
        self.v[:, :, dest_start : dest_start + n] = self.v[:, :, idx]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
