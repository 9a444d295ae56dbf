"""The built-in routine, except that TP rank 1's process exits with status 0 on its CALL-th call of
the kernel (`os._exit(0)`, as a library's exit would). The re-run of the case that died passes (its
fresh process counts its calls from zero), yet the death is the routine's: exit code 0 is no
signal's, and the deaths recur across the run's cases. `kernel_dying_on` is shared with
`sigkilled_on_nth_call.py`, which dies of a signal instead."""
import os
from typing import Callable

import torch.distributed as dist

from harness.targets import fused

CALL = 4
get_log_probs_and_entropy = fused.get_log_probs_and_entropy


def kernel_dying_on(call: int, die: Callable[[], None]) -> Callable:
    """The built-in kernel, whose TP rank 1 calls `die` on its process's `call`-th call."""
    calls = 0

    def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                        log_prob_keep_mask=None, with_entropy_grad=True):
        nonlocal calls
        calls += 1
        if calls == call and dist.get_rank(tp_group) == 1:
            die()
        return fused.calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy, chunk_size,
                                                     log_prob_keep_mask, with_entropy_grad)
    return calculate_log_probs_and_entropy


calculate_log_probs_and_entropy = kernel_dying_on(CALL, lambda: os._exit(0))
