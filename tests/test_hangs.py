"""Hangs found in seconds by evidence, not by the collective timeout; a known hang is not re-hunted;
cancellation (SIGTERM) ends a run like Ctrl-C. Every wait here is bounded."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import cli
from harness.cases.case import KernelCase
from harness.checks import Evidence
from harness.checks.findings import Finding
from harness.driver import cpu_share
from harness.driver.cpu_share import SAMPLE_EVERY_S, CpuShare
from harness.driver.limits import EVERY_CASE_AFTER, RunLimits
from harness.driver.pool import CASE_FLOOR_S, MIN_MEASURED, WorkerPool
from harness.driver.runner import Runner
from harness.engine import stacks
from harness.engine.observations import RankResult
from harness.targets import load_target

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
HANG_MUTANT = "mutant:extra-allreduce-rank0-metric-only"
METRIC_ONLY = KernelCase(tp=2, T=3, v_local=4, with_entropy_grad=False, seed=1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stuck_rank_is_found_long_before_the_collective_timeout(harness_pools):
    """Rank 1 returns normally, rank 0 waits in an all-reduce rank 1 never joins (slime #1822):
    a `hang` finding naming rank 0 and the collective, in about a second, not after 30 s."""
    runner = Runner(HANG_MUTANT, collective_timeout_s=30, pools=harness_pools)
    runner.check(METRIC_ONLY.replace(with_entropy_grad=True))  # warm: the pool exists, the target is imported
    start = time.monotonic()
    ev, findings = runner.check(METRIC_ONLY)
    assert time.monotonic() - start < 10, "found by evidence, not by the 30 s collective timeout"
    checks = {f.check: f for f in findings}
    assert {"hang", "collectives"} <= set(checks), findings
    assert "crash" not in checks, "a rank that never returns is hang's finding, not crash's"
    msg = checks["hang"].message
    assert "rank 0 stuck in all_reduce(group=2, shape=[1], float32)" in msg
    assert "rank 1 had returned" in msg
    assert ev.ranks[0].error_kind == "stuck" and ev.ranks[1].error is None
    # The stuck rank's trace came from the progress board: its extra collective is the difference.
    assert len(ev.ranks[0].trace) == len(ev.ranks[1].trace) + 1
    assert "first difference at collective #3" in checks["collectives"].message
    # The pool was rebuilt: the next case runs clean.
    _, findings = runner.check(METRIC_ONLY.replace(with_entropy_grad=True, seed=2))
    assert not findings


def test_every_rank_blocked_is_stuck_too(harness_pools):
    """No rank returned, each blocked in a collective of another group: a deadlock, found in
    seconds although the collective timeout is long."""
    pool = WorkerPool(2, collective_timeout_s=60)
    try:
        start = time.monotonic()
        replies = pool.run("tests.pool_jobs:cross_blocked", deadline_s=60)
        assert time.monotonic() - start < 20
        assert [r.error_kind for r in replies] == ["stuck", "stuck"], replies
        assert "every rank was blocked in a collective" in replies[0].error
        assert pool.run("tests.pool_jobs:all_reduce_sum") == [3.0, 3.0]
    finally:
        pool.close()


def _waited_s(pid: int) -> float:
    """Seconds the threads of `pid` have spent runnable without a CPU (Linux's schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
            total += int(fh.read().split()[1])
    return total / 1e9


def _classified(*procs_per_core: int, until: float = 0.0) -> tuple[CpuShare, float]:
    """The CpuShare of one watched process, sampled for 1.2 s once every process has started (or, with
    `until`, until it has that many starved seconds, for at most 20 s), and the seconds the watched
    one actually waited for a CPU meanwhile: `procs_per_core[0]` is the watched one's kind (0 sleeps,
    1 spins), the rest are neighbours spinning on the same core."""
    spin, sleep = "print(flush=True)\nwhile True: pass", "import time; print(flush=True); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", spin if kind else sleep], stdout=subprocess.PIPE)
             for kind in procs_per_core]
    try:
        for p in procs:
            os.sched_setaffinity(p.pid, {min(os.sched_getaffinity(0))})
        for p in procs:  # its interpreter's start is work of its own, not the kind under test
            assert p.stdout is not None and select.select([p.stdout], [], [], 60)[0], "a process did not start"
            p.stdout.readline()
        waited = _waited_s(procs[0].pid)
        share = CpuShare([procs[0].pid], time.monotonic() - SAMPLE_EVERY_S)
        share.sample([0], time.monotonic())  # the first sight, from which the window counts
        end = time.monotonic() + (20 if until else 1.2)
        while time.monotonic() < end and not (until and share.starved_s > until):
            time.sleep(SAMPLE_EVERY_S / 2)
            share.sample([0], time.monotonic())
        return share, _waited_s(procs[0].pid) - waited
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_rank_starved_of_a_cpu_is_not_still_and_gets_more_time():
    """Stuck verdicts count only quiet time: a rank idle with no thread waiting for a CPU. One that
    works, or waits in the run queue behind CPU-bound neighbours (a loaded CI runner), is not
    still, and the time it waited, no more, moves its deadline on. Real processes: on a loaded
    machine a lone spinner waits for a CPU too, and gets that time; and Linux counts a wait only
    once it ends, so under load the starved one is sampled until its waits have been counted."""
    idle, _ = _classified(0)
    assert idle.quiet_s > 0.6 and idle.starved_s == 0
    working, waited = _classified(1)
    assert working.quiet_s == 0 and working.starved_s <= waited + 1e-6
    starved, waited = _classified(1, 1, 1, until=0.4)  # three spinning on one core: each waits two thirds of the time
    assert starved.quiet_s == 0 and 0.4 < starved.starved_s <= waited + 1e-6


