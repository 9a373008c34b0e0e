"""What a step was asked for and what it did: the :class:`Arm` a policy chooses, the step's one record
(:class:`StepInfo`) and a generation's counts (:class:`Stats`)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol

ArmKind = Literal["plain", "chain", "tree", "heads"]
_ORDER = {"chain": 0, "plain": 1, "tree": 2, "heads": 3}


@functools.total_ordering
@dataclass(frozen=True)
class Arm:
    """A step's proposal size, as a policy chooses it and a proposer reads it.

    ``plain`` (size 0): no proposal of the proposer's own (plain decoding, or prompt lookup's trie alone);
    ``tree``: ``size`` nodes of the proposer's own kind (a draft tree, prompt lookup's trie, the chain method's
    chain of ``size``, a fixed head tree); ``chain``: a draft chain of ``size`` tokens from a tree proposer that
    offers chains (the CPU policy's chain arms); ``heads``: a head tree of ``size`` nodes (the CPU policy's head
    arms, told apart from plain decoding). Arms sort chains longest first, then plain, trees and head trees by size.
    """

    kind: ArmKind
    size: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _ORDER:
            raise ValueError(f"unknown arm kind {self.kind!r}")
        if self.kind == "plain" and self.size != 0:
            raise ValueError(f"a plain arm has size 0, not {self.size}")
        if self.kind != "plain" and self.size < 1:
            raise ValueError(f"a {self.kind} arm has size >= 1, not {self.size}")

    @staticmethod
    def nodes(n: int) -> Arm:
        """A proposal of ``n`` nodes of the proposer's own kind (0: plain)."""
        return PLAIN if n == 0 else Arm("tree", n)

    @staticmethod
    def parse(label: str | int) -> Arm:
        """The arm a :attr:`label` (or :meth:`json`) names: ``0``, ``-3``, ``8``, ``heads:4``."""
        text = str(label).strip()
        if text.startswith("heads:"):
            return Arm("heads", int(text[len("heads:") :]))
        n = int(text)
        return Arm("chain", -n) if n < 0 else Arm.nodes(n)

    @property
    def label(self) -> str:
        """As users read it: ``0`` (plain), ``-3`` (a chain of 3), ``8`` (a tree of 8), ``heads:4``."""
        return f"heads:{self.size}" if self.kind == "heads" else str(self.json())

    def json(self) -> int | str:
        """In JSON: the number (-g for a chain of g), or ``"heads:b"`` for a head tree."""
        if self.kind == "heads":
            return f"heads:{self.size}"
        return -self.size if self.kind == "chain" else self.size

    def _key(self) -> tuple[int, int]:
        return (_ORDER[self.kind], -self.size if self.kind == "chain" else self.size)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Arm):
            return NotImplemented
        return self._key() < other._key()

    def __str__(self) -> str:
        return self.label


PLAIN = Arm("plain")


class Logprob(Protocol):
    """A committed token's target log-prob (:class:`specexec.decoding.constraint.TokenLogprob`)."""

    @property
    def token(self) -> int: ...

    @property
    def logprob(self) -> float: ...


