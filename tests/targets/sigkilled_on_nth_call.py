"""The built-in routine, except that TP rank 1's process kills itself with SIGKILL on its CALL-th
call of the kernel: a signal, as a stray kill would send, and the re-run of the case that died passes
(its fresh process counts its calls from zero), so only the deaths recurring across the run's cases
tell it from a stray kill."""
import os
import signal

from harness.targets import fused
from tests.targets.exits_on_nth_call import kernel_dying_on

CALL = 5
get_log_probs_and_entropy = fused.get_log_probs_and_entropy
calculate_log_probs_and_entropy = kernel_dying_on(CALL, lambda: os.kill(os.getpid(), signal.SIGKILL))
