"""The draft tree as flat tensors, and nothing else (it never calls a model).

Node 0 is the root: the pending token (the last emitted one, not yet in either model's cache). Every other node
is a draft-proposed token. Invariants, kept by every operation here: parents precede children
(``parent[i] < i``), ``depth[i] = depth[parent[i]] + 1``, and ``logp`` (cumulative draft log-probability of the
path root→i) never increases along a path. The ancestry mask (``anc[i, j]`` True iff j is i or an ancestor of i)
is derived from the parent pointers on demand by pointer chasing, O(N x depth), rather than stored: growth
compacts the tree after every level, and moving an (N, N) matrix each time would dominate the draft time.

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
        self.tokens[0] = root_token
        self.size = 1

    @classmethod
    def over(cls, tokens: Tensor, parents: Tensor, depth: Tensor, logp: Tensor, draft_slot: Tensor) -> Tree:
        """A tree over existing arrays (equal lengths: the capacity), holding node 0 only; the arrays are not reset
        (captured growth keeps its arrays at fixed addresses across steps, :mod:`specexec.propose.captured`)."""
        t = cls.__new__(cls)
        t.capacity, t.device = tokens.shape[0], tokens.device
        t.tokens, t.parents, t.depth, t.logp, t.draft_slot = tokens, parents, depth, logp, draft_slot
        t.size = 1
        return t

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

    def max_depth(self) -> int:
        return int(self.depth[: self.size].max())

    def ancestry(self, rows: Tensor | None = None, cols: int | None = None) -> Tensor:
        """(R, cols) bool: ``anc[r, j]`` True iff node j is row r's node or one of its ancestors.

        ``rows`` defaults to all live nodes, ``cols`` to the live size.
        """
        rows = torch.arange(self.size, device=self.device) if rows is None else rows
        cols = self.size if cols is None else cols
        anc = torch.zeros(rows.shape[0], cols, dtype=torch.bool, device=self.device)
        r = torch.arange(rows.shape[0], device=self.device)
        cur = rows.clone()
        for _ in range(int(self.depth[rows].max()) + 1 if rows.numel() else 0):
            ok = cur >= 0  # a row past its root writes its own column again (set on the first round): no host wait
            anc[r, torch.where(ok, cur, rows)] = True
            cur = torch.where(ok, self.parents[cur.clamp(min=0)], cur)
        return anc

    def ancestor_slots(self, rows: Tensor, length: int, base: Tensor | None = None) -> Tensor:
        """(R, length) bool over draft-cache slots: True at ``draft_slot`` of each row's ancestors (and itself).

        Every ancestor of a node being expanded has been expanded, so all of them have slots.
        """
        mask = torch.zeros(rows.shape[0], length, dtype=torch.bool, device=self.device) if base is None else base
        r = torch.arange(rows.shape[0], device=self.device)
        cur = rows.clone()
        own = self.draft_slot[rows]
        for _ in range(int(self.depth[rows].max()) + 1):
            ok = cur >= 0  # a row past its root writes its own slot again (set on the first round): no host wait
            mask[r, torch.where(ok, self.draft_slot[cur.clamp(min=0)], own)] = True
            cur = torch.where(ok, self.parents[cur.clamp(min=0)], cur)
        return mask

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
        self.size += k
        return idx

    def append(self, parents: list[int], tokens: list[int], depths: list[int], logp: list[float]) -> None:
        """Append nodes given as lists (parents may be nodes of the same call: each must precede its children).

        ``depths`` must equal parent depth + 1 (the caller built them, e.g. as a trie); draft slots stay -1.
        """
        k = len(tokens)
        if self.size + k > self.capacity:
            raise RuntimeError(f"tree capacity {self.capacity} exceeded ({self.size} + {k})")
        s, e = self.size, self.size + k
        self.tokens[s:e] = torch.tensor(tokens, dtype=torch.long)
        self.parents[s:e] = torch.tensor(parents, dtype=torch.long)
        self.depth[s:e] = torch.tensor(depths, dtype=torch.long)
        self.logp[s:e] = torch.tensor(logp, dtype=torch.float32)
        self.size = e

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
        self.size = m

    def select(self, keep: Tensor, capacity: int) -> tuple[Tree, Tensor]:
        """A new tree of ``capacity`` holding the nodes where ``keep`` (N,) is True (closed under ancestry, root
        kept), and the (M,) indices of those nodes here. This tree is unchanged."""
        idx = keep[: self.size].nonzero().squeeze(1)
        m = idx.shape[0]
        if capacity < m:
            raise RuntimeError(f"{m} nodes do not fit capacity {capacity}")
        out = Tree(int(self.tokens[0]), capacity, self.device)
        remap = torch.full((self.size,), -1, dtype=torch.long, device=self.device)
        remap[idx] = torch.arange(m, device=self.device)
        par = self.parents[idx]
        out.parents[:m] = torch.where(par >= 0, remap[par.clamp(min=0)], par)
        out.tokens[:m] = self.tokens[idx]
        out.depth[:m] = self.depth[idx]
        out.logp[:m] = self.logp[idx]
        out.draft_slot[:m] = self.draft_slot[idx]
        out.size = m
        return out, idx

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
        path = [node]
        while path[-1] > 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]

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
        assert torch.equal(expect, self.ancestry()), "ancestry mask differs from parent pointers"
