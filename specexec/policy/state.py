"""What an engine's budget policies measure and learn, kept across its generations: the one object an engine holds
for them (:class:`PolicyState`). The engine owns the models and times their passes; this keeps the results."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specexec import quiet
from specexec.config import TreeConfig
from specexec.policy.cache import costs_key, drifted, load_costs, save_costs
from specexec.policy.config import DEFAULT, PolicyConfig
from specexec.policy.cpu import AdaptiveBudget, VerifyCosts
from specexec.policy.curves import VERIFY_SIZES
from specexec.policy.fixed import FixedBudget, StepCosts
from specexec.policy.gpu import AutoBudget
from specexec.steps.record import PLAIN, Arm

log = logging.getLogger(__name__)


@dataclass
class _Learnt:
    """One pass mode's measurements and rates (shape-invariant passes cost differently from the fastest ones)."""

    costs: StepCosts  # fixed budgets' and the CPU policy's step costs, for the draft's early stop
    auto: AutoBudget | None = None  # the GPU's cost model, once measured (per cache size)
    # the CPU's measured-rate policies by (method, arms): their rates outlive a generation (the next chat turn
    # starts from what was learnt)
    adaptive: dict[tuple[str, tuple[Arm, ...]], AdaptiveBudget] = field(default_factory=dict)
    verify: VerifyCosts | None = None  # the target's verification seconds by size, shared by those policies


