"""The naive all-gather routine held to the built-in routine's memory budget: a routine that
breaks a declared budget (it saves its full-vocab log-softmax and, for the entropy, more)."""
from harness.targets import fused
from harness.targets.naive import calculate_log_probs_and_entropy, get_log_probs_and_entropy  # noqa: F401

# In the loose-global form that `HARNESS = Declaration(...)` replaces, on purpose: a target written that
# way still loads, with the same budget (`harness.targets.declaration`).
HARNESS_MEMORY_BUDGET = dict(fused.HARNESS.memory_budget)
