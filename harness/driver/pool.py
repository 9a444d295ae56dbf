"""Persistent tensor-parallel worker pools: one per (TP, CP, DP) size, started once, reused for every case.

Each rank joins a real `torch.distributed` group (gloo on CPU, NCCL on CUDA) with a collective
timeout, and initialises megatron-core's `parallel_state` with the pool's TP and CP sizes, so wrappers
find their groups where production code looks. A pool's world is TP x CP x DP, megatron-core's order
(TP fastest): world rank g is TP rank g % TP of CP rank (g // TP) % CP of DP replica g // (TP x CP). The main
process sends each job to every rank and waits with a deadline; a rank that dies or does not
answer becomes an error result naming it, and the pool is torn down and rebuilt. What each worker
runs is the rank loop (`harness.engine.rank`); what the driver process holds for all its pools (the
live pools, the parking thread, the interrupting signal) is `harness.driver.lifecycle`.

Stuck ranks are found by evidence, not by waiting for the collective timeout: every worker
publishes its collective progress to a shared `ProgressBoard`; once every rank still running is
blocked in a collective and nothing has moved for a grace period scaled to what this pool's jobs
cost, those ranks are declared stuck, named with the collective each was blocked in. The case
deadline scales the same way (`case_deadline`); the gloo/NCCL timeout stays as the backstop.

Workers die with the main process (PR_SET_PDEATHSIG) and are terminated at exit, so no process
outlives the run.

A gloo pool is stopped (SIGSTOP) once idle (`lifecycle.IDLE_PARK_S`) and continued when the next job is sent. An idle
gloo rank is not idle: every process group megatron-core makes (about 18 per rank) has a TCP loop
thread that wakes 100 times a second, so a test session holding 70 idle ranks made 120,000 wakeups
a second and ran a 2-core machine at load 150-200, four times slower than its own work. NCCL pools
are left running: their watchdog would take a stop for a hang.
"""
from __future__ import annotations

import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
import warnings
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch.multiprocessing as mp

from harness.base.errors import PoolStartError
from harness.base.options import COLLECTIVE_TIMEOUT_S
from harness.driver import cpu_share, lifecycle
from harness.engine import stacks, wire
from harness.engine.observations import HANG_KINDS, RankResult
from harness.engine.progress import ProgressBoard
from harness.engine.rank import _worker_main, coordinates
from harness.meters import memory_meter
from harness.meters.trace import fmt_event

STARTUP_TIMEOUT_S = 120.0
RAISED_GRACE_S = 2.0
# Stuck detection: a rank blocked in a collective while its peers have returned is stuck once
# nothing has moved for max(STUCK_FLOOR_S, STUCK_COST_FACTOR x the median job time); with every
# rank blocked (none returned) the bar is higher, a slow collective being the innocent explanation.
STUCK_FLOOR_S = 0.5
STUCK_COST_FACTOR = 20
ALL_BLOCKED_FLOOR_S = 3.0
ALL_BLOCKED_COST_FACTOR = 50
POLL_S = 0.05
# Case deadline once the pool has measured MIN_MEASURED jobs: max(CASE_FLOOR_S, CASE_COST_FACTOR x
# the median), never above the backstop (twice the collective timeout plus 10 s).
MIN_MEASURED = 3
CASE_FLOOR_S = 10.0
CASE_COST_FACTOR = 100
# The longest a job may run while a rank's stack shows an import or a compilation under way (a
# compiled routine compiles again for each new dtype, grad mode or size specialisation, on every
# rank at once: tens of seconds on a small, loaded machine), when no case timeout is set.
COMPILE_BOUND_S = 300.0


