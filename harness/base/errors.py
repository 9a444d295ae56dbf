"""Every error the harness raises on purpose derives from `HarnessError`.

A routine under test failing is data (a finding), never one of these. These are the run itself
going wrong: a target that cannot be loaded, a bad option, a pool that cannot start. `cli.main`
turns any of them into one line on stderr and exit code 2; the pytest plugin into a usage error.
"""
from __future__ import annotations


class HarnessError(Exception):
    """Base of the harness's own errors: the message is the whole story, no traceback needed."""


class UsageError(HarnessError):
    """An option, a case spec or a file given by the user is not usable."""


class TargetError(HarnessError):
    """The target cannot be checked at all (import failure, missing functions, wrong signature)."""


class PoolStartError(HarnessError):
    """A worker pool could not start (process group, megatron-core parallel_state)."""


class LaunchError(PoolStartError):
    """The torchrun-launched world cannot serve the run asked for (wrong --tp, no CUDA)."""


class InstructionCountError(HarnessError):
    """callgrind could not count the instructions of a benchmark case."""