def test_quiet_working_and_starved_time_are_told_apart_by_the_threads_schedstat(monkeypatch):
    """Each interval is judged by what the rank's threads did in it (schedstat given here, so no load
    can change the verdicts): idle, quiet; working, nothing; waiting for a CPU, the time waited; a
    thread runnable at the sample, whose wait so far Linux has not counted yet, is not quiet."""
    threads = {1: (0, 0, False), 2: (0, 0, False)}  # thread -> (ns run, ns waited for a CPU, runnable now)
    monkeypatch.setattr(cpu_share, "_threads", lambda pid: dict(threads))
    share, now = CpuShare([4242], 0.0), 0.0

    def interval(run: tuple[float, float], wait: tuple[float, float], runnable: bool = False) -> tuple[float, float]:
        nonlocal now
        now += 1.0
        for t, (ran, waited, _) in threads.items():
            threads[t] = (ran + int(run[t - 1] * 1e9), waited + int(wait[t - 1] * 1e9), runnable and t == 1)
        share.sample([0], now)
        return share.quiet_s, share.starved_s

    assert interval((0.0, 0.0), (0.0, 0.0)) == (0, 0)  # the first sight of the rank: nothing to compare yet
    assert interval((0.02, 0.03), (0.01, 0.0)) == (1.0, 0)  # blocked in a collective: its gloo loops barely run
    assert interval((0.5, 0.45), (0.05, 0.0)) == (1.0, 0)  # working on a core of its own
    assert interval((0.3, 0.0), (0.6, 0.2)) == pytest.approx((1.0, 0.6))  # a third of the time working, the rest waiting
    assert interval((0.01, 0.0), (0.4, 0.0)) == pytest.approx((1.0, 1.0))  # one thread runnable without a CPU
    assert interval((0.0, 0.0), (0.0, 0.0), runnable=True) == pytest.approx((1.0, 1.0))  # waiting all along
    assert interval((0.01, 0.0), (0.0, 0.0)) == pytest.approx((2.0, 1.0))
    monkeypatch.setattr(cpu_share, "_threads", lambda pid: {})  # no schedstat: the wall clock decides
    share.sample([0], now + 1.0)
    assert share.quiet_s == 2.0 + 1.0


def test_case_deadline_scales_with_the_measured_cost():
    pool = WorkerPool(1, collective_timeout_s=20)
    try:
        assert pool.case_deadline() == 50  # nothing measured yet: the backstop
        for _ in range(MIN_MEASURED):
            pool.run("tests.pool_jobs:whoami")
        assert pool.case_deadline() == CASE_FLOOR_S  # cheap jobs: the floor for slow targets
        pool.case_timeout_s = 1.5  # --case-timeout
        start = time.monotonic()
        replies = pool.run("tests.pool_jobs:sleep_everywhere")
        assert time.monotonic() - start < 10
        assert replies[0].error_kind == "timeout"
    finally:
        pool.close()


