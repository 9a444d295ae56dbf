"""The built-in routine, except that the first call on TP rank 1 in a driver's session kills its own
process with SIGHUP, as a signal from outside the routine would (a terminal's hangup, another
user's `kill`): its case runs again in a fresh pool, where it passes, so that death is an
infrastructure event of the run, not a `crash`. A marker file beside the driver's temporary files
says it happened (once per driver process).

A rank takes its driver's disposition of SIGHUP with the fork, and a session started under `nohup`
ignores it: there the signal would do nothing, the case would pass and no death would be seen. So
the rank puts back SIGHUP's default action, to die of it, before it sends it."""
import os
import signal
import tempfile
from pathlib import Path

import torch.distributed as dist

from harness.targets import fused

get_log_probs_and_entropy = fused.get_log_probs_and_entropy


def marker(driver_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"harness-dies-once-{driver_pid}"


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    if dist.get_rank(tp_group) == 1 and not marker(os.getppid()).exists():
        marker(os.getppid()).touch()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGHUP)
    return fused.calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy, chunk_size,
                                                 log_prob_keep_mask, with_entropy_grad)
