"""Ranks that die: a SIGKILL (the kernel's OOM killer), an exit with status 0 mid-case (a library
calling sys.exit), a native crash, a failed host allocation. Each happens on the last rank of the
world, in the forward; the run goes on, the dead rank is a `crash` finding that names it, and no
process outlives the run (the pool starts new ranks)."""
from __future__ import annotations

import ctypes
import os
import signal
import warnings

import torch.distributed as dist

from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant


def _last_rank() -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == dist.get_world_size() - 1


class _FaultInForward(Fused):
    def fault(self) -> None:
        raise NotImplementedError

    def forward(self, ctx, logits, *args):
        if _last_rank() and logits.shape[0] > 0:
            self.fault()
        return super().forward(ctx, logits, *args)


@mutant("rank-sigkilled", "the last rank killed by SIGKILL in the forward (as the OOM killer does)", ("crash",))
class RankSigkilled(_FaultInForward):
    def fault(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


@mutant("rank-exits-zero", "the last rank exits with status 0 in the forward (a library's sys.exit / os._exit)",
        ("crash",))
class RankExitsZero(_FaultInForward):
    def fault(self) -> None:
        os._exit(0)


@mutant("rank-segfaults", "a native crash on the last rank in the forward (a read through a null pointer)",
        ("crash",))
class RankSegfaults(_FaultInForward):
    def fault(self) -> None:
        ctypes.string_at(0)


@mutant("host-memory-error", "a host allocation that fails on the last rank in the forward (MemoryError)",
        ("crash",))
class HostMemoryError(_FaultInForward):
    def fault(self) -> None:
        bytearray(1 << 62)  # no machine has it: malloc refuses at once, nothing is touched


class RoutineDeprecation(FutureWarning):
    """The warning of `warns-under-error-filters`, a category of its own so that the filter below
    reaches no other routine of the process."""



@mutant("warns-under-error-filters", "a deprecated call's FutureWarning on every call, under a configuration that "
        "makes warnings errors (NeMo-RL's torch.distributed.nn.functional.all_reduce under torch 2.13)", ("warning",))
class WarnsUnderErrorFilters(Fused):
    def __init__(self) -> None:
        # The user's warnings-as-errors configuration (`-W error`, pytest's `filterwarnings = error`),
        # narrowed to this mutant's own warning, in force wherever the target is loaded (a filter set
        # at the module's import would not reach a worker forked after a test's `catch_warnings`
        # undid it).
        super().__init__()
        warnings.filterwarnings("error", category=RoutineDeprecation)

    def forward(self, ctx, logits, *args):
        warnings.warn("this collective is deprecated", RoutineDeprecation, stacklevel=1)
        return super().forward(ctx, logits, *args)
