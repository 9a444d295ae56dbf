"""Cases per second of the engine, per TP size: small randomized kernel and wrapper cases (3:1),
every registered check evaluated, twins included; pools started once, start-up timed separately.

    python benchmarks/throughput.py [--cases 200] [--breakdown] [--replay]

`--breakdown` also splits a checked case's wall time into its stages, per TP size and level, by
timing the engine's own functions from this script (nothing in the harness is changed for it):
drawing (Hypothesis, main process), the oracle (float64, main process; mostly while the ranks
work, inside a round trip), the round trips to the pool (a case and the twins its checks ask
for), within them the ranks' work (the slowest rank's job:
the target's forward calls, its backwards, and the rest: building shards, meters, traces,
re-runs) and the transport (sending, waiting, unpickling replies), the checks, and bookkeeping
(what is left: fitting, caching, findings). It runs a case's jobs one at a time (as on one core),
so that each round trip is one pool's; its cases/s are those of that setting.

It first prints the machine's speed (one small aten op, a pure-Python loop): figures from other
days or machines compare through it, not as they stand.

`--replay` then sends the same jobs again, back to back, with no oracle, no check and no
bookkeeping between them, once as they were and once without the memory meter: the ceiling of any
cut on the driver's side, and what the meter costs the ranks.

`--threads` splits the CPU time of the checked cases (user + system, from /proc, Linux only) by
thread: the driver's main thread and its others, the ranks' main threads (the routine, the memory
meter, the job), gloo's TCP device loops (one per process group and rank: sockets, and a wakeup
every 10 ms) and its collective worker threads: who uses the cores.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import multiprocessing
import os
import time
from collections import defaultdict
from typing import Any, Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.strategies import kernel_cases, linear_cases, wrapper_cases
from harness.checks import oracle
from harness.driver import runner as runner_module
from harness.driver.pool import WorkerPool
from harness.driver.runner import Runner
from harness.engine import executor
from harness.engine.executor import CASE_JOB
from harness.engine.observations import RankResult
from harness.targets import load_target

MAX_WORLD = 8
THREAD_COLUMNS = {
    "driver, main thread": {("driver", "main")},
    "driver, other threads": {("driver", "other"), ("driver", "gloo_tcp_loop"), ("driver", "pt_gloo_runloop")},
    "ranks, main threads": {("ranks", "main")},
    "ranks, gloo TCP loops": {("ranks", "gloo_tcp_loop")},
    "ranks, gloo collective threads": {("ranks", "pt_gloo_runloop")},
    "ranks, other threads": {("ranks", "other")},
}
# Per world rank: [job, forward calls, backwards] seconds of the last job (written by the ranks,
# forked from this process after it is created, read by the driver after each round trip).
_RANK_SECONDS = multiprocessing.RawArray("d", 3 * MAX_WORLD)


def draw(strategy: st.SearchStrategy, n: int) -> list:
    """n cases as Hypothesis draws them, reproducibly."""
    out: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None)
    @given(strategy)
    def collect(case):
        out.append(case)

    collect()
    return out


class Stages:
    """Seconds per stage, accumulated for the level whose case is being checked."""

    def __init__(self) -> None:
        self.by_level: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.level = "kernel"

    def add(self, stage: str, seconds: float) -> None:
        self.by_level[self.level][stage] += seconds

    def timed(self, stage: str, fn: Callable, net_of: str | None = None) -> Callable:
        """fn, its time added to `stage`; `net_of`: less the time of that stage run inside it (the
        oracle runs inside the first check that reads it)."""
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            inner = self.by_level[self.level][net_of] if net_of else 0.0
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inner = (self.by_level[self.level][net_of] - inner) if net_of else 0.0
                self.add(stage, time.perf_counter() - start - inner)
        return wrapper


def _rank_slot(stage: int, fn: Callable) -> Callable:
    """In a rank: add fn's time to this rank's slot `stage` of the last job."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _RANK_SECONDS[3 * _rank() + stage] += time.perf_counter() - start
    return wrapper


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def timed_case_job(ctx: Any, case: Any, target_spec: str, meter_memory: bool = True) -> Any:
    """The engine's case job, with this rank's job, forward-call and backward seconds recorded."""
    for k in range(3):
        _RANK_SECONDS[3 * ctx.rank + k] = 0.0
    start = time.perf_counter()
    try:
        return executor.case_job(ctx, case, target_spec, meter_memory)
    finally:
        _RANK_SECONDS[3 * ctx.rank] = time.perf_counter() - start


def machine_speed() -> str:
    """This machine's speed, to compare figures across machines and days (a VM's speed drifts by
    20-30% within hours, and by more between days): one small aten op, and a pure-Python loop,
    best of five, in this process."""
    x = torch.ones(8, 16)

    def ops() -> None:
        for _ in range(20_000):
            x.add(1.0)

    def best(fn: Callable[[], Any], n: int) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) / n)
        return min(times)

    op = best(ops, 20_000)
    loop = best(lambda: sum(range(1_000_000)), 1)
    return (f"Machine: one small aten op (add on a float32 [8, 16]) {op * 1e6:.2f} us, a sum over "
            f"range(10**6) {loop * 1e3:.1f} ms (best of five); {runner_module.CORES} cores.")


