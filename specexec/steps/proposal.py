"""The proposer protocol, the step context it gets and the proposal it returns (see :mod:`specexec.propose`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from specexec.config import SamplingConfig
from specexec.steps.record import PLAIN, Arm
from specexec.steps.rules import ChainStop, GrowCost, Trim
from specexec.steps.tree import Tree

RULES = ("tree", "chain")


class Grammar(Protocol):
    """What a proposer asks of a constrained generation's grammar
    (:class:`specexec.decoding.constraint.GrammarState`, at the state after the committed sequence)."""

    def mask_logits(self, logits: Tensor, paths: Sequence[Sequence[int]]) -> Tensor:
        """``logits`` (R, V') with the tokens the grammar forbids after ``paths[r]`` set to -inf."""
        ...

    def forced(self, limit: int, path: Sequence[int] = ()) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after ``path``."""
        ...


@dataclass
class StepContext:
    """What a proposer may use for one step (set by the decode loop from the budget policy's choices)."""

    samp: SamplingConfig
    gen: torch.Generator | None  # the generation's generator (chain sampling draws from it); None when greedy
    arm: Arm  # what to propose (the policy's choice): its kind and size (tree proposers: nodes; chain: gamma)
    # the early stop: a GrowCost for a tree, a ChainStop for a chain (None: grow the whole budget)
    cost: GrowCost | ChainStop | None = None
    trim: Trim | None = None  # which of a "tree"-rule proposal's nodes are worth verifying (None: all of them)
    logprobs: Callable[[Tensor], Tensor] | None = None  # logits (T, V) -> draft log-probs under ``samp``
    seed: int | None = None  # sampling: the key of the tree walk's noise (sampling.gumbels); None when greedy
    # chain proposers: verify by the tree walk also when sampling, the draft's tokens being coupled draws (drawn
    # with the walk's own noise, sampling.coupled_choice) instead of x ~ q under the chain rule
    walk: bool = False
    # a constrained generation's grammar, at the state after ``seq`` (the sequence ``propose`` gets): a draft masks
    # its logits with ``constraint.mask_logits`` at every node it expands, so it proposes only allowed tokens
    constraint: Grammar | None = None


@dataclass
class Proposal:
    """One step's candidates: a tree rooted at the pending token and the acceptance rule it needs.

    ``rule`` is ``"tree"`` (exact tree walk; any tree, greedy or sampled) or ``"chain"`` (speculative sampling
    along node 1..gamma of a chain, with ``q`` (gamma, Vq) the draft distributions the tokens were drawn from).
    """

    tree: Tree
    rule: str = "tree"
    q: Tensor | None = None
    passes: int = 0  # draft forwards spent on this proposal
    beams: list[int] = field(default_factory=list)  # tokens per draft pass
    stopped_early: bool = False  # tree growth ended by the early-stop rule
    arm: Arm = PLAIN  # what the policy asked for
    source: str = ""  # which proposer made it (its commit tells its own proposals from delegated ones)
    merged_at: int = 0  # nodes [merged_at, size) are prompt-lookup (n-gram) nodes, not the draft's; 0: none
    trimmed: int = 0  # nodes :meth:`trim` dropped as not worth their verification time
    catch_up_s: float = 0.0  # of the proposing seconds, a lagging draft's separate catch-up pass (DraftModel.catch_up)
    # after verification, for a proposer that reads it (heads): the last accepted node's final hidden state (D,)
    hidden: Tensor | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown acceptance rule {self.rule!r}")
        if (self.rule == "chain") != (self.q is not None):
            raise ValueError("the chain rule needs the draft distributions q, and only it uses them")

    @property
    def size(self) -> int:
        """Proposed (non-root) tokens."""
        return self.tree.size - 1

    def prune(self, keep: list[bool]) -> None:
        """Drop the nodes where ``keep`` is False (an ancestor-closed subtree stays: a dropped node's subtree is
        dropped with it by the caller's rule): a constrained generation's nodes the grammar forbids."""
        if all(keep):
            return
        mask = torch.tensor(keep, device=self.tree.device)
        if self.merged_at:
            self.merged_at = int(mask[: self.merged_at].sum())
        self.tree.keep(mask)
        if self.merged_at >= self.tree.size:
            self.merged_at = 0
        if self.q is not None:  # a chain keeps a prefix of its tokens, and their distributions
            self.q = self.q[: self.tree.size - 1]
            if self.q.shape[0] == 0:
                self.q, self.rule = None, "tree"

    def trim(self, rule: Trim | None) -> None:
        """Keep the ``rule.keep`` most probable nodes (an ancestor-closed subtree) of a "tree"-rule proposal; the
        chain rule's ``q`` must stay aligned with its nodes, so a chain is never trimmed."""
        n = self.size
        if rule is None or self.rule != "tree" or n <= 0:
            return
        k = rule.keep(self.tree.n_logp[1:])
        if k >= n:
            return
        keep = self.tree.top_k_mask(k)
        if self.merged_at:  # the n-gram nodes still follow the draft's, in the same order
            self.merged_at = int(keep[: self.merged_at].sum())
        self.tree.keep(keep)
        if self.merged_at >= self.tree.size:
            self.merged_at = 0
        self.trimmed = n - k


class Proposer(Protocol):
    """A source of proposals; the decode loop calls exactly these. It owns its state (draft KV cache, n-gram index),
    commits it itself, and applies the step's rules (``ctx.cost``, ``ctx.trim``) to its own proposal."""

    name: str  # the proposal ``source`` of its own proposals

    def begin(self, seq: list[int]) -> None:
        """A generation starts from committed ``seq`` (its last token pending): keep what is cached of it."""

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        """Candidates below the pending token ``seq[-1]``, sized by ``ctx.arm`` and trimmed by ``ctx.trim``."""

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        """After acceptance: ``path`` (tree nodes, root first) was accepted and ``seq`` is the committed sequence now
        (the caller may have cut the path at EOS or the token limit; ``seq[-1]`` is the new pending token)."""
