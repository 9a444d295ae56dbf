"""Process sessions: each `harness check` a replay starts leads a session of its own (its worker pools,
and whatever a build under it starts, are in it), so that stopping it reaches every process it
started. Sessions, not process groups: ninja runs each compiler of the memory ledger's build in a
group of its own, and those outlived a check stopped mid-build.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

KILL_SWEEP_S = 5  # how long SIGKILL is sent again to what a stopped session's processes are still starting


class Sessions:
    """The processes running, each the leader of a session of its own. Once `stop` is called, none
    starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a check is never started after `stop` collected the running ones
        self._running: set[subprocess.Popen] = set()
        self.stopped = False

    def start(self, cmd: list[str], **popen: Any) -> subprocess.Popen | None:
        """The process, started as a session's leader; None once stopped."""
        with self._lock:
            if self.stopped:
                return None
            proc = subprocess.Popen(cmd, start_new_session=True, **popen)
            self._running.add(proc)
            return proc

    def finished(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(proc)

    def stop(self, grace_s: float) -> None:
        """Every running session stopped, all within `grace_s` (`stop_sessions`), and no new one started."""
        with self._lock:
            self.stopped = True
            running = list(self._running)
        stop_sessions(running, grace_s)


def stop_sessions(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every process of the sessions these lead, all at once (a check writes what it found
    and closes its pools), then SIGKILL to what is left of them after `grace_s`, exited leader or not."""
    sessions = {proc.pid for proc in procs}
    _signal_sessions(sessions, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        # Again until none is left: a dying process may still have started one.
        until = time.monotonic() + KILL_SWEEP_S
        while _signal_sessions(sessions, signal.SIGKILL) and time.monotonic() < until:
            time.sleep(0.05)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a leader in uninterruptible sleep
                proc.wait(timeout=60)


def _signal_sessions(sessions: set[int], sig: int) -> int:
    """`sig` to every live process of these sessions (`/proc`; a zombie is dead already); how many."""
    sent = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state, _, _, session = f.read().rsplit(b")", 1)[1].split()[:4]  # after "pid (comm)"
            if int(session) in sessions and state != b"Z":
                os.kill(int(entry.name), sig)
                sent += 1
        except (OSError, ValueError):  # gone meanwhile
            continue
    return sent


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Ctrl-C and SIGTERM ignored (in the main thread, where handlers live): a second one while the
    checks are being stopped would leave the rest running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
