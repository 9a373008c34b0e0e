"""The decode loop: one target pass verifies a proposal, exact acceptance, sampling, the budget policy."""
