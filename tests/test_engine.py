"""The distributed engine: persistent pools, hang/crash handling, collective traces, no leaks."""
from __future__ import annotations

import os
import time

import pytest
import torch

from harness.cases.case import KernelCase, WrapperCase, parse_case
from harness.driver import lifecycle
from harness.driver import pool as pool_module
from harness.driver.runner import Runner
from harness.engine.observations import RankResult

pytestmark = pytest.mark.distributed


def _state(pid: int | str) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _state(pid) != "Z"  # a zombie is dead for our purposes: it holds nothing but its exit status


@pytest.fixture
def tp2(harness_runner):
    return harness_runner.pool(2)


def test_pool_is_persistent_and_ranks_really_communicate(tp2):
    first = tp2.run("tests.pool_jobs:whoami")
    second = tp2.run("tests.pool_jobs:whoami")
    assert [r for r, _ in first] == [0, 1]
    assert first == second, "the same processes must serve every job"
    assert tp2.run("tests.pool_jobs:all_reduce_sum") == [3.0, 3.0]


def test_single_tensor_collectives_are_traced_once_under_the_name_called(tp2):
    # torch 2.13's all_gather_into_tensor is a deprecated wrapper around all_gather_single: a routine
    # using either is seen by the collectives checks, and the wrapper's call is not counted twice.
    expected = [("all_gather_single", 2, [4]), ("all_gather_into_tensor", 2, [4]), ("reduce_scatter_single", 2, [1])]
    assert tp2.run("tests.pool_jobs:traced_gathers") == [expected, expected]


def _wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of `pid`: how often it woke to do anything."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as fh:
            total += sum(int(line.split()[1]) for line in fh if line.startswith("voluntary_ctxt_switches"))
    return total


def _threads_stopped(pid: int) -> bool:
    """Every thread of `pid` stopped: the process's own state says T as soon as its main thread is."""
    return all(_state(f"{pid}/task/{tid}") == "T" for tid in os.listdir(f"/proc/{pid}/task"))


