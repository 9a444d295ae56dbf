"""A wrapper that implements context parallelism (it asks megatron-core's parallel_state for its CP
size, as slime's does) and whose CP path raises: `crash` must call it a defect of its CP path, never
offer the capability line that would hide it."""
from __future__ import annotations

from megatron.core import parallel_state as mpu

from harness.targets.declaration import Declaration
from harness.targets.fused import HARNESS as FUSED
from harness.targets.fused import FusedLogProbEntropy

HARNESS = Declaration(memory_budget=FUSED.memory_budget)


class _CPPathRaises(FusedLogProbEntropy):
    def get_log_probs_and_entropy(self, logits, **kwargs):
        if mpu.get_context_parallel_world_size() > 1:
            raise RuntimeError("the CP pieces' all-gather has the wrong size")
        return super().get_log_probs_and_entropy(logits, **kwargs)


ROUTINE = _CPPathRaises()
calculate_log_probs_and_entropy = ROUTINE.calculate_log_probs_and_entropy
get_log_probs_and_entropy = ROUTINE.get_log_probs_and_entropy
