"""Draft-free proposals by prompt lookup (n-gram matching; Saxena 2023, "prompt lookup decoding").

The last k committed tokens (k = max_ngram down to min_ngram) are looked up among all earlier positions of the
sequence (the prompt, earlier turns and the text generated so far); the tokens that followed each earlier
occurrence are candidate continuations. Unlike HF's prompt lookup, which verifies one continuation, all distinct
continuations (longest match first, then the most recent) are merged into ONE trie rooted at the pending token, so
the target's single pass checks them together and the exact tree walk keeps the longest one it agrees with.

The index (n-gram → positions that followed it) is updated incrementally in ``commit``: work per step is
proportional to the new tokens, not the sequence length.

Scores: node logp = depth * log(a) + log(share), with ``share`` the fraction of the matches' weight that passes
through the node and ``a`` the measured per-token acceptance of earlier n-gram proposals (decayed counts), so
1 + sum(exp(logp)) estimates the tokens a step emits from what was measured (the budget policy uses it). A text
starts from what lookup measured on the engine's earlier texts (:class:`LookupRecord`), not from a constant: where
the target seldom repeats its context (code written from a docstring), a new answer's first lookups verify a row
or two, not a trie of eight that misses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specexec.steps.proposal import Proposal, StepContext
from specexec.steps.tree import Tree

PRIOR_ACC = 0.6  # per-token acceptance of n-gram tokens before any evidence (an engine's first text)
PRIOR_TRIALS = 2.0  # what a text's prior weighs against its own evidence, in tried tokens
ACC_DECAY = 0.9  # per proposal, the weight older counts keep (the text changes)
TEXT_DECAY = 0.5  # per new text, the weight the earlier texts' counts keep in its prior (texts differ)


@dataclass
class LookupRecord:
    """What lookup proposals measured on an engine's earlier texts: decayed counts of accepted and tried tokens.
    A new text's prior is their acceptance beside :data:`PRIOR_ACC` worth :data:`PRIOR_TRIALS` tries; each new
    text halves the counts, so texts that try nothing (the prior fell under what a row costs) drift back towards
    :data:`PRIOR_ACC` and lookup is tried again."""

    hits: float = 0.0
    trials: float = 0.0

    def prior(self) -> float:
        return (self.hits + PRIOR_ACC * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS)

    def new_text(self) -> float:
        """A new text starts: the earlier texts' counts decay; returns its prior."""
        self.hits *= TEXT_DECAY
        self.trials *= TEXT_DECAY
        return self.prior()

    def add(self, accepted: int, trials: int) -> None:
        """One proposal's tokens: older counts keep :data:`ACC_DECAY` of their weight."""
        self.hits = ACC_DECAY * self.hits + accepted
        self.trials = ACC_DECAY * self.trials + trials


