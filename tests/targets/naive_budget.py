"""The naive all-gather routine held to the built-in routine's memory budget: a routine that
breaks a declared budget (it saves its full-vocab log-softmax and, for the entropy, more)."""
from harness.targets.fused import HARNESS_MEMORY_BUDGET as _FUSED_BUDGET
from harness.targets.naive import calculate_log_probs_and_entropy, get_log_probs_and_entropy  # noqa: F401

HARNESS_MEMORY_BUDGET = dict(_FUSED_BUDGET)
