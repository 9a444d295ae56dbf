"""What the driver process holds once, for all its pools: the live pools (closed at exit), the
parking thread that stops idle gloo pools, the driver's own intra-op thread count while CPU ranks
run, and the signal that interrupted the run (Ctrl-C or SIGTERM).

A gloo pool is stopped (SIGSTOP) once idle (`IDLE_PARK_S`) and continued when the next job is sent:
see `harness.driver.pool`.
"""
from __future__ import annotations

import atexit
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from harness.driver.pool import WorkerPool


# A gloo pool is stopped once it has had no job for this long: not after every job, since stopping
# and continuing costs 0.5 ms a job at TP 2 and 1.2 ms at TP 4, and a case's runs come back to back.
IDLE_PARK_S = 0.2


_LIVE: set[WorkerPool] = set()
# Parking and waking happen under one lock, so a pool is never stopped between a job's wake and its send.
_PARKING = threading.Lock()
_parker: threading.Thread | None = None  # the parking thread, while a gloo pool lives


def _park_idle_pools() -> None:
    """One thread for every pool (not a timer per job: a case's runs would start a thread each):
    every half IDLE_PARK_S it stops the gloo pools that have had no job for IDLE_PARK_S, and it
    ends once no pool is left."""
    global _parker
    while True:
        time.sleep(IDLE_PARK_S / 2)
        with _PARKING:
            pools = list(_LIVE)  # one C call: atomic while close() discards from another thread
            if not pools:
                _parker = None
                return
            now = time.monotonic()
            for pool in pools:
                if pool.idle_since is not None and now - pool.idle_since >= IDLE_PARK_S and pool.procs:
                    pool.park()


_DRIVER_THREADS: int | None = None  # the driver's intra-op threads before its first CPU pool started


def _leave_cores_to_ranks() -> None:
    """While CPU ranks run, the driver computes (oracle, checks, unpickling) on one intra-op thread.
    With more, its small float64 ops go parallel and the idle OpenMP thread spins between them,
    taking a core from the ranks: on 2 cores the driver used 2.2 CPU-s for 100 TP 2 cases instead
    of 0.9, and the ranks ran that much slower (docs/performance.md)."""
    global _DRIVER_THREADS
    if _DRIVER_THREADS is None:
        _DRIVER_THREADS = torch.get_num_threads()
        torch.set_num_threads(1)


def _restore_driver_threads() -> None:
    global _DRIVER_THREADS
    if _DRIVER_THREADS is not None:
        torch.set_num_threads(_DRIVER_THREADS)
        _DRIVER_THREADS = None


@atexit.register
def close_all() -> None:
    for pool in list(_LIVE):
        pool.close()


_interrupted = 0  # the signal that interrupted the run; 0: none


def on_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C, or SIGTERM (a CI runner cancelling): raise KeyboardInterrupt now, and again at the
    next job should this one be swallowed. Both end the run the same way; `interrupted_by` says which."""
    global _interrupted
    _interrupted = signum
    raise KeyboardInterrupt


def interrupted_by() -> int:
    return _interrupted


def install_signal_handlers() -> None:
    """In the main thread of the driver: SIGINT and SIGTERM stop the run and its pools (even when
    started with SIGINT ignored, as background jobs of a non-interactive shell are)."""
    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, on_sigint)
    sys.unraisablehook = _quiet_when_interrupted


def _quiet_when_interrupted(unraisable: Any, default: Any = sys.unraisablehook) -> None:
    """A KeyboardInterrupt raised inside a finalizer or a gc callback is swallowed by Python with an
    "Exception ignored" traceback; the next job raises it again, so the traceback is noise."""
    if _interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt):
        return
    default(unraisable)


if hasattr(signal, "SIGTERM") and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
    signal.signal(signal.SIGTERM, on_sigint)  # unwinds through the finally blocks and atexit, which close the pools
