"""The draft tree as flat tensors, and nothing else (it never calls a model).

Node 0 is the root: the pending token (the last emitted one, not yet in either model's cache). Every other node
is a draft-proposed token. Invariants, kept by every operation here: parents precede children
(``parent[i] < i``), ``anc[i, j]`` is True iff j is i or an ancestor of i, ``depth[i] = depth[parent[i]] + 1``,
and ``logp`` (cumulative draft log-probability of the path root→i) never increases along a path.

Shapes: N = live nodes (``self.size``), C = capacity.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Tree:
    """A draft tree stored in preallocated tensors of capacity C."""

    def __init__(self, root_token: int, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)  # (C,)
        self.parents = torch.full((capacity,), -1, dtype=torch.long, device=device)  # (C,)
        self.depth = torch.zeros(capacity, dtype=torch.long, device=device)  # (C,) root = 0
        self.logp = torch.zeros(capacity, dtype=torch.float32, device=device)  # (C,) cumulative draft log-prob
        self.draft_slot = torch.full((capacity,), -1, dtype=torch.long, device=device)  # (C,) -1 = not expanded
        self.anc = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)  # (C, C) ancestry (incl. self)
        self.tokens[0] = root_token
        self.anc[0, 0] = True
        self.size = 1

    # -- views of the live part ---------------------------------------------------------------------------------
    @property
    def n_tokens(self) -> Tensor:
        return self.tokens[: self.size]

    @property
    def n_parents(self) -> Tensor:
        return self.parents[: self.size]

    @property
    def n_depth(self) -> Tensor:
        return self.depth[: self.size]

    @property
    def n_logp(self) -> Tensor:
        return self.logp[: self.size]

    @property
    def n_anc(self) -> Tensor:
        return self.anc[: self.size, : self.size]

    # -- growth -------------------------------------------------------------------------------------------------
    def add(self, parents: Tensor, tokens: Tensor, logp: Tensor) -> Tensor:
        """Append children (k,) of existing ``parents`` with cumulative ``logp``; returns their indices (k,)."""
        k = parents.shape[0]
        if self.size + k > self.capacity:
            raise RuntimeError(f"tree capacity {self.capacity} exceeded ({self.size} + {k})")
        idx = torch.arange(self.size, self.size + k, device=self.device)
        self.tokens[idx] = tokens
        self.parents[idx] = parents
        self.depth[idx] = self.depth[parents] + 1
        self.logp[idx] = logp
        self.anc[idx] = self.anc[parents]
        self.anc[idx, idx] = True
        self.size += k
        return idx

    def keep(self, keep: Tensor) -> None:
        """Compact to the nodes where ``keep`` (N,) is True; must be closed under ancestry and keep the root."""
        n = self.size
        idx = keep[:n].nonzero().squeeze(1)  # (M,) ascending: parents still precede children
        m = idx.shape[0]
        remap = torch.full((n,), -1, dtype=torch.long, device=self.device)
        remap[idx] = torch.arange(m, device=self.device)
        parents = self.parents[idx]
        self.parents[:m] = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        for t in (self.tokens, self.depth, self.logp, self.draft_slot):
            t[:m] = t[idx].clone()
        block = self.anc[idx][:, idx]
        self.anc[:m, :m] = block
        self.anc[m:n] = False
        self.anc[:m, m:n] = False
        self.size = m

    def top_k_mask(self, k: int) -> Tensor:
        """(N,) bool: the root plus the ``k`` best non-root nodes by cumulative log-prob.

        A stable sort over nodes in index order breaks ties towards earlier nodes; since a child's logp never
        exceeds its parent's and parents come first, the kept set is closed under ancestry (a subtree).
        """
        n = self.size
        keep = torch.zeros(n, dtype=torch.bool, device=self.device)
        keep[0] = True
        if n - 1 <= k:
            keep[:] = True
            return keep
        order = torch.sort(-self.logp[1:n], stable=True).indices[:k] + 1
        keep[order] = True
        return keep

    def kth_logp(self, k: int) -> float:
        """The k-th best non-root cumulative log-prob, or -inf when the tree has fewer than k such nodes."""
        if self.size - 1 < k:
            return float("-inf")
        return float(torch.topk(self.logp[1 : self.size], k).values[-1])

    def path_to(self, node: int) -> list[int]:
        """Node indices root→node (inclusive)."""
        return self.anc[node, : self.size].nonzero().squeeze(1).tolist()

    def check(self) -> None:
        """Assert the invariants (for tests)."""
        n = self.size
        par = self.parents[:n]
        assert par[0] == -1
        assert bool((par[1:] < torch.arange(1, n, device=self.device)).all()), "parent after child"
        assert bool((par[1:] >= 0).all()), "orphan node"
        assert bool((self.depth[1:n] == self.depth[par[1:]] + 1).all()), "depth mismatch"
        assert bool((self.logp[1:n] <= self.logp[par[1:]] + 1e-6).all()), "logp increases along a path"
        expect = torch.zeros(n, n, dtype=torch.bool, device=self.device)
        for i in range(n):
            j = i
            while j >= 0:
                expect[i, j] = True
                j = int(par[j]) if j > 0 else -1
        assert torch.equal(expect, self.anc[:n, :n]), "ancestry mask differs from parent pointers"