class WorkerPool:
    def __init__(self, tp: int, device: str = "cpu", collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 dp: int = 1, case_timeout_s: float | None = None, cp: int = 1):
        """`dp`: data-parallel replicas, each `cp` context-parallel ranks of TP groups of `tp` ranks
        (world = tp x cp x dp).
        `case_timeout_s`: a fixed deadline per job; None scales it with the measured job cost."""
        self.tp = tp
        self.dp = dp
        self.cp = cp
        self.world = tp * cp * dp
        self.backend = "nccl" if device == "cuda" else "gloo"
        self.start_method = "spawn" if device == "cuda" else "fork"
        self.collective_timeout_s = collective_timeout_s
        self.case_timeout_s = case_timeout_s
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.store_dir: str | None = None
        self.board: ProgressBoard | None = None
        self.restarts = 0
        self.job_seconds: deque[float] = deque(maxlen=101)  # jobs every rank answered; survives restarts
        self.stuck_events = 0
        self.killed: set[int] = set()  # pids this pool killed itself (`close`): their death is not the routine's
        self.events: list[str] = []  # what went wrong in the infrastructure and was recovered (`restart`)
        self.calls: list[int] = []  # per rank: the jobs its current process has been sent (`submit`)
        self.parked = False
        self._submitted = self._deadline = 0.0  # the job in flight (`submit`)
        self.idle_since: float | None = None  # when its last job was collected; None while one is in flight
        self.start()

    @property
    def median_job_s(self) -> float | None:
        return statistics.median(self.job_seconds) if len(self.job_seconds) >= MIN_MEASURED else None

    def stuck_grace(self, some_answered: bool) -> float:
        """How long nothing may move, every running rank blocked in a collective, before those ranks are stuck."""
        median = self.median_job_s or 0.0
        if some_answered:
            return max(STUCK_FLOOR_S, STUCK_COST_FACTOR * median)
        return max(ALL_BLOCKED_FLOOR_S, ALL_BLOCKED_COST_FACTOR * median)

    def case_deadline(self) -> float:
        """The deadline of one job: `case_timeout_s` if set; else scaled to the measured job cost,
        with a floor for legitimately slow targets; the backstop while nothing is measured."""
        if self.case_timeout_s is not None:
            return self.case_timeout_s
        backstop = self.collective_timeout_s * 2 + 10
        median = self.median_job_s
        if median is None:
            return backstop
        return min(backstop, max(CASE_FLOOR_S, CASE_COST_FACTOR * median))

    def compile_bound_s(self, deadline_s: float) -> float:
        """How long a job may run while a rank is still importing or compiling: the case timeout
        when one is set, else COMPILE_BOUND_S (never less than the job's own deadline)."""
        return deadline_s if self.case_timeout_s is not None else max(deadline_s, COMPILE_BOUND_S)

    def name(self, r: int) -> str:
        if self.dp == 1 and self.cp == 1:
            return f"rank {r}"
        tp_rank, cp_rank, replica = coordinates(r, self.tp, self.cp)
        where = f"TP rank {tp_rank}" + (f" of CP rank {cp_rank}" if self.cp > 1 else "")
        return f"rank {r} ({where}" + (f" of DP replica {replica})" if self.dp > 1 else ")")

    def start(self) -> None:
        if self.start_method == "fork":
            # Imported once here, inherited by every fork: a rebuilt pool starts in a fraction of
            # a second instead of re-importing megatron-core in each rank.
            with warnings.catch_warnings():  # optional-dependency notices, not ours to show
                warnings.simplefilter("ignore")
                import megatron.core.parallel_state  # noqa: F401
        if self.backend == "gloo":
            lifecycle._leave_cores_to_ranks()
        # Built (or loaded from torch's extension cache) here, once: not by every rank at once.
        memory_meter.compiled_ledger()
        ctx = mp.get_context(self.start_method)
        label = f"tp{self.tp}" + (f"cp{self.cp}" if self.cp > 1 else "") + (f"dp{self.dp}" if self.dp > 1 else "")
        self.store_dir = tempfile.mkdtemp(prefix=f"harness-{label}-")
        self.board = ProgressBoard(ctx, self.world)
        self.calls = [0] * self.world
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            # get_context(str) is typed as the BaseContext, which declares no Process; every start method's has one.
            p = ctx.Process(  # pyright: ignore[reportAttributeAccessIssue]
                target=_worker_main, name=f"harness-{label}-rank{rank}", daemon=True,
                args=(rank, self.world, self.store_dir, child, self.backend,
                      self.collective_timeout_s, os.getpid(), self.tp, self.board, self.cp))
            p.start()
            child.close()
            self.killed.discard(p.pid)  # a pid used again
            self.procs.append(p)
            self.conns.append(parent)
        lifecycle._LIVE.add(self)
        replies = self._gather(time.monotonic() + STARTUP_TIMEOUT_S, watch=False)
        bad = [f"rank {r}: {m.error}" for r, m in enumerate(replies) if isinstance(m, RankResult) and m.error]
        bad += [f"rank {r}: {m[1]}" for r, m in enumerate(replies) if isinstance(m, tuple) and m[0] != "ready"]
        if bad:
            self.close()
            size = f"TP {self.tp}" + (f" x CP {self.cp}" if self.cp > 1 else "") + (f" x DP {self.dp}" if self.dp > 1 else "")
            raise PoolStartError(f"{size} pool failed to start: " + "; ".join(bad))
        with lifecycle._PARKING:
            self.park()

    def _result(self, r: int, error: str, kind: str, trace: list | None = None) -> RankResult:
        """The pool's own result for world rank r, which gave no answer of its own."""
        tp_rank, cp_rank, replica = coordinates(r, self.tp, self.cp)
        return RankResult(tp_rank, error=error, error_kind=kind, trace=list(trace or []), replica=replica,
                          cp_rank=cp_rank, groups=(self.cp, self.dp))

    def _stuck(self, pending: list[int], replies: dict[int, Any], still_s: float) -> dict[int, RankResult]:
        """The results of ranks found stuck, each naming the collective it was blocked in."""
        assert self.board is not None
        answered = sorted(replies)
        why = (f"{', '.join(self.name(r) for r in answered)} had returned" if answered
               else "every rank was blocked in a collective")
        out = {}
        for r in pending:
            p = self.board.read(r)
            where = fmt_event(p.last) if p.last else "a collective"
            out[r] = self._result(r, f"{self.name(r)} stuck in {where}, the collective #{p.entered} it entered in "
                                     f"this case: nothing moved for {still_s:.1f}s, no rank working or waiting for a CPU, "
                                     f"while {why}", "stuck",
                                  p.trace or [])
        return out

    def _stuck_in_code(self, outside: list[int], watch: stacks.StackWatch) -> dict[int, RankResult]:
        """The results of ranks stuck outside any collective, each with what its stack showed."""
        return {r: self._result(r, f"{self.name(r)} stuck in the routine's own code, outside any collective: "
                                   f"its stack did not change for {watch.still_seconds():.0f}s, "
                                   f"{watch.describe(r)}", "stuck") for r in outside}

    def _gather(self, deadline: float, watch: bool = True) -> list[Any]:
        """One reply per rank, or a RankResult naming why that rank gave none. `watch`: read the
        progress board and end the job as soon as the ranks still running are stuck: blocked in a
        collective, or outside any with a stack that no longer moves (`stacks`). Once a rank
        has raised, the others get RAISED_GRACE_S more: a rank left waiting in a collective its
        peer never issued would otherwise hold the case until the collective timeout."""
        replies: dict[int, Any] = {}
        # The job has run since it was sent, not since it is collected: a job collected after another
        # (a case's twin beside it) has already had its time when the first is found stuck.
        started = self._submitted if watch and self._submitted else time.monotonic()
        median = self.median_job_s or 0.0
        code = stacks.StackWatch(self.store_dir or "", [p.pid for p in self.procs],
                                 max(stacks.PROBE_FLOOR_S, stacks.PROBE_COST_FACTOR * median)) if watch else None
        raised_at: float | None = None
        pending = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        board = self.board if watch else None
        signature, quiet_at_move = None, 0.0
        # A rank whose stack shows an import or a compilation still under way is not hung: its
        # deadline moves on while it does, up to the case timeout (`compile_bound`); so does it by
        # the time the ranks waited for a CPU (`cpu_share`).
        bound = started + self.compile_bound_s(deadline - started)
        cpu = cpu_share.CpuShare([p.pid for p in self.procs], started) if watch else None
        while pending:
            left = min(bound, deadline + (cpu.starved_s if cpu is not None else 0.0)) - time.monotonic()
            if left <= 0:
                if code is not None and deadline < bound and any(code.starting_up(r) for r in pending.values()):
                    deadline = min(bound, time.monotonic() + stacks.STARTUP_EXTEND_S)
                    continue
                break
            ready = wait([*pending, *(s for s, r in sentinels.items() if r not in replies)],
                         timeout=min(left, POLL_S) if board is not None else left)
            for obj in ready:
                if obj in pending:
                    r = pending.pop(obj)  # pyright: ignore[reportArgumentType] -- wait() types them by a base class
                    try:
                        replies[r] = wire.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        pass
                    if raised_at is None and isinstance(replies.get(r), RankResult) and replies[r].error:
                        raised_at = time.monotonic()
                        deadline = min(deadline, raised_at + RAISED_GRACE_S)
                        if code is not None:  # a rank still compiling must show it before the grace ends
                            code.probe_after_s = 0.0
                elif sentinels.get(obj) is not None and sentinels[obj] not in replies:
                    r = sentinels[obj]
                    conn = self.conns[r]
                    if conn in pending and conn.poll():
                        continue  # it answered before exiting: read the answer first
                    pending.pop(conn, None)
                    sentinels.pop(obj)
                    self.procs[r].join(1.0)  # reap it, so the exit code is known
                    exit_code = self.procs[r].exitcode
                    by_us = " (killed by the harness)" if self.procs[r].pid in self.killed else ""
                    call = self.calls[r]
                    when = f" during its {nth(call)} call" if call else " while starting"
                    replies[r] = self._result(r, f"{self.name(r)} died (exit code {exit_code}){when}{by_us}", "died")
                    replies[r].exit_code, replies[r].call = exit_code, call
            if board is not None and pending:
                now = time.monotonic()
                running = sorted(pending.values())
                assert cpu is not None and code is not None
                cpu.sample(running, now)
                state = (len(replies), tuple(board.signature(r) for r in running))
                # Still time: only the quiet share counts, never time the ranks worked or waited for a CPU.
                if state != signature:
                    signature, quiet_at_move = state, cpu.quiet_s
                still = cpu.quiet_s - quiet_at_move
                if all(board.inside[r] for r in running) and still >= self.stuck_grace(some_answered=bool(replies)):
                    replies.update(self._stuck(running, replies, still))
                    self.stuck_events += 1
                    break
                outside = [r for r in running if not board.inside[r]]
                code.probe(outside, now - started, now)
                if code.stuck(outside) and still >= code.still_seconds():
                    inside = [r for r in running if board.inside[r]]
                    replies.update(self._stuck(inside, replies, still) if inside else {})
                    replies.update(self._stuck_in_code(outside, code))
                    self.stuck_events += 1
                    break
        for r in range(self.world):
            if r not in replies:
                why = (f"still running {RAISED_GRACE_S:.0f}s after another rank raised (blocked in a collective?)"
                       if raised_at is not None else "gave no answer within the deadline (hung)")
                if code is not None and r in code.ranks:
                    if code.starting_up(r):
                        why = (f"was still importing or compiling when the case timeout of {bound - started:.0f}s "
                               f"passed: ")
                    else:
                        why += ": "
                    why += code.describe(r)
                trace = board.read(r).trace if board is not None else None
                replies[r] = self._result(r, f"{self.name(r)} {why}", "timeout", trace)
        return [replies[r] for r in range(self.world)]

    def call(self, fn_path: str, args_per_rank: list[tuple], deadline_s: float,
             while_waiting: Callable[[], Any] | None = None) -> list[Any]:
        """Run `fn_path(ctx, *args)` on every rank; rebuild the pool if any rank failed to answer.
        `while_waiting`: main-process work done while the ranks run (its failure is left to whoever
        needs its result, to raise in its own place)."""
        self.submit(fn_path, args_per_rank, deadline_s)
        meanwhile(while_waiting)
        return self.collect()

    def submit(self, fn_path: str, args_per_rank: list[tuple], deadline_s: float) -> None:
        """Send a job to every rank and return at once; `collect` gathers it. Between the two the
        driver may submit to other pools: they work at the same time."""
        if lifecycle._interrupted:
            raise KeyboardInterrupt  # the first one was swallowed (e.g. raised inside a finalizer)
        with lifecycle._PARKING:
            self.idle_since = None
            self.wake()
        if self.board is not None:
            self.board.reset()
        self._submitted = time.monotonic()
        self._deadline = self._submitted + deadline_s
        self.calls = [n + 1 for n in self.calls]
        for conn, args in zip(self.conns, args_per_rank, strict=True):
            try:
                conn.send((fn_path, args))
            except (BrokenPipeError, OSError):
                pass  # the rank is gone; _gather reports it

    def collect(self) -> list[Any]:
        """Every rank's reply to the job `submit` sent (or why it gave none)."""
        replies = self._gather(self._deadline)
        if any(isinstance(r, RankResult) and r.error_kind in (*HANG_KINDS, "died") for r in replies):
            self.restart(grace_s=0.0)  # a stuck rank would not read the request to exit
        else:
            self.job_seconds.append(time.monotonic() - self._submitted)
            self._idle()
        return replies

    def _idle(self) -> None:
        """From now on the parking thread may stop it (`_park_idle_pools`)."""
        with lifecycle._PARKING:
            self.idle_since = time.monotonic()
            if lifecycle._parker is None and self.backend == "gloo":
                lifecycle._parker = threading.Thread(target=lifecycle._park_idle_pools, name="harness-pool-parking",
                                                   daemon=True)
                lifecycle._parker.start()

    def park(self) -> None:
        """Stop every rank until the next job (gloo only: see the module's notes). Only between
        jobs, once every rank has answered: no rank is then inside a collective, or waiting on one."""
        if self.backend != "gloo" or self.parked:
            return
        self._signal(signal.SIGSTOP)
        self.parked = True

    def wake(self) -> None:
        if self.parked:
            self._signal(signal.SIGCONT)
            self.parked = False

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass  # it died: the next job reports it

    def run(self, fn_path: str, *args: Any, deadline_s: float | None = None,
            while_waiting: Callable[[], Any] | None = None) -> list[Any]:
        deadline = deadline_s if deadline_s is not None else self.case_deadline()
        return self.call(fn_path, [args] * self.world, deadline, while_waiting)

    def restart(self, grace_s: float = 2.0) -> None:
        """New ranks for the old. A rebuild that fails to start (its ranks' process groups could not
        connect: "Connection refused" on a loaded machine) is tried once more before it is an error,
        and said in `events`: a pool the run cannot rebuild ends it (exit 2), never a case's verdict."""
        self.close(grace_s)
        self.restarts += 1
        try:
            self.start()
        except PoolStartError as e:
            self.events.append(f"a rebuilt pool failed to start and was started again: {e}")
            self.start()

    def close(self, grace_s: float = 2.0) -> None:
        """Ask every rank to exit, wait up to `grace_s` for them to, then kill the rest."""
        with lifecycle._PARKING:
            self.idle_since = None
            self.wake()
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                self.killed.add(p.pid)
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if self.store_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None
        lifecycle._LIVE.discard(self)
        if not any(pool.backend == "gloo" for pool in lifecycle._LIVE):
            lifecycle._restore_driver_threads()




def nth(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def meanwhile(work: Callable[[], Any] | None) -> None:
    """Main-process work done while ranks run a job; its failure is left to whoever needs its
    result, to raise in its own place."""
    if work is not None:
        try:
            work()
        except Exception:
            pass
