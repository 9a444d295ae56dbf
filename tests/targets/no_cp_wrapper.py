"""A correct wrapper written without context parallelism, which does not declare it: at CP > 1 it
reads the CP rank's rows as if they were the whole sequence. What `crash` must then name (a raise
only at CP > 1, and the capability line that declares it) instead of a bare shape error."""
from __future__ import annotations

from harness.targets.declaration import Declaration
from harness.targets.fused import HARNESS as FUSED
from harness.targets.fused import FusedLogProbEntropy

HARNESS = Declaration(memory_budget=FUSED.memory_budget)


class _WithoutCP(FusedLogProbEntropy):
    def cp_info(self):
        return 1, 0, None  # never asks parallel_state: the sequence is taken to be whole


ROUTINE = _WithoutCP()
calculate_log_probs_and_entropy = ROUTINE.calculate_log_probs_and_entropy
get_log_probs_and_entropy = ROUTINE.get_log_probs_and_entropy
