"""Runs cases through the worker pools and hands what the ranks observed to the checks.

case -> pool (every rank) -> RankResults -> Evidence -> `harness.checks.verdicts` -> findings
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any, Callable, cast

from harness.base import levels
from harness.base.errors import LaunchError, TargetError
from harness.base.options import COLLECTIVE_TIMEOUT_S, RunConfig
from harness.cases.case import Case
from harness.checks import Check, Evidence, all_checks, oracle
from harness.checks.families import context_of, plain
from harness.checks.findings import Finding, repro_command
from harness.checks.known import load as load_known
from harness.checks.problems import GRADIENT, output_of
from harness.checks.terms import gradient_terms, split_by_term
from harness.checks.use import parse_use
from harness.checks.verdicts import Judged, Verdicts
from harness.driver import torchrun
from harness.driver.pool import COMPILE_BOUND_S, STARTUP_TIMEOUT_S, WorkerPool, meanwhile
from harness.engine.executor import CASE_JOB
from harness.engine.observations import RankResult
from harness.targets import Target, load_target, repro_env
from harness.targets.peers import absent_here

CACHE_SIZE = 4096


def by_group(results: list[RankResult]) -> list[RankResult]:
    """Every rank's result, TP group by TP group (DP replica, then CP rank), each in TP-rank order:
    the checks evaluate every group, each against the oracle of its own replica's data and CP rank
    (`Evidence.expected_for`), so a routine that takes the world rank for its TP rank shows on the
    groups that do not start at world rank 0."""
    return sorted(results, key=lambda r: (r.replica, r.cp_rank, r.rank))


def _reads_memory(chk: Check) -> bool:
    """Whether a check reads what the meters measure: memory figures (of the call, or of the kernel
    pass a wrapper case makes) or matmul work, counted with them."""
    return bool({"memory", "call-memory", "work"} & set(chk.reads))


def _deaths(results: list[RankResult]) -> list[RankResult]:
    """The ranks that died in a job (the pool has been rebuilt since: `WorkerPool.collect`)."""
    return [r for r in results if r.error_kind == "died"]


def _own_deaths(results: list[RankResult]) -> list[RankResult]:
    """The deaths in a job that the harness did not cause (`WorkerPool.close` kills the ranks it replaces)."""
    return [r for r in _deaths(results) if "killed by the harness" not in str(r.error)]


CONFIRMED = "confirmed on re-run in a fresh pool"
EXITED_ZERO = "exit code 0 is no signal: the process's own code exited"
RECURRED = "deaths recur across cases, which no stray kill does"


def _needs_rebuild(results: list[RankResult]) -> bool:
    """Ranks whose collectives diverged may leave unmatched operations in flight: start the next
    case on a fresh group. Exceptions after identical collectives leave the group consistent."""
    return any(r.trace != results[0].trace for r in results)




# Pools per size on CPU: the case's own, and one more for the twins of its size that its checks
# ask for (`Runner.run_together`).
LANES = 2
# The cores this process may use (`taskset` included): jobs run together while their ranks fit.
CORES = len(os.sched_getaffinity(0))


def _pool_key(tp: int, dp: int, cp: int) -> Any:
    """A pool's key in `Runner.pools` (shared with a test session's): `tp`, `(tp, dp)` for DP > 1,
    `(tp, cp, dp)` for CP > 1."""
    return tp if dp == cp == 1 else (tp, dp) if cp == 1 else (tp, cp, dp)


def _workers(pool: WorkerPool) -> tuple[int, ...]:
    """The pool's worker processes as they are now (a restart replaces them)."""
    return tuple(p.pid for p in pool.procs)