def test_rank_stuck_outside_any_collective_is_found_by_its_stack():
    """Every rank sleeps in its own code, in no collective (a routine hanging from its first call):
    stuck within seconds, by the stack, not at the 60 s deadline, and the finding says where."""
    pool = WorkerPool(2, collective_timeout_s=60)
    try:
        start = time.monotonic()
        replies = pool.run("tests.pool_jobs:sleep_everywhere", deadline_s=60)
        assert time.monotonic() - start < 20
        assert [r.error_kind for r in replies] == ["stuck", "stuck"], replies
        msg = replies[0].error
        assert "stuck in the routine's own code, outside any collective" in msg
        assert "sleeping or waiting" in msg and "pool_jobs.py" in msg and "in sleep_everywhere" in msg
        assert pool.run("tests.pool_jobs:all_reduce_sum") == [3.0, 3.0], "the pool was rebuilt"
    finally:
        pool.close()


def _probe_from_1s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stacks probed from a job's first second on, not its fifth: the same verdicts, seconds sooner."""
    monkeypatch.setattr(stacks, "PROBE_FLOOR_S", 1.0)


def test_a_rank_working_with_an_unchanging_stack_is_not_a_hang(monkeypatch):
    """A rank whose stack stays the same while it uses the CPU (a long C call, a loop on one line:
    the perf gate's timing loop was one) is working: it gets the deadline, not a stuck verdict."""
    _probe_from_1s(monkeypatch)
    pool = WorkerPool(1, collective_timeout_s=60)
    try:
        seconds = stacks.PROBE_FLOOR_S + (stacks.STILL_SAMPLES + 2) * stacks.PROBE_EVERY_S
        assert pool.run("tests.pool_jobs:busy_on_one_line", seconds, deadline_s=60) == [0]
    finally:
        pool.close()


def test_a_slow_import_is_not_a_hang(monkeypatch, tmp_path):
    """A call importing (or compiling) past its job's deadline is not hung: its import frames move the
    deadline on while they last (TRL's transformers import; a compile for a new dtype under load)."""
    _probe_from_1s(monkeypatch)
    (tmp_path / "harness_slow_module.py").write_text("import time\ntime.sleep(4.5)\n")
    pool = WorkerPool(1, collective_timeout_s=60)
    try:
        deadline = stacks.PROBE_FLOOR_S + 2 * stacks.PROBE_EVERY_S  # the stack is sampled before it passes
        assert pool.run("tests.pool_jobs:slow_import", str(tmp_path), deadline_s=deadline) == [0]
    finally:
        pool.close()


def test_a_rank_still_importing_after_another_raised_gets_to_finish(tmp_path):
    """The short grace after a rank raises is for ranks left waiting in a collective; a rank still
    importing or compiling is in none, and finishes (its own verdict, not a hang)."""
    (tmp_path / "harness_slow_module.py").write_text("import time\ntime.sleep(3.5)\n")  # past the grace
    pool = WorkerPool(2, collective_timeout_s=60)
    try:
        raised, imported = pool.run("tests.pool_jobs:raise_while_another_imports", str(tmp_path), deadline_s=60)
        assert raised.error_kind == "exception" and imported == 1, (raised, imported)
    finally:
        pool.close()


def test_an_import_still_running_at_the_case_timeout_says_so(monkeypatch, tmp_path):
    """The deadline moves on only up to the case timeout; a rank still importing there is reported as
    such, not as a rank stuck in the routine's code."""
    _probe_from_1s(monkeypatch)
    (tmp_path / "harness_slow_module.py").write_text("import time\ntime.sleep(30)\n")
    timeout = stacks.PROBE_FLOOR_S + 2 * stacks.PROBE_EVERY_S
    pool = WorkerPool(1, collective_timeout_s=60, case_timeout_s=timeout)
    try:
        (reply,) = pool.run("tests.pool_jobs:slow_import", str(tmp_path))
        assert reply.error_kind == "timeout", reply
        assert f"still importing or compiling when the case timeout of {timeout:.0f}s passed" in reply.error
    finally:
        pool.close()


def _ev(kinds: list[str | None], case: KernelCase = METRIC_ONLY) -> Evidence:
    return Evidence(case, load_target("harness.targets.fused"),
                    [RankResult(r, error=k and "x", error_kind=k) for r, k in enumerate(kinds)])