@dataclass(frozen=True)
class NGramConfig:
    """Prompt-lookup proposal sizes."""

    max_ngram: int = 4  # longest suffix looked up
    min_ngram: int = 2  # shortest suffix looked up (1 matches too often to pay on a compute-bound verifier)
    max_len: int = 16  # tokens taken from each earlier occurrence
    max_matches: int = 8  # distinct continuations merged per step
    max_nodes: int = 64  # most trie nodes per proposal

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram <= 16:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({self.min_ngram}) <= max ({self.max_ngram}) <= 16")
        for name in ("max_len", "max_matches", "max_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ngram {name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


class NGramDraft:
    """Prompt-lookup proposals; ``ctx.arm.size`` caps the trie's nodes (0 = the root alone)."""

    name = "ngram"

    def __init__(
        self, device: torch.device, cfg: NGramConfig | None = None, record: LookupRecord | None = None
    ) -> None:
        """``record``: the engine's earlier texts' counts (this text's prior; its own counts join them)."""
        self.device = device
        self.cfg = cfg or NGramConfig()
        self._seq: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        # P(the target accepts the next n-gram token | it accepted the ones before): this text's decayed counts of
        # accepted and tried tokens beside its prior worth PRIOR_TRIALS tries, so a text whose matches miss (code's
        # frequent two-token repeats) stops paying for their rows within a few steps, not a few dozen
        self._text = LookupRecord()
        self._record = record
        self._prior = record.new_text() if record is not None else PRIOR_ACC

    @property
    def acc(self) -> float:
        return (self._text.hits + self._prior * PRIOR_TRIALS) / (self._text.trials + PRIOR_TRIALS)

    def max_nodes(self) -> int:
        return self.cfg.max_nodes

    # -- index ------------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._seq, self._index = [], {}

    def begin(self, seq: list[int]) -> None:
        self._sync(seq)

    def _sync(self, seq: list[int]) -> None:
        """Index every position j in [1, len(seq)) by the n-grams ending at j-1 (continuation starts at j)."""
        old = self._seq
        if len(old) > len(seq) or seq[: len(old)] != old:
            self.reset()
            old = self._seq
        lo, hi = self.cfg.min_ngram, self.cfg.max_ngram
        for j in range(max(len(old), 1), len(seq)):
            for k in range(lo, min(hi, j) + 1):
                self._index.setdefault(tuple(seq[j - k : j]), []).append(j)
        self._seq = list(seq)

    def continuations(self, seq: list[int], limit: int | None = None) -> list[tuple[int, list[int]]]:
        """Distinct continuations of the sequence's suffix: (matched n-gram length, tokens), best first."""
        self._sync(seq)
        cfg = self.cfg
        out: list[tuple[int, list[int]]] = []
        seen: set[tuple[int, ...]] = set()
        L = len(seq)
        limit = cfg.max_matches if limit is None else limit
        for k in range(min(cfg.max_ngram, L), cfg.min_ngram - 1, -1):
            for j in reversed(self._index.get(tuple(seq[L - k :]), ())):
                cont = tuple(seq[j : j + cfg.max_len])
                if not cont or any(s[: len(cont)] == cont for s in seen):
                    continue
                seen.add(cont)
                out.append((k, list(cont)))
                if len(out) >= limit:
                    return out
        return out

    # -- proposals --------------------------------------------------------------------------------------------------
    def _trie(
        self,
        conts: list[tuple[int, list[int]]],
        existing: dict[tuple[int, int], int],
        base_depth: list[int],
        base_logp: list[float],
        budget: int,
    ) -> tuple[list[int], list[int], list[int], list[float]]:
        """Merge continuations into a trie below node 0 of a tree whose first ``len(base_depth)`` nodes exist
        (``existing``: (parent, token) -> node). Returns the new nodes as (parents, tokens, depths, logps); their
        indices start at ``first = len(base_depth)``. A new node's logp never exceeds its parent's."""
        first = len(base_depth)
        children = dict(existing)
        weights = [float(k) * 0.8**r for r, (k, _) in enumerate(conts)]
        total = sum(weights) or 1.0
        la = math.log(max(self.acc, 1e-3))
        mass: dict[int, float] = {}
        parents: list[int] = []
        tokens: list[int] = []
        depths: list[int] = []
        for w, (_, cont) in zip(weights, conts):
            node, path = 0, []
            for t in cont:
                nxt = children.get((node, t))
                if nxt is None:
                    if len(tokens) >= budget:
                        break
                    nxt = first + len(tokens)
                    children[(node, t)] = nxt
                    parents.append(node)
                    tokens.append(t)
                    depths.append((depths[node - first] if node >= first else base_depth[node]) + 1)
                node = nxt
                path.append(node)
            for v in path:
                mass[v] = mass.get(v, 0.0) + w / total
        logp: list[float] = []
        for i, (p, dep) in enumerate(zip(parents, depths)):
            node = first + i
            own = dep * la + math.log(max(mass.get(node, 1e-6), 1e-6))
            logp.append(min(own, base_logp[p] if p < first else logp[p - first]))
        return parents, tokens, depths, logp

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        tree = Tree(seq[-1], ctx.arm.size + 1, self.device)
        if ctx.arm.size > 0:
            conts = self.continuations(seq)
            if conts:
                parents, tokens, depths, logp = self._trie(conts, {}, [0], [0.0], ctx.arm.size)
                tree.append(parents, tokens, depths, logp)
        prop = Proposal(tree, arm=ctx.arm, source=self.name, merged_at=1 if tree.size > 1 else 0)
        prop.trim(ctx.trim)
        return prop

    def merge_into(self, tree: Tree, seq: list[int], conts: list[tuple[int, list[int]]] | None = None) -> int:
        """Add the continuations' nodes the tree lacks (draft slot -1: never run through a draft). Returns how many.
        ``conts``: the continuations of ``seq`` when the caller has them already."""
        conts = self.continuations(seq) if conts is None else conts
        if not conts:
            return 0
        n = tree.size
        toks, pars, depth = torch.stack((tree.n_tokens, tree.n_parents, tree.n_depth)).tolist()  # one host read
        existing = {(pars[i], toks[i]): i for i in range(1, n)}
        room = min(self.cfg.max_nodes, tree.capacity - n)
        parents, tokens, depths, logp = self._trie(conts, existing, depth, tree.n_logp.tolist(), room)
        if tokens:
            tree.append(parents, tokens, depths, logp)
        return len(tokens)

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        self._sync(seq)
        if proposal.source != self.name or proposal.size == 0:
            return
        # per-token acceptance of this proposal: accepted nodes vs the first rejection on the deepest line
        accepted = len(path) - 1
        deepest = int(proposal.tree.n_depth.max())
        trials = accepted + (1 if accepted < deepest else 0)
        if trials:
            self._text.add(accepted, trials)
            if self._record is not None:
                self._record.add(accepted, trials)
