"""A case and the twins its checks ask for run at the same time when the cores allow it
(`Runner.run_together`), one after the other when they do not; twins that compare what a process
keeps between calls run after the case, on its own pool."""
from __future__ import annotations

import dataclasses

import pytest

from harness.cases.case import parse_case
from harness.driver import runner as runner_module
from harness.driver.pool import WorkerPool
from harness.driver.runner import Runner

pytestmark = pytest.mark.distributed


@pytest.fixture
def jobs(monkeypatch):
    """What the driver sent and gathered, in order: ("submit" | "collect", pool)."""
    log: list[tuple[str, WorkerPool]] = []
    submit, collect = WorkerPool.submit, WorkerPool.collect

    def logged_submit(self, *args, **kwargs):
        log.append(("submit", self))
        return submit(self, *args, **kwargs)

    def logged_collect(self):
        log.append(("collect", self))
        return collect(self)

    monkeypatch.setattr(WorkerPool, "submit", logged_submit)
    monkeypatch.setattr(WorkerPool, "collect", logged_collect)
    return log


def test_a_twin_of_the_same_size_runs_alongside_on_a_second_pool(harness_pools, jobs, monkeypatch):
    monkeypatch.setattr(runner_module, "CORES", 8)
    runner = Runner("harness.targets.fused", pools=harness_pools)
    case = parse_case("kernel:tp=1,T=6,v_local=7,chunk_size=2,seed=31")
    twin = runner.fit(case.replace(chunk_size=-1))  # chunk-invariance's twin
    _, findings = runner.check(case)
    assert findings == []
    assert [kind for kind, _ in jobs] == ["submit", "submit", "collect", "collect"]
    case_pool, twin_pool = jobs[0][1], jobs[1][1]
    assert case_pool is runner.pool(1) and twin_pool is not case_pool and twin_pool.tp == 1
    assert runner.has_run(twin)


def test_jobs_take_turns_when_their_ranks_would_share_cores(harness_pools, jobs, monkeypatch):
    """As under `taskset -c 0`: two cases on one core gain nothing from running together."""
    monkeypatch.setattr(runner_module, "CORES", 1)
    runner = Runner("harness.targets.fused", pools=harness_pools)
    _, findings = runner.check(parse_case("kernel:tp=1,T=6,v_local=7,chunk_size=2,seed=32"))
    assert findings == []
    assert [kind for kind, _ in jobs] == ["submit", "collect", "submit", "collect"]
    assert {id(pool) for _, pool in jobs} == {id(runner.pool(1))}


def test_a_twin_comparing_process_state_runs_after_the_case_on_its_pool(harness_pools, jobs, monkeypatch):
    """memory-metric-only compares what two calls retain: both run in the same worker processes."""
    monkeypatch.setattr(runner_module, "CORES", 8)
    runner = Runner("harness.targets.fused", pools=harness_pools)
    case = parse_case("kernel:tp=1,T=5,v_local=6,with_entropy=1,with_entropy_grad=0,seed=33")
    memory_twin = runner.fit(case.replace(with_entropy=False, with_entropy_grad=True, loss_terms="both"))
    runner.check(case, only={"memory-metric-only"})
    assert [kind for kind, _ in jobs] == ["submit", "collect", "submit", "collect"]
    assert jobs[0][1] is jobs[2][1] is runner.pool(1)
    assert runner.has_run(memory_twin)


def test_a_hanging_twin_alongside_its_case_is_found_and_both_pools_recover(harness_pools, monkeypatch):
    """A case and its twin that both hang on their collectives: each pool names its stuck ranks and
    is rebuilt; the next case runs."""
    monkeypatch.setattr(runner_module, "CORES", 8)
    runner = Runner("mutant:extra-allreduce-rank0-metric-only", pools=harness_pools)
    case = parse_case("kernel:tp=2,T=4,v_local=5,chunk_size=2,with_entropy=1,with_entropy_grad=0,seed=34")
    _, findings = runner.check(case)
    assert "hang" in {f.check for f in findings}
    twin = runner.run(runner.fit(case.replace(chunk_size=-1)))
    assert any(r.error_kind in ("stuck", "timeout") for r in twin.ranks)
    _, after = runner.check(parse_case("kernel:tp=2,T=3,v_local=4,seed=35"))
    assert after == []


def test_checks_are_evaluated_while_the_next_twin_runs(harness_pools, jobs, monkeypatch):
    """One job at a time (two cores at TP 2): the checks that need no twin are evaluated while the
    ranks run the first twin, each twin's check while the next twin runs; the findings come back
    in the registry's order whatever order they were evaluated in."""
    monkeypatch.setattr(runner_module, "CORES", 1)
    runner = Runner("harness.targets.fused", pools=harness_pools)

    def logged(chk):
        def fn(ev):
            jobs.append(("evaluate", chk.name))
            return chk.fn(ev)
        return dataclasses.replace(chk, fn=fn)

    runner.checks = {name: logged(chk) for name, chk in runner.checks.items()}
    case = parse_case("kernel:tp=2,T=6,v_local=7,chunk_size=2,seed=36")
    _, findings = runner.check(case)
    assert findings == []
    kinds = [kind for kind, _ in jobs]
    assert kinds[:2] == ["submit", "collect"]  # the case; its oracle is computed meanwhile
    second = kinds.index("submit", 2)  # the first twin
    evaluated_meanwhile = [what for kind, what in jobs[second:kinds.index("collect", second)] if kind == "evaluate"]
    assert "values" in evaluated_meanwhile and "chunk-invariance" not in evaluated_meanwhile
    assert {"chunk-invariance", "tp-invariance"} <= {what for kind, what in jobs if kind == "evaluate"}


def test_findings_keep_the_registry_order(harness_pools, monkeypatch):
    monkeypatch.setattr(runner_module, "CORES", 1)
    runner = Runner("mutant:wrong-shard-offset", pools=harness_pools)
    _, findings = runner.check(parse_case("kernel:tp=2,T=6,v_local=7,chunk_size=2,seed=37"))
    order = list(runner.checks)
    # values is evaluated while the first twin runs, tp-invariance once its twin has run
    assert {"values", "tp-invariance"} <= {f.check for f in findings}
    assert [f.check for f in findings] == sorted((f.check for f in findings), key=order.index)


def test_a_case_that_hangs_runs_no_twin_after_it(harness_pools, jobs, monkeypatch):
    """A twin is compared with its case's outputs: when the case hung, the twins still to run would
    only hang too (each costing a stack probe and a rebuilt pool), so none is sent."""
    monkeypatch.setattr(runner_module, "CORES", 1)
    runner = Runner("mutant:extra-allreduce-rank0-metric-only", pools=harness_pools)
    case = parse_case("kernel:tp=2,T=4,v_local=5,chunk_size=2,with_entropy=1,with_entropy_grad=0,seed=38")
    _, findings = runner.check(case)
    assert "hang" in {f.check for f in findings}
    assert [kind for kind, _ in jobs] == ["submit", "collect"]
    assert not runner.has_run(runner.fit(case.replace(chunk_size=-1)))  # chunk-invariance's twin
    assert not runner.has_run(runner.fit(case.replace(tp=1)))  # tp-invariance's