def all_reduce_seconds(ctx: Any, n: int) -> float:
    """Seconds per all_reduce of 64 floats over this rank's TP group: the floor under every
    collective a routine makes."""
    import torch.distributed as dist

    from harness.engine.calls import tp_group

    x, group = torch.ones(64), tp_group()
    for _ in range(10):
        dist.all_reduce(x, group=group)
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x, group=group)
    return (time.perf_counter() - start) / n


def instrument(runner: Runner, stages: Stages) -> None:
    """Time the engine's stages from outside: the oracle, the round trips, the checks; in the ranks
    (inherited by fork), the job, the target's calls and the backwards."""
    oracle.expected = functools.lru_cache(maxsize=256)(stages.timed("oracle", oracle.expected.__wrapped__))
    runner_module.CASE_JOB = f"{__name__}:timed_case_job"
    runner_module.CORES = 1  # jobs one at a time: each round trip below is one pool's alone
    submit, collect = WorkerPool.submit, WorkerPool.collect

    def timed_submit(pool: WorkerPool, *args: Any, **kwargs: Any) -> None:
        # The oracle runs between submit and collect, while the ranks work: it is inside the trip.
        pool._breakdown = (time.perf_counter(), stages.by_level[stages.level]["oracle"])  # type: ignore[attr-defined]
        submit(pool, *args, **kwargs)

    def timed_collect(pool: WorkerPool) -> Any:
        out = collect(pool)
        start, oracle_before = pool._breakdown  # type: ignore[attr-defined]
        trip = time.perf_counter() - start
        stages.add("oracle inside round trips", stages.by_level[stages.level]["oracle"] - oracle_before)
        slowest = max(range(pool.world), key=lambda r: _RANK_SECONDS[3 * r])
        job, fwd, bwd = (_RANK_SECONDS[3 * slowest + k] for k in range(3))
        stages.add("round trips", trip)
        stages.add("  transport", trip - job)
        stages.add("  target forward", fwd)
        stages.add("  target backward", bwd)
        stages.add("  rest of the ranks' job", job - fwd - bwd)
        stages.add("round trips (count)", 1)
        stages.add("collectives (count)", max((len(r.trace) for r in out if isinstance(r, RankResult)), default=0))
        return out
    WorkerPool.submit = timed_submit  # type: ignore[method-assign]
    WorkerPool.collect = timed_collect  # type: ignore[method-assign]
    target = runner.target
    for level in ("kernel", "wrapper", "linear"):
        fn = getattr(target, level)
        if fn is not None:
            setattr(target, level, _rank_slot(1, fn))
    torch.autograd.backward = _rank_slot(2, torch.autograd.backward)
    runner.checks = {name: dataclasses.replace(chk, fn=stages.timed("checks", chk.fn, net_of="oracle"))
                     for name, chk in runner.checks.items()}
    assert load_target(target.spec) is target  # the ranks resolve the same (wrapped) target


_SUBMIT = WorkerPool.submit


def record_jobs() -> list[tuple[WorkerPool, tuple]]:
    """Every case job sent from now on, as (pool, the job's arguments)."""
    jobs: list[tuple[WorkerPool, tuple]] = []

    def recorded(pool: WorkerPool, fn_path: str, args_per_rank: list[tuple], deadline_s: float) -> None:
        if fn_path == runner_module.CASE_JOB:
            jobs.append((pool, args_per_rank[0]))
        _SUBMIT(pool, fn_path, args_per_rank, deadline_s)
    WorkerPool.submit = recorded  # type: ignore[method-assign]
    return jobs


def replayed(jobs: list[tuple[WorkerPool, tuple]], meter: bool) -> float:
    """Runs per second of the recorded jobs sent again one after the other (`meter` False: each
    without the memory meter)."""
    start = time.perf_counter()
    for pool, (case, spec, meter_memory) in jobs:
        pool.call(CASE_JOB, [(case, spec, meter_memory and meter)] * pool.world, 120)
    return len(jobs) / (time.perf_counter() - start)


def _processes(runner: Runner) -> list[int]:
    """This process, then every worker of the runner's pools."""
    return [os.getpid(), *(p.pid for pool in runner.pools.values() for p in pool.procs)]


