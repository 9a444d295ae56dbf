"""The built-in routine, except that TP rank 1's process kills itself with SIGKILL on its CALL-th
call of the kernel: a signal, as a stray kill would send, and the re-run of the case that died passes
(its fresh process counts its calls from zero), so only the deaths recurring across the run's cases
tell it from a stray kill."""
import os
import signal

import torch.distributed as dist

from harness.targets import fused

CALL = 5
get_log_probs_and_entropy = fused.get_log_probs_and_entropy
_calls = 0


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    global _calls
    _calls += 1
    if _calls == CALL and dist.get_rank(tp_group) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return fused.calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy, chunk_size,
                                                 log_prob_keep_mask, with_entropy_grad)