@dataclass
class Stats:
    """What one generation did. Seconds are wall-clock; tokens_per_s counts decoding only (prefill excluded)."""

    method: str
    steps: int = 0  # target verification passes (prefill excluded)
    new_tokens: int = 0
    tokens_per_step: float = 0.0
    tokens_per_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens actually processed (the rest came from the prefix cache)
    restored_tokens: int = 0  # of the rest: those restored from a snapshot of another conversation's prefix
    costs_s: float = 0.0  # auto budget: one-time cost measurement (excluded from wall_s)
    budget: Arm | None = None  # specexec: the budget (auto: the one chosen most often)
    # specexec: arm -> steps (in JSON by label: "-3" a chain of 3, "8" a tree of 8, "heads:4" a head tree)
    budgets: dict[Arm, int] = field(default_factory=dict)
    budget_auto: bool = False
    gamma: int | None = None
    mean_tree_size: float = 0.0
    draft_passes: int = 0
    early_stops: int = 0  # specexec: trees whose growth the early-stop rule ended before max_depth
    trimmed: int = 0  # proposal nodes dropped as not worth their verification time (auto, CPU)
    ngram_tokens: int = 0  # emitted tokens that came from merged prompt-lookup nodes (the draft's tree lacked them)
    forced_tokens: int = 0  # constrained: emitted tokens the grammar forced (proposed without a draft pass)
    accepted_hist: dict[int, int] = field(default_factory=dict)  # tokens committed per step -> count
    tree_shapes: list[list[int]] = field(default_factory=list)  # tokens per draft pass, per step
    finish_reason: str = ""  # "stop" (EOS or a stop string), "length" (max_new_tokens), "cancelled"

    def add(self, step: StepInfo) -> None:
        """Count one step (the decode loop's only way of changing the counts)."""
        self.steps += 1
        self.new_tokens += len(step.tokens)
        self.tokens_per_step = self.new_tokens / self.steps
        self.draft_s += step.draft_s
        self.target_s += step.target_s
        self.draft_passes += step.passes
        self.early_stops += step.stopped_early
        self.trimmed += step.trimmed
        self.ngram_tokens += step.ngram_tokens
        self.forced_tokens += step.forced
        self.mean_tree_size += (step.tree_size - self.mean_tree_size) / self.steps
        self.budgets[step.arm] = self.budgets.get(step.arm, 0) + 1
        self.budget = max(self.budgets, key=self.budgets.__getitem__)  # the most chosen (ties: the first)
        self.accepted_hist[len(step.tokens)] = self.accepted_hist.get(len(step.tokens), 0) + 1
        if step.beams:
            self.tree_shapes.append(list(step.beams))

    def to_json(self, shapes: bool = False) -> dict[str, Any]:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}  # asdict would turn arms to dicts
        d["accepted_hist"] = {str(k): v for k, v in sorted(self.accepted_hist.items())}
        d["budgets"] = {k.label: v for k, v in sorted(self.budgets.items())}
        d["budget"] = self.budget.json() if self.budget is not None else None
        if not shapes:
            d.pop("tree_shapes")
        return d


@dataclass(frozen=True)
class StepInfo:
    """One decode step, recorded once after both sides committed it: :meth:`Stats.add` counts it, the budget
    policy's ``update`` learns from it, the ``on_step`` hook sees it (before its tokens are yielded). Seconds as in
    :class:`Stats`: ``draft_s`` proposing, ``target_s`` the target's pass, acceptance and both commits."""

    arm: Arm  # the proposal size the policy chose
    tree_logp: Sequence[float]  # the proposal's non-root cumulative scores (log path probabilities)
    emitted: int  # tokens the step emitted (before any cut at EOS / the token limit)
    draft_s: float
    target_s: float
    passes: int  # draft passes
    catch_up_s: float = 0.0  # of draft_s, a lagging draft's catch-up over tokens committed without it
    size: int = 0  # tokens the target verified (the tree's nodes, root included; 0: unknown)
    index: int = 0  # 0-based step number (prefill excluded)
    tokens: tuple[int, ...] = ()  # tokens committed this step (cut at EOS / the token limit)
    beams: tuple[int, ...] = ()  # tokens per draft pass
    stopped_early: bool = False  # the early stop ended the proposal's growth
    trimmed: int = 0  # proposal nodes dropped as not worth their verification time
    ngram_tokens: int = 0  # committed tokens that came from merged prompt-lookup nodes
    forced: int = 0  # constrained: committed tokens the grammar forced (ahead of the proposal, no draft pass)
    logprobs: tuple[Logprob, ...] = ()  # the committed tokens' target log-probs, when asked for

    @property
    def tree_size(self) -> int:
        """Proposed tokens the target verified beside the root (:attr:`Stats.mean_tree_size`'s unit)."""
        return max(self.size - 1, 0)
