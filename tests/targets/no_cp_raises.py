"""A correct wrapper written without context parallelism, which does not declare it, and which
raises when the logits' rows are not the whole packed sequence (as a wrapper checking its inputs
does): at CP > 1 it raises, at CP 1 it runs. `crash` must say so and show the capability line."""
from __future__ import annotations

from harness.targets.declaration import Declaration
from harness.targets.fused import HARNESS as FUSED
from harness.targets.fused import FusedLogProbEntropy

HARNESS = Declaration(memory_budget=FUSED.memory_budget)


class _WithoutCP(FusedLogProbEntropy):
    def cp_info(self):
        return 1, 0, None  # never asks parallel_state: the sequence is taken to be whole

    def get_log_probs_and_entropy(self, logits, *, total_lengths, **kwargs):
        logits.new_empty(sum(total_lengths), logits.shape[-1]).copy_(logits[0])  # rows of the whole sequence
        return super().get_log_probs_and_entropy(logits, total_lengths=total_lengths, **kwargs)


ROUTINE = _WithoutCP()
calculate_log_probs_and_entropy = ROUTINE.calculate_log_probs_and_entropy
get_log_probs_and_entropy = ROUTINE.get_log_probs_and_entropy
