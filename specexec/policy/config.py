"""Every number the budget policies decide by, in one frozen config (:data:`DEFAULT`); a policy takes it as its
``config`` field, so a test or a study can run one with a modified copy (``dataclasses.replace(DEFAULT, ...)``).
The row sizes a machine is measured at are not here (:mod:`specexec.policy.curves`): they change what is known,
not what is decided."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    # -- arms: what the policies choose among ------------------------------------------------------------------
    # the GPU cost model's tree budgets (capped at the tree config's max_budget)
    gpu_grid: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    # the CPU policy's draft trees beside plain decoding: small, since a CPU's verification cost grows with rows
    cpu_trees: tuple[int, ...] = (4, 8)
    # the CPU policy's draft chains (each a cap: once costs are measured a chain stops at the first token not worth
    # its pass); the long cap pays where the text copies its context
    cpu_chains: tuple[int, ...] = (2, 3, 4, 6, 10)
    head_trees: tuple[int, ...] = (0, 1, 2, 4, 8, 16)  # --draft heads: the head trees chosen among (0: plain)
    ngram_tries: tuple[int, ...] = (4, 16, 64)  # --method ngram: trie sizes chosen among (with 0 and max_nodes)

    # -- shared by the policies -----------------------------------------------------------------------------------
    # every this many steps a policy explores: the GPU's tries the grid budget above the best once while no step has
    # measured it (the extrapolated curve and the passes prior can keep a flat verifier below its best budget), the
    # CPU's the arm explored longest ago (while its wait is over); the GPU's costs count as drifted only after this
    # many steps
    explore_every: int = 8
    # the EMA rate of every running measurement: the GPU's draft passes per tree, its measured/start-up time ratios,
    # a fixed budget's step costs, the emitted/predicted tokens ratio (the early stop's and trimming's correction),
    # and the CPU's arm rates, value of a second and verification seconds by size
    alpha: float = 0.3

    # -- the GPU's cost model (AutoBudget; ablations: python -m tests.decoding.gpu_sim --ablate) ------------------
    prior_slope: float = 1.2  # before any tree: E[emitted | b] = 1 + this * log2(1 + b)
    drift: float = 1.5  # step costs beyond this factor of the start-up measurement (either way): measure again

    # -- the CPU's measured-rate choice (AdaptiveBudget) ---------------------------------------------------------
    # a drafting arm leads only when its rate beats plain decoding's by this share: step times on a shared CPU
    # jitter by some percent, and a tie lost to that noise costs every step after it, while one kept at plain
    # decoding costs nothing (it also decides which arms could win at all, and so are tried)
    margin: float = 0.1
    # what an answer's bets (first tries, explorations, prompt-lookup bets; a draft's catch-up included) may lose,
    # as a share of the answer's expected time at plain decoding's rate: the floor (0.05 left no room for jitter)
    loss_share: float = 0.04


DEFAULT = PolicyConfig()