class PolicyState:
    """The policies' measurements for one engine. ``costs_dir``: where measured pass costs are cached per machine
    and model pair (None: not cached); cached costs are reused at the next start and measured again when the
    steps' costs drift from them."""

    def __init__(self, costs_dir: Path | None = None, config: PolicyConfig = DEFAULT) -> None:
        self.costs_dir, self.config = costs_dir, config
        self._learnt = _Learnt(StepCosts(config=config))
        self._by_mode: dict[bool, _Learnt] = {}  # the other pass mode's (switch_mode)
        self._draft_costs: VerifyCosts | None = None  # the draft's pass seconds by rows (the CPU policy's catch-ups)

    # -- arms -------------------------------------------------------------------------------------------------
    def cpu_arms(self, max_budget: int) -> tuple[Arm, ...]:
        """A draft's arms on a CPU: plain decoding, the chains, the trees up to ``max_budget``."""
        c = self.config
        chains = (Arm("chain", g) for g in c.cpu_chains)
        return (PLAIN, *chains, *(Arm("tree", b) for b in c.cpu_trees if b <= max_budget))

    def longest_chain(self) -> int:
        """The longest chain arm (the chain proposer's cap)."""
        return max(self.config.cpu_chains)

    def head_arms(self, max_budget: int) -> tuple[Arm, ...]:
        """``--draft heads``' arms: plain decoding (or prompt lookup's trie) and head trees up to ``max_budget``."""
        return tuple(Arm("heads", b) if b else PLAIN for b in self.config.head_trees if b <= max_budget)

    def ngram_arms(self, max_nodes: int) -> tuple[Arm, ...]:
        """Prompt lookup's arms: plain decoding and tries of a few sizes up to ``max_nodes``."""
        sizes = sorted({0, *(b for b in self.config.ngram_tries if b <= max_nodes), max_nodes})
        return tuple(Arm.nodes(b) for b in sizes)

    # -- policies ---------------------------------------------------------------------------------------------
    def fixed(self, arm: Arm) -> FixedBudget:
        """Always ``arm``, with step costs of its own."""
        return FixedBudget(arm, StepCosts(config=self.config))

    def fixed_tree(self, arm: Arm, max_depth: int) -> FixedBudget:
        """Always the draft tree ``arm``, with the step costs the engine's steps measured so far."""
        return FixedBudget(arm, self._learnt.costs, max_depth)

    def adaptive(
        self,
        method: str,
        arms: Sequence[Arm],
        max_depth: int,
        heads_depth: int,
        verify_prior: Callable[[], dict[int, float]],
        draft_prior: Callable[[], dict[int, float]] | None = None,
    ) -> tuple[AdaptiveBudget, float | None]:
        """The measured-rate policy for these arms (kept across generations; each starts a new text), and the
        seconds spent building it (None: it was kept). Its verification-cost curve (shared by all such policies)
        starts from ``verify_prior()``, a short measurement; with ``draft_prior``, so does its curve of the draft's
        pass costs (what a lagging draft's catch-up costs)."""
        learnt = self._learnt
        key = (method, tuple(sorted(set(arms))))
        spent = None
        if key not in learnt.adaptive:
            tc = time.perf_counter()
            if learnt.verify is None:
                learnt.verify = VerifyCosts(verify_prior(), config=self.config)
            if draft_prior is not None and self._draft_costs is None:
                self._draft_costs = VerifyCosts(draft_prior(), config=self.config)
            spent = time.perf_counter() - tc
            learnt.adaptive[key] = AdaptiveBudget(
                tuple(arms),
                config=self.config,
                costs=learnt.costs,
                max_depth=max_depth,
                verify=learnt.verify,
                draft=self._draft_costs if draft_prior is not None else None,
                heads_depth=heads_depth,
            )
        policy = learnt.adaptive[key]
        policy.new_text()
        return policy, spent

    def pass_prior(
        self, name: str, key: Sequence[object], measure: Callable[[Sequence[int]], dict[int, float]]
    ) -> dict[int, float]:
        """A model's pass seconds at the sizes :data:`~specexec.policy.curves.VERIFY_SIZES` (``measure(sizes)``),
        once per machine and model (``key``), cached under ``costs_dir`` as ``name``."""
        path = None
        if self.costs_dir:
            path = self.costs_dir / f"{name}-{costs_key(*key, name, VERIFY_SIZES)}.json"
            cached = load_costs(path)
            if cached is not None:
                return cached[0]
        with quiet.watch() as seen:
            points = measure(VERIFY_SIZES)
        if path is not None:
            save_costs(path, points, {}, seen.load)
        rounded = {k: round(v, 4) for k, v in points.items()}
        log.info("%s pass cost by size: %s", "draft" if name == "draft" else "target", rounded)
        return points

    def cost_model(
        self,
        tree: TreeConfig,
        key: Sequence[object],
        measure: Callable[[], tuple[dict[int, float], dict[int, float]]],
    ) -> tuple[AutoBudget, float | None]:
        """The GPU's cost model for ``tree`` and the seconds spent building it (None: it was kept). Its pass costs
        are read from the cache (``key``: the machine, model pair and cache size) or ``measure()``d, once per cache
        size; costs that drifted from the steps' are measured again."""
        learnt = self._learnt
        path = self.costs_dir / f"{costs_key(*key)}.json" if self.costs_dir else None
        if learnt.auto is not None and drifted(learnt.auto):
            log.info("step costs drifted from the start-up measurement: measuring again")
            learnt.auto = None
            if path is not None:
                path.unlink(missing_ok=True)
        if learnt.auto is not None:
            return learnt.auto, None
        tc = time.perf_counter()
        cached = load_costs(path) if path is not None else None
        if cached is None:
            with quiet.watch() as seen:
                cached = measure()
            if path is not None:
                save_costs(path, *cached, seen.load)
        learnt.auto = AutoBudget(
            target_s=cached[0],
            draft_pass_s=cached[1],
            max_beams=tree.max_beams,
            max_depth=tree.max_depth,
            max_budget=tree.max_budget,
            budget=tree.budget,
            config=self.config,
        )
        return learnt.auto, time.perf_counter() - tc

    # -- what invalidates them ----------------------------------------------------------------------------------
    def forget_cost_model(self) -> None:
        """The caches were reallocated: the cost model's pass costs are measured again (a pass over a bigger cache
        may cost more)."""
        self._learnt.auto = None

    def switch_mode(self, on: bool) -> None:
        """The target's passes switch to shape-invariant (``on``) or fastest kernels: measurements and rates are
        kept per mode, so switching back finds them again."""
        self._by_mode[not on] = self._learnt
        self._learnt = self._by_mode.pop(on) if on in self._by_mode else _Learnt(StepCosts(config=self.config))
