"""What a call leaves behind in the trainer's process: a family of its own, since a leaked default
dtype or grad mode is no arithmetic defect, however many arithmetic checks its consequences fail."""
from __future__ import annotations

from harness.checks import CALL, Evidence, check


@check("side-effects", evidence=CALL, needs=None)
def side_effects(ev: Evidence) -> list[str]:
    """Every call and backward leaves the process-global state a trainer relies on as it found it:
    default dtype and device, grad, inference and anomaly mode, thread counts, deterministic
    algorithms, matmul precision, the CPU (on CUDA also the device) RNG state, the current CUDA
    device and stream, the torch.distributed default group. A change the routine undoes itself
    (RNG use inside torch.random.fork_rng) is none; the harness restores any other before the next
    step, so no other check sees its consequences."""
    return [f"{r.name}: {p}" for r in ev.ranks for p in r.obs.side_effects]
