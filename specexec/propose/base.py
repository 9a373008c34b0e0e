"""The proposer protocol and the proposal it returns (see :mod:`specexec.propose`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from specexec.config import SamplingConfig
from specexec.decoding.tree import Tree

RULES = ("tree", "chain")


@dataclass
class StepContext:
    """What a proposer may use for one step (set by the decode loop)."""

    samp: SamplingConfig
    gen: torch.Generator | None  # the generation's generator (chain sampling draws from it); None when greedy
    budget: int  # tree proposers: nodes to propose (the policy's choice); chain: gamma
    cost: object | None = None  # tree proposers: a GrowCost for the early stop, or None
    logprobs: Callable[[Tensor], Tensor] | None = None  # logits (T, V) -> draft log-probs under ``samp``
    seed: int | None = None  # sampling: the key of the tree walk's noise (sampling.gumbels); None when greedy
    # chain proposers: verify by the tree walk also when sampling, the draft's tokens being coupled draws (drawn
    # with the walk's own noise, sampling.coupled_choice) instead of x ~ q under the chain rule
    walk: bool = False


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
    budget: int = 0  # the size the policy asked for
    source: str = ""  # which proposer made it (stats)
    merged_at: int = 0  # nodes [merged_at, size) are prompt-lookup (n-gram) nodes, not the draft's; 0: none

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown acceptance rule {self.rule!r}")
        if (self.rule == "chain") != (self.q is not None):
            raise ValueError("the chain rule needs the draft distributions q, and only it uses them")

    @property
    def size(self) -> int:
        """Proposed (non-root) tokens."""
        return self.tree.size - 1


class Proposer(Protocol):
    """A source of proposals. It owns its state (draft KV cache, n-gram index) and commits it itself."""

    name: str

    def begin(self, seq: list[int]) -> None:
        """A generation starts from committed ``seq`` (its last token pending): keep what is cached of it."""

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        """Candidates below the pending token ``seq[-1]``."""

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        """After acceptance: ``path`` (tree nodes, root first) was accepted and ``seq`` is the committed sequence now
        (the caller may have cut the path at EOS or the token limit; ``seq[-1]`` is the new pending token)."""

    def reset(self) -> None:
        """Forget all cached state."""

    def max_nodes(self) -> int:
        """The most proposed tokens one proposal can hold (sizes the target's tree room)."""