class Runner:
    """Owns the persistent pools of one target (one per TP, CP and DP size, and a second one of a
    size where a case and its twin run together); reusable for any number of cases."""

    def __init__(self, target_spec: str, device: str = "cpu", collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 checks: dict[str, Check] | None = None, pools: dict[Any, WorkerPool] | None = None,
                 case_timeout_s: float | None = None, bitwise: bool = False):
        """`pools`: pools to share with other runners (a test session's); None: own ones, closed by `close`.
        `case_timeout_s`: fixed case deadline for the pools this runner starts (None: scaled to their cost).
        `bitwise`: include the opt-in bitwise checks (when `checks` is None)."""
        self.target: Target = load_target(target_spec)
        self.repro_env = repro_env(self.target)  # "PYTHONPATH=... " when the target came from here
        unavailable = self.target.unavailable(device) or absent_here(self.target.spec)
        if unavailable:
            raise TargetError(unavailable)
        self.target = self.target.on(device)  # what it can do on this device decides what is drawn
        self.device = device
        # A compiled routine's rank may compile for longer than a collective's timeout while its
        # peers wait in that collective: the gloo/NCCL timeout is the backstop, stuck ranks are
        # found by evidence, so a compiled routine's backstop is the compile bound.
        self.collective_timeout_s = collective_timeout_s if self.target.supports("eager") \
            else max(collective_timeout_s, COMPILE_BOUND_S)
        self.case_timeout_s = case_timeout_s
        self.checks = checks if checks is not None else all_checks(bitwise=bitwise)
        self.pools: dict[Any, WorkerPool] = pools if pools is not None else {}  # keyed by `_pool_key`
        self._owns_pools = pools is None
        self.cases_run = 0
        self.run_seconds = 0.0
        self._cache: OrderedDict[Case, Evidence] = OrderedDict()
        self._unmetered: set[Case] = set()  # cached cases run without the memory meter
        self._called_on: set[Any] = set()  # the worker processes this runner's target has been called on
        # what the checks concluded (harness.checks.verdicts), each finding in or beyond the target's use
        self.verdicts = Verdicts(use=parse_use(self.target.spec, self.target.use))
        self._probes: dict[tuple[str, Case], list[str] | None] = {}  # (check, case) -> its problems (`probe`)
        self._in_flight = False  # a job is on the pools: the main process's work may not start another
        self.events: list[str] = []  # infrastructure events: what went wrong that is not the routine's doing
        self._death_cases: list[str] = []  # the cases of this run in which a rank died (`_rerun_death`)
        self._death_events: list[str] = []  # the events those deaths gave, until a death is a finding

    @classmethod
    def for_run(cls, cfg: RunConfig, target: str | None = None) -> "Runner":
        runner = cls(target or cfg.target, cfg.device, cfg.collective_timeout_s, pools=cfg.pools,
                     case_timeout_s=cfg.case_timeout_s, bitwise=cfg.bitwise)
        if cfg.known:
            runner.verdicts.known = load_known(cfg.known)
        return runner

    def pool(self, tp: int, dp: int = 1, cp: int = 1) -> WorkerPool:
        """The pool of TP-`tp` groups, `cp` x `dp` of them in one world (keyed by `_pool_key`)."""
        key = _pool_key(tp, dp, cp)
        if key not in self.pools:
            # under torchrun: the launched ranks instead of a pool of our own (one TP group per world)
            if cp > 1 and torchrun.active():
                raise LaunchError(f"a launched world has no context-parallel groups: run CP {cp} cases without "
                                  f"the launcher")
            shared = torchrun.pool(tp) if cp == 1 else None  # a LaunchedPool has WorkerPool's interface
            self.pools[key] = cast(WorkerPool, shared) if shared is not None else WorkerPool(
                tp, self.device, self.collective_timeout_s, dp=dp, case_timeout_s=self.case_timeout_s, cp=cp)
        return self.pools[key]

    def fit(self, case: Case) -> Case:
        """The case as this target can take it (its declared capabilities: `cases.capabilities`)."""
        return levels.fit(case, self.target.supports)

    def run(self, case: Case, while_waiting: Callable[[], Any] | None = None, meter_memory: bool = True) -> Evidence:
        """Run a case on every rank of its pool. Results are cached per case: checks that share
        draws (pytest ids of one group, twins) share one distributed run. `while_waiting`: work
        for the main process while the ranks run (the case's oracle, when it will be checked).
        `meter_memory` False: without the memory meter, for a run no memory check reads (a
        metered run is cached for both; an unmetered one is run again when figures are asked for)."""
        case = self.fit(case)
        self.run_together([(case, meter_memory)], while_waiting)
        return self._cache[case]

    def run_together(self, runs: list[tuple[Case, bool]],
                     while_waiting: Callable[[], Any] | None = None) -> list[tuple[Case, bool]]:
        """Run cases (each with its `meter_memory`) at the same time while their ranks fit in the
        cores (`CORES`), each on a free pool of its size: the first on its size's first pool, a
        case of a size already taken on a second pool of that size (`LANES`). Returns the runs
        that did not fit, for the caller to run next (the first run always fits). Results go to
        the cache; a case the cache answers is not run. On two cores a gloo collective keeps its
        ranks busy (its TCP loop thread mostly in system calls), so a TP 2 case fills the machine
        and runs alone; a 16-core runner checks a TP 4 case, its TP 4 twin and its TP 1 twin at once."""
        taken: set[int] = set()
        jobs: list[tuple[Case, Any, bool]] = []
        later: list[tuple[Case, bool]] = []
        for case, meter_memory in runs:
            case = self.fit(case)
            if self._cached(case, meter_memory) or any(job[0] == case for job in jobs):
                continue
            pool = self._free_pool(case, taken, sum(len(job[1].procs) for job in jobs))
            if pool is None:
                later.append((case, meter_memory))
                continue
            taken.add(id(pool))
            jobs.append((case, pool, meter_memory))
        if not jobs:
            return later
        start = time.perf_counter()
        for case, pool, meter_memory in jobs:
            if isinstance(pool, WorkerPool):
                pool.submit(CASE_JOB, [(case, self.target.spec, meter_memory)] * pool.world, self._deadline(pool))
            else:  # a launched world answers a job in one call (the driver is one of its ranks)
                self._store(case, pool, meter_memory,
                            pool.run(CASE_JOB, case, self.target.spec, meter_memory, while_waiting=while_waiting))
                while_waiting = None
        self._in_flight = True
        try:
            meanwhile(while_waiting)
        finally:
            self._in_flight = False
        for case, pool, meter_memory in jobs:
            if isinstance(pool, WorkerPool):
                self._store(case, pool, meter_memory, pool.collect())
        self.run_seconds += time.perf_counter() - start
        return later

    def _cached(self, case: Case, meter_memory: bool) -> bool:
        if case in self._cache and not (meter_memory and case in self._unmetered):
            self._cache.move_to_end(case)
            return True
        return False

    def _free_pool(self, case: Case, taken: set[int], busy_ranks: int) -> Any:
        """A pool of the case's size not in `taken` (ids), started if need be, when the cores
        left by `busy_ranks` ranks already at work are enough for it; None otherwise."""
        cp = getattr(case, "cp", 1)
        first = self.pool(case.tp, case.dp, cp)
        if busy_ranks and busy_ranks + len(first.procs) > CORES:
            return None  # ranks sharing cores take turns: running together would gain nothing
        if id(first) not in taken:
            return first
        if not isinstance(first, WorkerPool) or first.backend != "gloo":
            return None  # a launched world is fixed; GPU pools are not doubled (one device's memory)
        for lane in range(1, LANES):
            key = ("lane", lane, _pool_key(case.tp, case.dp, cp))
            if key not in self.pools:
                self.pools[key] = WorkerPool(case.tp, self.device, self.collective_timeout_s, dp=case.dp,
                                             case_timeout_s=self.case_timeout_s, cp=cp)
            if id(self.pools[key]) not in taken:
                return self.pools[key]
        return None

    def _deadline(self, pool: WorkerPool) -> float:
        """The job deadline: the pool's own, but start-up's for the target's first call on these
        workers and a compiled routine's for every call."""
        if pool.case_timeout_s is not None:
            return pool.case_deadline()
        if _workers(pool) not in self._called_on:
            # The target's first call on these workers imports what it calls (a peer pulling
            # in transformers), compiles, initialises: start-up, not the cost of a case.
            return max(pool.case_deadline(), STARTUP_TIMEOUT_S)
        if not self.target.supports("eager"):  # it compiles again for each new dtype, grad mode or size
            return max(pool.case_deadline(), COMPILE_BOUND_S)
        return pool.case_deadline()

    def _store(self, case: Case, pool: Any, meter_memory: bool, replies: list[RankResult]) -> None:
        results = by_group(replies)
        if isinstance(pool, WorkerPool):
            self._called_on.add(_workers(pool))  # a rebuilt pool's new workers start afresh
            if _deaths(results):
                results = self._rerun_death(case, pool, meter_memory, results)
            self.events += pool.events
            pool.events.clear()
        self.cases_run += 1
        if _needs_rebuild(results) and pool.procs:
            pool.restart()
        self._cache[case] = Evidence(case, self.target, results)
        self._cache.move_to_end(case)
        (self._unmetered.discard if meter_memory else self._unmetered.add)(case)
        if len(self._cache) > CACHE_SIZE:
            self._unmetered.discard(self._cache.popitem(last=False)[0])

    def _rerun_death(self, case: Case, pool: WorkerPool, meter_memory: bool,
                     results: list[RankResult]) -> list[RankResult]:
        """A rank died: the case again, once, on the fresh pool its death left. A death the harness
        did not cause is the routine's (`crash`) when the case dies again (the re-run's results are
        the case's, each death saying it was confirmed), when its process exited with code 0 (its
        own code exited: no signal does that), or when deaths recur across two or more cases of
        the run (a routine that ends its process every few calls passes the re-run, whose process
        counts its calls afresh; no stray kill recurs). Then the first run's results are the
        case's, each death saying why it is a finding. Otherwise the re-run's results stand and the
        death is an infrastructure event of the run, not a finding (a rank killed by something
        outside the routine: a signal from elsewhere, memory pressure), until another case dies."""
        again = by_group(pool.call(CASE_JOB, [(case, self.target.spec, meter_memory)] * pool.world,
                                   self._deadline(pool)))
        self._called_on.add(_workers(pool))
        first, died = _own_deaths(results), _own_deaths(again)
        reasons = [CONFIRMED] if died else [EXITED_ZERO] if any(r.exit_code == 0 for r in first) else []
        if first or died:
            self._death_cases.append(case.spec())
            if len(self._death_cases) > 1:
                reasons.append(RECURRED)
        if reasons:
            # The events of the earlier deaths are this finding's now, counted and the first named in it.
            self.events[:] = [e for e in self.events if e not in self._death_events]
            self._death_events.clear()
            n = len(self._death_cases)
            count = f"deaths in {n} case{'s' if n > 1 else ''} of this run" + (
                f", the first on {self._death_cases[0]}" if n > 1 else "")
            for r in died or first:
                r.error = f"{r.error}; {'; '.join(reasons)}; {count}"
            return again if died else results
        deaths = "; ".join(str(r.error) for r in _deaths(results))
        event = (f"{deaths} on {case.spec()}; the case ran again in a fresh pool "
                 + ("without a death" if not _deaths(again) else "and only the harness killed a rank")
                 + ": not a finding")
        self.events.append(event)
        self._death_events.append(event)
        return again

    def has_run(self, case: Case) -> bool:
        """Whether `run(case)` would be answered from the cache (costs nothing)."""
        return case in self._cache

    def executed(self) -> list[Evidence]:
        """The evidence of the cases run so far (the CACHE_SIZE most recently used), for summaries."""
        return list(self._cache.values())

    def check(self, case: Case, only: set[str] | None = None) -> tuple[Evidence, list[Finding]]:
        """Run one case (and the twins its checks ask for); evaluate every applicable check. The
        float64 oracle is computed while the ranks run the case, and each check is evaluated as
        soon as what it reads has run, while the ranks run the next twin: on two cores the
        driver's work then fills the time the ranks spend waiting on each other."""
        case = self.fit(case)
        applied = {name for name, chk in self.checks.items()
                   if (not only or name in only) and chk.applicable(case, self.target)}
        twins = {name: (twin, _reads_memory(self.checks[name])) for name in applied
                 if (make := self.checks[name].twin) is not None and (twin := make(case)) is not None}
        # The twins that may run in other processes run at the same time as the case, where the cores allow.
        alongside = [run for name, run in twins.items() if not self.checks[name].twin_in_same_process]
        later = self.run_together([(case, any(_reads_memory(self.checks[name]) for name in applied)), *alongside],
                                  while_waiting=lambda: oracle.expected(case))
        ev = Evidence(case, self.target, self._cache[case].ranks)  # fresh twins and margins for this evaluation
        # A twin still to run is run only for a check that can be evaluated: one whose stage the case
        # completed (a case that hung, died or raised leaves its twins nothing to be compared with).
        wanted = [name for name in twins if not (needs := self.checks[name].needs) or ev.completed(needs)]
        keep = {(self.fit(twins[name][0]), twins[name][1]) for name in wanted}
        later = [run for run in later if run in keep]
        later += [twins[name] for name in wanted if self.checks[name].twin_in_same_process]
        outcome: dict[str, list[Finding]] = {}
        waiting: dict[str, tuple[Judged, list]] = {}
        failures: list[Exception] = []

        def evaluate_ready() -> None:  # `meanwhile` would swallow an error of the harness's own: keep it
            try:
                self._evaluate(ev, applied, twins, outcome, only, False, waiting)
            except Exception as e:
                failures.append(e)

        for run in later:  # one at a time, each on its size's first pool
            self.run_together([run], while_waiting=evaluate_ready)
            if failures:
                raise failures[0]
        self._evaluate(ev, applied, twins, outcome, only, True, waiting)
        return ev, [f for name in self.checks for f in outcome.get(name, [])]

    def _evaluate(self, ev: Evidence, applied: set[str], twins: dict[str, tuple[Case, bool]],
                  outcome: dict[str, list[Finding]], only: set[str] | None, run_twins: bool,
                  waiting: dict[str, tuple[Judged, list]]) -> None:
        """Evaluate the checks not in `outcome` yet whose twins have run (all of them with
        `run_twins`, running any twin still missing); each check's new findings go to `outcome`. A
        check that fails while the ranks run another job waits in `waiting` (telling its families
        may run cases) and is counted on the pass with `run_twins`, when they are free."""
        repro = repro_command(self.target.spec, ev.case, self.repro_env)
        if run_twins:
            for name, (judged, margins) in waiting.items():
                outcome[name] = self._record(self.checks[name], ev, judged, repro, margins)
            waiting.clear()
        for chk in self.checks.values():
            if chk.name in outcome or chk.name in waiting:
                continue
            if chk.name not in applied:
                if not only or chk.name in only:
                    self.verdicts.not_applied(chk, ev)
                outcome[chk.name] = []
                continue
            if chk.name in twins:
                twin_case, meter_memory = twins[chk.name]
                if not run_twins and not self._cached(self.fit(twin_case), meter_memory):
                    continue
            outcome[chk.name] = []
            if chk.needs and not ev.completed(chk.needs):
                continue
            if chk.twin is not None:
                if chk.name not in twins:
                    continue
                twin = self.run(twin_case, meter_memory=meter_memory)
                if chk.needs and not twin.completed(chk.needs):
                    continue  # the twin's own crash is reported when it runs as a case
                ev.twins[chk.name] = twin
            first = len(ev.margins)
            judged = self.verdicts.evaluate(chk, ev)
            if judged.problems and not run_twins:
                waiting[chk.name] = (judged, ev.margins[first:])
                continue
            outcome[chk.name] = self._record(chk, ev, judged, repro, ev.margins[first:])

    def _record(self, chk: Check, ev: Evidence, judged: Judged, repro: str, margins: list) -> list[Finding]:
        groups = self.about(chk, ev, judged.problems) if judged.problems else []
        return self.verdicts.record(chk, ev, judged, groups, repro, margins)

    def probe(self, chk: Check, case: Case) -> list[str] | None:
        """`chk`'s problems on another case (with its twin), for telling a finding's family; not
        counted in the run's verdicts. None when the check does not apply to it or cannot judge it
        (a stage not completed). Each (check, case) is judged once per runner."""
        case = self.fit(case)
        key = (chk.name, case)
        if key not in self._probes:
            assert not self._in_flight, "a probe runs cases: never while the ranks run another job"
            self._probes[key] = self._judge_alone(chk, case) if chk.applicable(case, self.target) else None
        return self._probes[key]

    def _judge_alone(self, chk: Check, case: Case) -> list[str] | None:
        memory = _reads_memory(chk)
        ev = Evidence(case, self.target, self.run(case, meter_memory=memory).ranks)
        if chk.needs and not ev.completed(chk.needs):
            return None
        if chk.twin is not None:
            twin_case = chk.twin(case)
            if twin_case is None:
                return None
            twin = self.run(twin_case, meter_memory=memory)
            if chk.needs and not twin.completed(chk.needs):
                return None
            ev.twins[chk.name] = twin
        try:
            return chk.fn(ev)
        except Exception as e:  # as `Verdicts.judge` does
            return [f"the check could not evaluate the outputs: {type(e).__name__}: {e}"]

    def about(self, chk: Check, ev: Evidence, problems: list[str]) -> list[tuple[str, str, list[str]]]:
        """A failing check's problems split by family (`checks.families`): (term, context, problems).
        A `terms` check's problems go to the output each is about (`Problem.output`); a gradient's to
        the terms of the loss it comes from, told by the case with each term alone when both are in it
        (`terms.gradient_terms`).
        A call context is the family's when the same case on the plain path passes (or the check
        applies only in that context)."""
        by_term: dict[str, list[str]] = {}
        split = split_by_term(chk.terms, ev.case)
        for p in problems:
            output = output_of(p) if split else ""
            terms = self._gradient_terms(chk, ev.case) if output == GRADIENT else (output,)
            for term in terms or ("",):
                by_term.setdefault(term, []).append(p)
        return [(term, self._deciding_context(chk, ev.case, term), said) for term, said in by_term.items()]

    def _gradient_terms(self, chk: Check, case: Case) -> tuple[str, ...]:
        def wrong_alone(c: Case) -> bool | None:
            problems = self.probe(chk, c)
            return None if problems is None else any(output_of(p) == GRADIENT for p in problems)
        return gradient_terms(case, wrong_alone)

    def _deciding_context(self, chk: Check, case: Case, term: str) -> str:
        context = context_of(case)
        if not context:
            return ""
        problems = self.probe(chk, plain(case))
        if problems is None:  # the check applies only in that context, or its plain case cannot be judged
            return context
        same = [p for p in problems if not split_by_term(chk.terms, case) or output_of(p) in (term, GRADIENT)]
        return "" if same else context

    def explain(self, findings: list[Finding]) -> list[Finding]:
        """Lead each finding's message with what its check's `explain` adds (which loss term a wrong
        gradient comes from, from the same case run with each term alone). It runs more cases, so
        it is for the findings a run reports, not for every failing case met while exploring."""
        for f in findings:
            chk = self.checks.get(f.check)
            if chk is None or chk.explain is None:
                continue
            case = levels.parse(f.case)
            related = {role: Evidence(self.fit(c), self.target, self.run(c).ranks)
                       for role, c in chk.explain.related(case, self.target).items()}
            note = chk.explain.say(Evidence(case, self.target, self.run(case).ranks), related)
            if note:
                f.message = f"{note}; {f.message}"[:4000]
        return findings

    def close(self) -> None:
        if self._owns_pools:
            for pool in self.pools.values():
                pool.close()
            self.pools.clear()
