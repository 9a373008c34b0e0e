"""Target side: ONE target pass over the whole draft tree, then acceptance along it.

The root (pending token) goes to target slot n, tree node i to slot n+i; each row attends to the committed
prefix [0, n) and to its own ancestors (the tree's ancestry mask). Huge trees are verified in chunks of
``chunk`` rows in index order; parents precede children, so every chunk finds its ancestors already cached.

Acceptance walks from the root: at each visited node the target makes its choice (argmax when greedy, a draw
from p(.|node) when sampling); if a child carries that token the walk moves there, else the choice is emitted
as the bonus token and the step ends. Each emitted token is the target's own choice given the emitted prefix,
so the output is exactly the target's greedy decoding, or (sampling) exactly the target's distribution, for any
tree. Choices at nodes the walk never visits are never used, so they can be drawn up front for all nodes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specexec.model.kv_cache import KVCache
from specexec.model.transformer import Transformer
from specexec.steps.tree import Tree


def score_tree(
    target: Transformer, cache: KVCache, tree: Tree, n: int, chunk: int, hidden: list[Tensor] | None = None
) -> Tensor:
    """Target logits (N, V) fp32 for every tree node; writes node i's KV at slot n+i. ``hidden``: append the
    nodes' final hidden states (N, D), chunk by chunk."""
    N = tree.size
    dev = target.device
    out = []
    anc = tree.ancestry()  # (N, N)
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        rows = torch.arange(s, e, device=dev)
        mask = torch.zeros(e - s, n + e, dtype=torch.bool, device=dev)  # (rows, L)
        mask[:, :n] = True
        mask[:, n:] = anc[s:e, :e]
        pos = n + tree.depth[s:e]
        out.append(target.forward(tree.tokens[s:e], pos, n + rows, mask, cache, hidden=hidden))
    return torch.cat(out) if len(out) > 1 else out[0]


def walk(tree: Tree, choice: Tensor) -> tuple[list[int], list[int]]:
    """Follow the target's ``choice`` (N,) from the root. Returns (path nodes root first, emitted tokens).

    Emitted = the tokens of the accepted non-root nodes plus the choice at the last node (the bonus token).
    Siblings carry distinct tokens (top-k proposals), so each node has at most one matching child.
    """
    N = tree.size
    tokens = tree.n_tokens.tolist()
    parents = tree.n_parents.tolist()
    ch = choice.tolist()
    match: dict[int, int] = {}
    for i in range(1, N):
        if tokens[i] == ch[parents[i]]:
            match[parents[i]] = i
    path = [0]
    while path[-1] in match:
        path.append(match[path[-1]])
    emitted = [tokens[i] for i in path[1:]] + [ch[path[-1]]]
    return path, emitted


def commit_target(cache: KVCache, path: list[int], n: int) -> None:
    """Keep the accepted path's KV: node i was written at slot n+i; path[k] moves to slot n+k."""
    cache.compact(torch.tensor(path[1:], dtype=torch.long) + n, n + 1)
