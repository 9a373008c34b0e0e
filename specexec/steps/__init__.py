"""The step types every layer above shares: the proposal tree (:mod:`~specexec.steps.tree`), the sampling
functions (:mod:`~specexec.steps.sampling`), the rules a proposer weighs (:mod:`~specexec.steps.rules`), the arm a
policy chooses and the step record (:mod:`~specexec.steps.record`), and the proposer protocol with its step context
and proposal (:mod:`~specexec.steps.proposal`). It imports nothing of the proposers, the policies or the decode
loop, so all three can import it."""