def thread_cpu(pids: list[int]) -> dict[tuple[str, str], float]:
    """CPU seconds (user + system) so far of every thread of `pids` (the driver first), by (process
    role, thread kind)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[str, str], float] = defaultdict(float)
    for i, pid in enumerate(pids):
        role = "driver" if i == 0 else "ranks"
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            kind = "main" if tid == str(pid) else name if name.startswith(("gloo", "pt_gloo")) else "other"
            out[(role, kind)] += (int(fields[11]) + int(fields[12])) / tick
    return out


def breakdown_table(stages: Stages, tp: int, totals: dict[str, tuple[int, float, float]]) -> list[str]:
    rows = []
    for level, (n, wall, drawing) in totals.items():
        s = stages.by_level[level]
        known = s["oracle"] - s["oracle inside round trips"] + s["round trips"] + s["checks"]
        parts = [("drawing", drawing), ("oracle", s["oracle"]), ("round trips", s["round trips"]),
                 ("  transport", s["  transport"]), ("  target forward", s["  target forward"]),
                 ("  target backward", s["  target backward"]),
                 ("  rest of the ranks' job", s["  rest of the ranks' job"]),
                 ("checks", s["checks"]), ("bookkeeping", wall - known)]
        per = 1000.0 / max(n, 1)
        cells = " | ".join(f"{v * per:.2f}" for _, v in parts)
        rows.append(f"| {tp} | {level} | {n} | {s['round trips (count)'] / max(n, 1):.2f} | "
                    f"{s['collectives (count)'] / max(n, 1):.1f} | {cells} | "
                    f"{(wall + drawing) * per:.2f} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--breakdown", action="store_true", help="split a case's time into its stages (per TP, level)")
    p.add_argument("--replay", action="store_true",
                   help="send the same jobs again back to back, with and without the memory meter")
    p.add_argument("--threads", action="store_true", help="split the checked cases' CPU time by thread")
    p.add_argument("--tp", default="1,2,4")
    ns = p.parse_args()
    if ns.replay and ns.breakdown:
        p.error("--replay times the engine's own jobs: run it without --breakdown")
    runner = Runner("harness.targets.fused")
    stages = Stages()
    if ns.breakdown:
        instrument(runner, stages)
    replay = " replayed back to back (runs/s) | without the meter (runs/s) |" if ns.replay else ""
    print(machine_speed() + "\n")
    print("| TP | pool start-up (s) | bare all_reduce (ms) | distributed cases run | cases/s |" + replay)
    print("|---|---|---|---|---|" + ("---|---|" if ns.replay else ""))
    tables: list[str] = []
    cpu_tables: list[str] = []
    for tp in (int(t) for t in ns.tp.split(",")):
        stages.level = "start-up"  # the pool's start and the latency job: in no level's stages
        start = time.perf_counter()
        pool = runner.pool(tp)
        startup = time.perf_counter() - start
        job = f"{__name__}:all_reduce_seconds"
        latency = max(pool.run(job, 200 if tp > 1 else 1, deadline_s=120)) * 1000
        levels = {"kernel": (kernel_cases, ns.cases * 3 // 4), "wrapper": (wrapper_cases, ns.cases // 4)}
        if ns.breakdown:
            levels["linear"] = (linear_cases, ns.cases // 4)
        ran, took, totals = 0, 0.0, {}
        jobs = record_jobs() if ns.replay else []
        cpu_before = thread_cpu(_processes(runner)) if ns.threads else {}
        for level, (strategy, n) in levels.items():
            runs_before = runner.cases_run
            start = time.perf_counter()
            mix = draw(strategy(tp=st.just(tp)), n)
            drawing = time.perf_counter() - start
            stages.level = level
            start = time.perf_counter()
            for case in mix:
                runner.check(case)
            wall = time.perf_counter() - start
            totals[level] = (len(mix), wall, drawing)
            if level != "linear":  # the headline figure is the kernel and wrapper mix, as before
                took += wall
                ran += runner.cases_run - runs_before
        row = f"| {tp} | {startup:.2f} | {latency:.2f} | {ran} | {ran / took:.1f} |"
        if ns.replay:
            WorkerPool.submit = _SUBMIT  # type: ignore[method-assign]
            row += f" {replayed(jobs, True):.1f} | {replayed(jobs, False):.1f} |"
        print(row, flush=True)
        if ns.threads:
            # Pools started meanwhile (a twin's TP size) count from their start.
            used = {k: v - cpu_before.get(k, 0.0) for k, v in thread_cpu(_processes(runner)).items()}
            total, wall = sum(used.values()), sum(t[1] for t in totals.values())
            shares = (100 * sum(v for k, v in used.items() if k in keys) / total for keys in THREAD_COLUMNS.values())
            cpu_tables.append(f"| {tp} | {wall:.2f} | {total:.2f} | " + " | ".join(f"{x:.0f}%" for x in shares) + " |")
        if ns.breakdown:
            tables += breakdown_table(stages, tp, totals)
            stages.by_level.clear()
    if ns.threads:
        print("\nCPU of the checked cases (all levels), by thread:\n")
        print("| TP | wall (s) | CPU (s) | " + " | ".join(THREAD_COLUMNS) + " |")
        print("|---|---|---|" + "---|" * len(THREAD_COLUMNS))
        print("\n".join(cpu_tables))
    if ns.breakdown:
        print("\nMilliseconds per checked case (a case and the twins its checks ask for):\n")
        print("| TP | level | cases | round trips per case | traced collectives per case | drawing | oracle | "
              "round trips | transport | "
              "target forward | target backward | rest of the ranks' job | checks | bookkeeping | total |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(tables))
    runner.close()


if __name__ == "__main__":
    main()