def test_run_limits_skip_known_hangs_and_targets_that_hang_everywhere():
    limits = RunLimits(max_findings=3)
    other = METRIC_ONLY.replace(T=5, seed=9)
    differentiable = METRIC_ONLY.replace(with_entropy_grad=True)
    limits.observe(_ev(["stuck", None]))
    assert limits.skip_reason(other) is None, "not shrunk yet: exploration still has to shrink it"
    assert "hang" in limits.skip_reason(other, unshrunk=True)  # the corpus moves on
    shrunk = Finding("hang", "kernel", METRIC_ONLY.spec(), "stuck", "repro", shrunk=True)
    limits.confirm_hang(shrunk, METRIC_ONLY)
    assert limits.skip(other) and not limits.skip(differentiable)
    assert limits.summary() == [f"skipped 1 case(s): metric-only entropy cases hang (shrunk finding: {METRIC_ONLY.spec()})"]
    # A hang reported once: the findings on another hung case of the class fold into the shrunk one.
    limits.observe(_ev(["stuck", None], other))
    elsewhere = Finding("hang", "kernel", other.spec(), "stuck", "repro")
    assert limits.final([elsewhere, shrunk]) == [shrunk]
    for _ in range(EVERY_CASE_AFTER):
        limits.observe(_ev(["timeout", "timeout"], differentiable))
    assert "hangs everywhere" in limits.skip_reason(differentiable)
    everywhere = Finding("hang", "kernel", differentiable.spec(), "timeout", "repro")
    assert limits.final([shrunk, everywhere]) == [shrunk], "hangs everywhere: one report"
    limits.record([shrunk, shrunk])
    assert not limits.reached()
    limits.record([shrunk])
    assert limits.reached()


def test_check_reports_a_hang_once_shrunk_and_runs_the_other_cases(harness_pools, tmp_path):
    out = tmp_path / "r.json"
    start = time.monotonic()
    code = cli.main(["check", "--target", HANG_MUTANT, "--tp", "2", "--profile", "smoke", "-q", "--json", str(out)],
                    pools=harness_pools)
    assert code == 1
    assert time.monotonic() - start < 120
    result = json.loads(out.read_text())
    hangs = [f for f in result["findings"] if f["check"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["shrunk"], result["findings"]
    assert "repro --target" in hangs[0]["repro"]
    assert sum(result["skipped"].values()) > 0
    assert all("metric-only entropy cases hang" in reason for reason in result["skipped"])
    assert {f["check"] for f in result["findings"]} <= {"hang", "collectives"}
    # The cases that do not hang got every other check.
    assert result["checks"]["values"]["kernel"]["applied"] > 10


def test_exitfirst_and_max_findings_stop_the_run(harness_pools, tmp_path):
    out = tmp_path / "r.json"
    code = cli.main(["check", "--target", "mutant:missing-allreduce-max", "--tp", "2", "--profile", "smoke", "-q",
                     "-x", "--json", str(out)], pools=harness_pools)
    first = json.loads(out.read_text())
    assert code == 1 and first["stopped_at_max_findings"]
    assert len({f["case"] for f in first["findings"]}) == 1, "stops after the first failing case"
    code = cli.main(["check", "--target", "mutant:missing-allreduce-max", "--tp", "2", "--profile", "smoke", "-q",
                     "--no-shrink", "--max-findings", "4", "--json", str(out)], pools=harness_pools)
    capped = json.loads(out.read_text())
    assert code == 1 and capped["stopped_at_max_findings"] and len(capped["findings"]) >= 4
    assert capped["cases_run"] < 60


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().split(")")[-1].split()[1]) == pid:
                        kids.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return kids


def test_sigterm_ends_the_run_like_ctrl_c(tmp_path):
    """A CI runner cancels with SIGTERM: one line, the findings so far in --json, exit 143, no
    worker left behind, no Hypothesis traceback."""
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "harness", "check", "--target", HANG_MUTANT, "--tp", "2",
                             "--collective-timeout", "6", "--json", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        lines = []
        while time.monotonic() < deadline:  # until exploration has begun (the corpus found the hang)
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "randomized cases" in line:
                break
        assert any("randomized cases" in x for x in lines), "".join(lines)
        time.sleep(1.0)  # mid-exploration: inside Hypothesis, perhaps inside a case
        workers = _children(proc.pid)
        assert workers, "the run has worker pools"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "Flaky" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("harness: interrupted by SIGTERM") and str(out) in last, last
    result = json.loads(out.read_text())
    assert result["interrupted"] == "SIGTERM"
    assert any(f["check"] == "hang" for f in result["findings"]), "the corpus's hang, found before the signal"
    time.sleep(0.5)
    assert not [p for p in workers if _alive(p)], "no worker outlives the run"