def test_idle_gloo_pool_is_stopped_between_jobs_and_costs_nothing(tp2):
    pids = [pid for _, pid in tp2.run("tests.pool_jobs:whoami")]
    deadline = time.monotonic() + 5  # a stop reaches each thread when it is next scheduled
    while not all(_threads_stopped(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(_threads_stopped(p) for p in pids), "an idle gloo pool must be stopped"
    before = [_wakeups(p) for p in pids]
    time.sleep(0.5)
    assert [_wakeups(p) for p in pids] == before, "a stopped rank's gloo loop threads must not wake"
    assert tp2.run("tests.pool_jobs:all_reduce_sum") == [3.0, 3.0], "a woken pool must work as before"


def test_driver_leaves_the_cores_to_its_cpu_ranks(monkeypatch):
    """While a gloo pool runs, the driver computes on one intra-op thread (its idle OpenMP threads
    would spin on the ranks' cores); once no CPU pool is left, its own setting comes back."""
    monkeypatch.setattr(lifecycle, "_LIVE", set())  # the session's pools stay out of this
    monkeypatch.setattr(lifecycle, "_DRIVER_THREADS", None)
    own = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool = pool_module.WorkerPool(1)
        try:
            assert torch.get_num_threads() == 1
            pool.restart()  # a rebuilt pool keeps it so
            assert torch.get_num_threads() == 1
        finally:
            pool.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(own)


def test_hung_rank_is_named_and_pool_rebuilt(tp2):
    old = [pid for _, pid in tp2.run("tests.pool_jobs:whoami")]
    start = time.monotonic()
    replies = tp2.run("tests.pool_jobs:hang_on", 1, deadline_s=2.0)
    assert time.monotonic() - start < 15
    assert replies[0] == 0
    assert isinstance(replies[1], RankResult) and replies[1].error_kind == "timeout"
    assert "rank 1" in replies[1].error
    new = [pid for _, pid in tp2.run("tests.pool_jobs:whoami")]
    assert set(new).isdisjoint(old), "a hung pool must be replaced"
    assert not any(_alive(p) for p in old), "the hung rank must not outlive its pool"


def test_dead_rank_is_named_and_pool_rebuilt(tp2):
    replies = tp2.run("tests.pool_jobs:die_on", 0, deadline_s=10.0)
    assert isinstance(replies[0], RankResult) and replies[0].error_kind == "died"
    assert "rank 0 died (exit code 3)" in replies[0].error
    assert tp2.run("tests.pool_jobs:all_reduce_sum") == [3.0, 3.0]


def test_rank_dying_while_its_peer_runs_is_named(tp2):
    """The stack watch keeps probing the ranks still running after one died."""
    replies = tp2.run("tests.pool_jobs:die_while_others_run", 0, deadline_s=10.0)
    assert isinstance(replies[0], RankResult) and "rank 0 died (exit code 3)" in replies[0].error
    assert replies[1] == 1
    assert tp2.run("tests.pool_jobs:all_reduce_sum") == [3.0, 3.0]


def test_raising_rank_is_reported_and_pool_keeps_working(tp2):
    replies = tp2.run("tests.pool_jobs:raise_on", 1)
    assert replies[0] == 0 and "ValueError: boom" in replies[1].error
    assert tp2.run("tests.pool_jobs:all_reduce_sum") == [3.0, 3.0]


def test_extra_all_reduce_on_rank0_is_a_collectives_finding(harness_pools):
    """Rank 0 issues one extra all-reduce in one configuration (odd-sized chunks)."""
    runner = Runner("mutant:rank-divergent-collective", collective_timeout_s=5, pools=harness_pools)
    start = time.monotonic()
    _, findings = runner.check(KernelCase(tp=2, T=3, v_local=4, with_entropy=True, seed=1))
    assert time.monotonic() - start < 30, "the divergent case must end within the timeouts"
    checks = {f.check: f for f in findings}
    assert "collectives" in checks
    msg = checks["collectives"].message
    assert "rank 0 issued" in msg and "rank 1 issued" in msg and "first difference" in msg
    # Even configurations issue matching collectives: no finding, and the rebuilt pool serves them.
    _, findings = runner.check(KernelCase(tp=2, T=4, v_local=4, with_entropy=True, seed=1))
    assert not findings
    pids = [pid for _, pid in harness_pools[2].run("tests.pool_jobs:whoami")]
    assert all(_alive(p) for p in pids)


def test_trace_records_every_collective_of_the_builtin(harness_runner):
    ev = harness_runner.run(KernelCase(tp=2, T=6, v_local=4, chunk_size=4, mask="random", seed=3))
    ops = [e[0] for e in ev.ranks[0].trace]
    # Two chunks x (one MAX of max and masked max, one SUM of sumexp, target, masked sumexp, entropy).
    assert ops == ["all_reduce"] * 4
    assert all(e[1] == 2 for e in ev.ranks[0].trace)
    assert ev.ranks[0].trace == ev.ranks[1].trace


def test_forward_observations_survive_a_backward_crash(harness_pools):
    """A routine that fails only in backward still gets its forward values checked."""
    runner = Runner("mutant:shard-boundary-off-by-one", collective_timeout_s=5, pools=harness_pools)
    _, findings = runner.check(parse_case("kernel:tp=2,T=6,v_local=7,seed=1754"))
    assert {"crash", "values"} <= {f.check for f in findings}


def test_memory_meter_runs_only_for_runs_a_memory_check_reads(harness_pools):
    """The meter's dispatch mode costs several times the call: the twins of value checks run
    without it; a run asked for with figures later is run again, metered."""
    runner = Runner("harness.targets.fused", pools=harness_pools)  # its own cache: nothing run before
    case = parse_case("kernel:tp=2,T=6,v_local=7,chunk_size=2,seed=1754")
    twin = runner.fit(case.replace(chunk_size=-1))  # chunk-invariance's, a values check
    ev, _ = runner.check(case)
    assert all(r.obs.memory for r in ev.ranks), "memory-budget reads the case's figures"
    assert runner.has_run(twin)
    assert not any(r.obs.memory for r in runner.run(twin, meter_memory=False).ranks)
    before = runner.cases_run
    assert all(r.obs.memory for r in runner.run(twin).ranks)
    assert runner.cases_run == before + 1
    assert runner.run(twin, meter_memory=False) is runner.run(twin)  # metered serves both


def test_case_results_are_cached_per_runner(harness_runner):
    case = WrapperCase(tp=2, v_local=3, total_lengths=(4,), response_lengths=(2,), seed=5)
    harness_runner.check(case)  # the case and any twins its checks ask for
    before = harness_runner.cases_run
    harness_runner.check(case)
    assert harness_runner.cases_run == before


def test_closed_pool_leaves_no_process():
    from harness.driver.pool import WorkerPool

    # A private pool on purpose: this test is about a pool's own shutdown.
    pool = WorkerPool(2)
    pids = [pid for _, pid in pool.run("tests.pool_jobs:whoami")]
    pool.close()
    assert not any(_alive(p) for p in pids)
