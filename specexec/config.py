"""Frozen, validated configuration dataclasses for decoding (passed around instead of ``**kwargs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specexec.errors import ConfigError, check_finite, setting

if TYPE_CHECKING:
    import torch

METHODS = ("ar", "chain", "specexec", "ngram", "heads")
NEEDS_DRAFT = ("chain", "specexec")  # methods that need a draft model


def check_method(method: str) -> None:
    """Raise :class:`ConfigError` unless ``method`` is one of :data:`METHODS`."""
    if method not in METHODS:
        raise ConfigError(
            "method",
            method,
            f"must be one of {', '.join(METHODS)}",
            f"unknown {setting('method')} {method!r}; choose one of {', '.join(METHODS)}",
        )


GROW_MODES = ("auto", "dynamic", "ahead", "captured")
# prompt-lookup nodes merged into each draft tree by default (TreeConfig.ngram None): on a GPU, whatever the budget
# (a streamed verifier checks a few dozen more tokens at almost no cost, a resident one at little, and they cost no
# draft pass; nothing is merged where the lookup finds no earlier occurrence); on a CPU, where every verified token
# costs time, only into the auto policy's trees, whose measured arms decide when they pay
FORCED_IN_CHAIN = 32  # tokens a grammar may force into one draft chain (the step's cache room holds them)
NGRAM_NODES_GPU = 64
NGRAM_NODES_CPU = 32
# tokens a GPU tree takes from each earlier occurrence (a CPU's: NGramConfig's 16): where a passage repeats verbatim
# (an edit, a quote) a streamed step then accepts up to this many tokens instead of 16 (measured on an H200 with
# prompts that hold their own continuation: 16.0 tokens a step at 16, 32.0 at 32; docs/BENCHMARKS.md)
NGRAM_LEN_GPU = 32


@dataclass(frozen=True)
class TreeConfig:
    """SpecExec draft-tree growth (arXiv 2406.02532, Alg. 1 in batched best-first form).

    The defaults are the command line's (``--budget auto``): the budget policy chooses each step's tree size, starting
    at 64, up to ``max_budget``. :meth:`fixed` makes a config whose every tree holds ``budget`` draft tokens."""

    # draft tokens in the tree the target verifies (the root, i.e. the pending token, is extra); with ``auto`` the
    # first step's size
    budget: int = 64
    max_beams: int = 128  # nodes expanded by one draft pass
    max_branch: int = 32  # children proposed per expanded node
    max_depth: int = 32  # the deepest node of a tree, so at most this many draft passes a step
    verify_chunk: int = 4096  # the target verifies at most this many tree tokens per forward (chunking)
    auto: bool = True  # choose the budget per step for the best expected tokens/s (``budget`` is the start)
    max_budget: int = 2048  # upper limit of the automatic choice
    # stop growing when one more draft pass is expected to cost more than it adds; None: on for a CPU draft and for
    # fixed-width growth on a GPU, off for the dynamic growth on a GPU, where it cuts acceptance (measured; see
    # docs/BENCHMARKS.md)
    early_stop: bool | None = None
    # how a level of growth runs (the trees are the same; see specexec/propose/fixed_grow.py), a research setting:
    # "dynamic" sizes each draft pass by the open nodes and compacts the tree every level (several host reads a
    # level; the CPU's choice); "ahead" runs fixed-width levels and reads each level's count a level late, so the
    # host never waits for the pass it just launched (one pass over padding rows at the end); "captured" runs each
    # level as two CUDA graphs (choose the beams; read their count; expand them and run the draft pass), greedy steps
    # only (specexec/propose/captured.py). "auto": for a CUDA draft "captured" at a fixed budget where a level can
    # replay as a graph, "ahead" with the automatic budget or with levels wider than the draft's graphed passes;
    # else "dynamic": on a GPU captured levels take the least draft time for the same trees, then ahead, then dynamic
    # (measured; see docs/BENCHMARKS.md).
    grow: str = "auto"
    # prompt-lookup continuations (specexec/propose/ngram.py) merged into every draft tree as extra branches: at most
    # this many nodes; 0: none; None: the device's default (NGRAM_NODES_GPU on a GPU, NGRAM_NODES_CPU in a CPU's
    # auto-budget trees, none in a CPU's fixed-budget ones). Never changes the output
    ngram: int | None = None

    def __post_init__(self) -> None:
        if self.grow not in GROW_MODES:
            raise ConfigError("TreeConfig.grow", self.grow, f"must be one of {', '.join(GROW_MODES)}")
        for name in ("budget", "max_beams", "max_branch", "max_depth", "verify_chunk", "max_budget"):
            if getattr(self, name) < 1:
                raise ConfigError(f"TreeConfig.{name}", getattr(self, name), "must be >= 1")
        if self.ngram is not None and not 0 <= self.ngram <= 1024:
            raise ConfigError("TreeConfig.ngram", self.ngram, "must be in 0..1024 (0: no n-gram branches)")
        for name in ("budget", "max_budget"):
            if getattr(self, name) > 65536:
                raise ConfigError(f"TreeConfig.{name}", getattr(self, name), "is absurdly large (max 65536)")

    @classmethod
    def fixed(cls, budget: int, **fields: Any) -> TreeConfig:
        """A config whose every tree holds ``budget`` draft tokens (``auto`` off); ``fields``: other settings."""
        return cls(budget=budget, auto=False, **fields)

    def ngram_nodes(self, device: torch.device) -> int:
        """The most n-gram nodes merged into a tree grown for a target on ``device`` (``ngram`` None resolved)."""
        if self.ngram is not None:
            return self.ngram
        if device.type != "cpu":
            return NGRAM_NODES_GPU
        return NGRAM_NODES_CPU if self.auto else 0

    def grow_mode(self, device: torch.device, graphs: bool = True) -> str:
        """The growth mode for a draft on ``device`` ("auto" resolved); ``graphs``: whether the draft's levels of
        ``max_beams`` rows can replay as CUDA graphs (graphed static passes that wide; uncaptured "captured" levels
        would only add a host wait a level to "ahead" ones)."""
        if self.grow != "auto":
            return self.grow
        if device.type != "cuda":
            return "dynamic"
        return "ahead" if self.auto or not graphs else "captured"

    def stops_early(self, device: torch.device) -> bool:
        """Whether the cost-based early stop is on for a draft on ``device`` (``early_stop`` None resolved)."""
        if self.early_stop is not None:
            return self.early_stop
        return device.type == "cpu" or self.grow_mode(device) != "dynamic"

    @property
    def largest(self) -> int:
        """The largest tree this config can grow (sizes the caches)."""
        return max(self.budget, self.max_budget) if self.auto else self.budget


@dataclass(frozen=True)
class ChainConfig:
    """Chain speculative decoding (Leviathan et al. 2023; Chen et al. 2023)."""

    gamma: int = 4  # draft tokens per step

    def __post_init__(self) -> None:
        if not 1 <= self.gamma <= 256:
            raise ConfigError("ChainConfig.gamma", self.gamma, "must be in 1..256")


@dataclass(frozen=True)
class SamplingConfig:
    """Token choice. temperature 0 means greedy (argmax); top_k 0 and top_p 1 and min_p 0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            check_finite(f"SamplingConfig.{name}", getattr(self, name))
        if self.temperature < 0:
            raise ConfigError("SamplingConfig.temperature", self.temperature, "must be >= 0")
        if self.top_k < 0:
            raise ConfigError("SamplingConfig.top_k", self.top_k, "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("SamplingConfig.top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise ConfigError("SamplingConfig.min_p", self.min_p, "must be in [0, 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
