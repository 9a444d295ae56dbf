"""What a rank that does not answer is doing, outside any collective: its Python stack.

A rank blocked in a collective is found stuck by the progress board. A rank that is not in a
collective and does not return is either legitimately busy starting up (importing a peer's
dependencies, compiling) or stuck in the routine's own code (a sleep, a wait on a lock, a loop).
Its stack tells the two apart by evidence: every worker registers `faulthandler` on a signal, the
driver asks for a dump every second or so, and a rank whose stack has not changed for a few
samples, with no import or compilation frame in it and no CPU used meanwhile, is stuck where the
stack says. A rank that works with a stack that does not change (one long C call) is left to the
case deadline. A compilation or an import still under way is never a hang: while a rank's latest
stack shows one, the job's deadline moves on, STARTUP_EXTEND_S at a time, up to the case timeout
(`WorkerPool.compile_bound_s`); only a rank still compiling at that bound is reported, as such.

faulthandler writes from its C signal handler, without the GIL, so a rank spinning in Python or
sleeping in C still answers. The signal is registered before the worker says "ready", and the
driver only asks a pool whose workers are ready.
"""
from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from dataclasses import dataclass, field
from typing import IO

STACK_SIGNAL = signal.SIGUSR1
# Frames of start-up work that may legitimately last minutes on a first call: an import, a
# Dynamo/Inductor/Triton compilation, a C++ extension build.
STARTUP_FRAMES = ("<frozen importlib", "importlib/__init__.py", "torch/_dynamo/", "torch/_inductor/",
                  "torch/_functorch/", "triton/", "torch/utils/cpp_extension.py")
# Probing starts once a job has run this long (or PROBE_COST_FACTOR x the pool's median job), and a
# rank is stuck once its stack has been the same, start-up free, in STILL_SAMPLES dumps in a row,
# PROBE_EVERY_S apart.
PROBE_FLOOR_S = 5.0
PROBE_COST_FACTOR = 20
PROBE_EVERY_S = 1.0
STILL_SAMPLES = 4
DUMP_WAIT_S = 0.5
SHOWN_FRAMES = 4
# A job whose deadline passes while a rank is importing or compiling gets this much more at a time.
STARTUP_EXTEND_S = 5.0
# A rank that used less than this share of a core across its dumps is waiting, not working (its
# gloo loop threads alone use about 2%). Only a waiting rank is stuck by its stack: a working one
# may be in one long C call, or a loop on one line, whose stack does not change (a timing loop
# was: a false hang), so it is left to the case deadline.
IDLE_SHARE = 0.1
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def stack_file(store_dir: str, rank: int) -> str:
    return os.path.join(store_dir, f"stack-{rank}.txt")


def install(store_dir: str, rank: int) -> IO[str]:
    """In the worker: dump this process's stacks to its file on STACK_SIGNAL. Returns the file, which
    the worker keeps open (faulthandler writes to its descriptor)."""
    fh = open(stack_file(store_dir, rank), "a")  # append: the driver truncates it before each dump
    faulthandler.register(STACK_SIGNAL, file=fh, all_threads=True, chain=False)
    return fh


def _cpu_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def dump(path: str, pid: int) -> str:
    """The stack dump of process `pid` ('' when it gave none in time)."""
    open(path, "w").close()
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return ""
    end = time.monotonic() + DUMP_WAIT_S
    text = ""
    while time.monotonic() < end:
        with open(path) as fh:
            text = fh.read()
        if text.endswith("\n") and "File" in text:
            break
        time.sleep(0.01)
    return text


def worker_thread(text: str) -> str:
    """The dump of the thread that runs the jobs (the one in the pool's worker loop), or the whole
    dump when no thread is: other threads (tqdm's monitor, a compile pool's reader) say nothing
    about what the job is doing."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    return next((t for t in threads if "in _worker_main" in t), text)


def frames(text: str) -> list[str]:
    """The frames of a dump's job thread, innermost first, with the thread headers dropped."""
    return [line.strip() for line in worker_thread(text).splitlines() if line.strip().startswith("File ")]


def starting_up(text: str) -> bool:
    """The job thread is importing or compiling."""
    job = worker_thread(text)
    return any(marker in job for marker in STARTUP_FRAMES)


@dataclass
class RankStacks:
    """One rank's recent dumps, and the CPU time it used across them."""
    samples: list[str] = field(default_factory=list)
    cpu: list[int | None] = field(default_factory=list)

    def add(self, text: str, cpu: int | None) -> None:
        self.samples = (self.samples + [text])[-STILL_SAMPLES:]
        self.cpu = (self.cpu + [cpu])[-STILL_SAMPLES:]

    @property
    def idle(self) -> bool:
        """It used (almost) no CPU across its dumps; unknown counts as working."""
        used = [c for c in self.cpu if c is not None]
        if len(used) < 2 or len(used) != len(self.cpu):
            return False
        return used[-1] - used[0] <= IDLE_SHARE * _TICKS_PER_S * (len(used) - 1) * PROBE_EVERY_S

    @property
    def still(self) -> bool:
        """The same stack, outside any start-up work, in the last STILL_SAMPLES dumps, and no CPU used."""
        s = self.samples
        return len(s) == STILL_SAMPLES and bool(frames(s[-1])) and all(x == s[-1] for x in s) \
            and not starting_up(s[-1]) and self.idle

    def describe(self) -> str:
        """Where the rank is, innermost frames first, and whether it used the CPU meanwhile."""
        shown = frames(self.samples[-1])[:SHOWN_FRAMES]
        doing = "sleeping or waiting (it used no CPU)" if self.idle else "spinning (it used the CPU)"
        return f"{doing}; innermost frames: " + " <- ".join(shown)


class StackWatch:
    """The driver's view of the ranks of one job that are outside any collective."""

    def __init__(self, store_dir: str, pids: list[int], probe_after_s: float):
        self.store_dir, self.pids, self.probe_after_s = store_dir, pids, probe_after_s
        self.ranks: dict[int, RankStacks] = {}
        self.next_probe = 0.0

    def probe(self, outside: list[int], elapsed_s: float, now: float) -> None:
        """Sample the stacks of the ranks `outside` a collective, when it is time to."""
        if elapsed_s < self.probe_after_s or now < self.next_probe:
            return
        self.next_probe = now + PROBE_EVERY_S
        for r in outside:
            self.ranks.setdefault(r, RankStacks()).add(dump(stack_file(self.store_dir, r), self.pids[r]),
                                                       _cpu_ticks(self.pids[r]))
        for r in set(self.ranks) - set(outside):
            del self.ranks[r]  # it entered a collective or returned: its earlier samples no longer count

    def stuck(self, outside: list[int]) -> bool:
        return bool(outside) and all(r in self.ranks and self.ranks[r].still for r in outside)

    def starting_up(self, r: int) -> bool:
        s = self.ranks.get(r)
        return s is not None and bool(s.samples) and starting_up(s.samples[-1])

    def describe(self, r: int) -> str:
        return self.ranks[r].describe()

    def still_seconds(self) -> float:
        return (STILL_SAMPLES - 1) * PROBE_EVERY_S
