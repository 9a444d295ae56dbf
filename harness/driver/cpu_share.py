"""Whether the ranks of a job that has not moved were given the CPU: a stall under load is no hang.

The progress board and the stacks find a stuck rank by time: nothing moved for a grace period, or
the job ran past its deadline. On a loaded machine (a CI runner shared with other jobs, two
CPU-bound neighbours per core) a rank can wait that long in the run queue with nothing wrong, and
two ranks in one all-reduce can both look blocked while their transfer waits for a core. Linux
counts, per thread, the CPU time used and the time spent runnable without a CPU
(`/proc/PID/task/TID/schedstat`: run time and run-queue delay, in ns). Sampled for the ranks still
running, they classify each interval:
- quiet: every running rank idle (under IDLE_SHARE of a core), none of their threads waiting for a
  CPU, and none runnable at the interval's end: a stall, the only time that counts towards a stuck
  verdict (Linux adds a wait to the run-queue delay only once the thread gets a CPU, so a thread
  still waiting at a sample shows neither run time nor delay for it, and on a loaded machine such
  a wait spans whole intervals);
- working: some rank used the CPU (a slow collective, a long kernel): proves nothing;
- starved: a thread of a running rank waited for a CPU for over STARVED_SHARE of the interval:
  proves nothing, and moves the job's deadline on by the time it waited.
Where schedstat cannot be read, every interval is quiet and no time is starved: the wall clock
decides alone.
"""
from __future__ import annotations

import os

SAMPLE_EVERY_S = 0.2
# A rank blocked in a collective uses about 2% of a core (its gloo loop threads); a working one
# far more, even when starved down to a third of a core.
IDLE_SHARE = 0.1
# A thread that spent this share of an interval runnable without a CPU was starved. The gloo loop
# threads of an idle rank, each woken 100 times a second, wait far less even under heavy load.
STARVED_SHARE = 0.25


def _threads(pid: int) -> dict[int, tuple[int, int, bool]]:
    """Per thread of `pid`: (ns run on a CPU, ns waited runnable for one, runnable now). Empty when
    unreadable."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                run, delay, _ = fh.read().split()
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                state = fh.read().rpartition(")")[2].split()[0]
            out[int(tid)] = (int(run), int(delay), state == "R")
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return out


class CpuShare:
    """Quiet and starved seconds of one job's running ranks, sampled as the driver polls."""

    def __init__(self, pids: list[int], now: float):
        self.pids = pids
        self.quiet_s = 0.0
        self.starved_s = 0.0
        self._last_at = now
        self._last: dict[int, dict[int, tuple[int, int, bool]]] = {}

    def sample(self, running: list[int], now: float) -> None:
        """Classify the time since the last sample, for the ranks `running` (world ranks)."""
        if now - self._last_at < SAMPLE_EVERY_S:
            return
        dt, self._last_at = now - self._last_at, now
        ns = dt * 1e9
        current = {r: _threads(self.pids[r]) for r in running}
        known = [r for r in running if current[r] and self._last.get(r)]
        worked = starved = 0.0
        runnable = any(state[2] for r in known for state in current[r].values())
        for r in known:
            before, after = self._last[r], current[r]
            common = [t for t in after if t in before]
            worked = max(worked, sum(after[t][0] - before[t][0] for t in common) / ns)
            starved = max(starved, max((after[t][1] - before[t][1] for t in common), default=0) / ns)
        self._last = current
        if len(known) < len(running):
            # First sight of a rank (or unreadable): nothing to compare yet. Unreadable everywhere
            # means no schedstat: the wall clock decides.
            if not any(current.values()):
                self.quiet_s += dt
            return
        if starved > STARVED_SHARE:
            self.starved_s += min(dt, starved * dt)
        elif worked <= IDLE_SHARE and not runnable:
            self.quiet_s += dt
