"""A correct routine whose wrapper makes the logits contiguous before its kernel runs, as slime's
does (`logits.contiguous()`): on transposed logits that is a float32 copy, the wrapper's memory
allowance (`harness.checks.memory.allowance`), which `memory-chunk-passthrough` must grant as
`memory-budget` does."""
from __future__ import annotations

from harness.targets.declaration import Declaration
from harness.targets.fused import HARNESS as FUSED
from harness.targets.fused import FusedLogProbEntropy

HARNESS = Declaration(memory_budget=FUSED.memory_budget)


class _ContiguousWrapper(FusedLogProbEntropy):
    def get_log_probs_and_entropy(self, logits, **kwargs):
        return super().get_log_probs_and_entropy(logits.contiguous(), **kwargs)


ROUTINE = _ContiguousWrapper()
calculate_log_probs_and_entropy = ROUTINE.calculate_log_probs_and_entropy
get_log_probs_and_entropy = ROUTINE.get_log_probs_and_entropy
