"""What a call leaves behind in the trainer's process (`side-effects`), dying ranks named as
crashes with the run going on, and a failure only context parallelism brings named for what it is."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.cases.case import KernelCase, WrapperCase, parse_case
from harness.commands.mutate import CLEAN, kill_matrix, run_catalog
from harness.driver.runner import Runner
from harness.engine import state_watch

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
LEAKS = {"leaks-default-dtype-float64": "default dtype torch.float32 -> torch.float64",
         "leaks-grad-mode-off": "grad mode True -> False",
         "leaks-num-threads": "intra-op threads",
         "draws-global-rng": "CPU RNG state changed"}
FAULTS = {"rank-sigkilled": "died (exit code -9)", "rank-exits-zero": "died (exit code 0)",
          "rank-segfaults": "died (exit code -11)", "host-memory-error": "MemoryError"}
_KEPT: list = []  # a context entered and never left, as a routine that leaks it keeps it alive
CP_CASE = "wrapper:tp=1,v_local=5,total_lengths=8/5,response_lengths=6/3,entropy_coef=0.01,with_entropy=1,seed=2153,cp=2"


def _leave(change) -> list[str]:
    """The findings of one watched window in which `change` runs."""
    with state_watch.watching(CPU, "kernel") as watch, state_watch.watched("kernel forward"):
        change()
    return watch.findings


@pytest.mark.parametrize("change,named", [
    (lambda: torch.set_default_dtype(torch.float64), "default dtype torch.float32 -> torch.float64"),
    (lambda: torch.set_grad_enabled(False), "grad mode True -> False"),
    (lambda: torch.set_num_threads(torch.get_num_threads() + 1), "intra-op threads"),
    (lambda: torch.rand(1), "CPU RNG state changed"),
    (lambda: torch.use_deterministic_algorithms(True, warn_only=True),
     "deterministic algorithms (False, False) -> (True, True)"),
    (lambda: torch.set_float32_matmul_precision("medium"), "matmul precision float32_matmul_precision 'highest' -> 'medium'"),
    (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"), "matmul precision "),
    (lambda: torch.set_anomaly_enabled(True), "anomaly mode"),
    (lambda: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False),
     "matmul precision allow_bf16_reduced_precision_reduction (True, True) -> (False, True)"),
    (lambda: torch.set_default_device("meta"), "default device none set -> device(type='meta')"),
    (lambda: _KEPT.append(torch.inference_mode()) or _KEPT[-1].__enter__(), "inference mode False -> True"),
])
def test_each_leak_is_named_with_its_values_and_the_call_and_is_restored(change, named):
    before = state_watch.Watch(CPU, "kernel").snapshot()
    findings = _leave(change)
    # One finding per setting (inference mode turns grad mode off too: two).
    ours = [f for f in findings if f.startswith(named)]
    assert len(ours) == 1 and len(findings) <= 2, findings
    assert "after the kernel forward" in ours[0] and "(restored by the harness)" in ours[0]
    after = state_watch.Watch(CPU, "kernel").snapshot()
    assert before == after, "the harness put the state back"


def test_what_a_routine_restores_itself_is_no_finding():
    def forked_draw():
        with torch.random.fork_rng():
            torch.rand(3)

    def restored_dtype():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        torch.zeros(2)
        torch.set_default_dtype(old)

    def own_generator():
        torch.rand(3, generator=torch.Generator().manual_seed(1))

    def scoped_modes():
        with torch.no_grad(), torch.inference_mode(), torch.random.fork_rng():
            torch.set_num_threads(torch.get_num_threads())
            torch.randn(2)

    for call in (forked_draw, restored_dtype, own_generator, scoped_modes):
        assert _leave(call) == []


def test_a_call_that_raises_is_still_watched_and_restored():
    def leak_then_raise():
        torch.set_grad_enabled(False)
        raise ValueError("boom")

    with pytest.raises(ValueError), state_watch.watching(CPU, "wrapper") as watch, \
            state_watch.watched("wrapper forward"):
        leak_then_raise()
    assert torch.is_grad_enabled() and watch.findings[0].startswith("grad mode True -> False after the wrapper forward")


def test_outside_a_case_nothing_is_watched():
    """A timing job's calls run bare: no snapshot cost, nothing recorded."""
    assert state_watch._active is None
    with state_watch.watched("kernel forward"):
        torch.set_num_threads(torch.get_num_threads())


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(LEAKS))
def test_a_leak_is_side_effects_alone_and_later_cases_are_judged_cleanly(harness_pools, name):
    runner = Runner(f"mutant:{name}", pools=harness_pools)
    cases = [KernelCase(tp=1, T=5, v_local=8, with_entropy=True, seed=1),
             KernelCase(tp=2, T=4, v_local=6, with_entropy=True, seed=2, context="two_calls"),
             WrapperCase(tp=2, v_local=5, total_lengths=(6, 4), response_lengths=(3, 2), entropy_coef=0.01,
                         with_entropy=True, seed=3),
             KernelCase(tp=1, T=3, v_local=4, with_entropy=True, seed=4, dtype="bf16")]
    for case in cases:
        _, findings = runner.check(case)
        assert [f.check for f in findings] == ["side-effects"], [f"{f.check}: {f.message[:200]}" for f in findings]
        assert LEAKS[name] in findings[0].message


@pytest.mark.distributed
def test_fault_and_leak_mutants_are_killed_by_the_checks_they_name(harness_pools):
    results = run_catalog([*LEAKS, *FAULTS], [1, 2], harness_pools, budget=10, collective_timeout_s=6,
                          include_clean=False)
    survivors = [r.name for r in results if r.name != CLEAN and not r.ok]
    assert not survivors, kill_matrix(results)
    for r in results:
        if r.name in FAULTS:
            assert FAULTS[r.name] in r.fired["crash"].message, r.fired["crash"].message
        knock_on = {"hang", "collectives"} & set(r.fired)  # consequences of the dead rank, named in its crash
        assert not knock_on, (r.name, {c: r.fired[c].message for c in knock_on})


def _session_members(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().split(")")[-1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "rank-sigkilled" else pytest.mark.slow)
                                  for n in sorted(FAULTS)])
def test_a_dying_rank_is_a_crash_the_run_completes_and_no_process_is_left(tmp_path, name):
    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "harness", "check", "--target", f"mutant:{name}", "--tp", "2",
                             "--profile", "smoke", "-q", "-x", "--no-shrink", "--json", str(out)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    result = json.loads(out.read_text())
    crashes = [f for f in result["findings"] if f["check"] == "crash"]
    assert crashes and FAULTS[name] in crashes[0]["message"], result["findings"]
    assert "rank 1" in crashes[0]["message"]
    if "died" in FAULTS[name]:
        assert "confirmed on re-run in a fresh pool" in crashes[0]["message"], crashes[0]["message"]
    assert not [f for f in result["findings"] if f["check"] in ("hang", "collectives")], result["findings"]
    assert _session_members(proc.pid) == [], "every process the run started is gone once it returned"


@pytest.mark.distributed
def test_a_rank_killed_once_from_outside_is_an_event_not_a_crash(harness_pools):
    """A rank killed by a signal the routine did not send (here SIGHUP, once): the case runs again
    in a fresh pool and passes there, so the run reports an infrastructure event and no finding."""
    from tests.targets.dies_once import marker

    marker(os.getpid()).unlink(missing_ok=True)
    try:
        runner = Runner("tests.targets.dies_once", pools=harness_pools)
        _, findings = runner.check(parse_case("kernel:tp=2,T=5,v_local=4,dtype=fp32,regime=normal,with_entropy=1,seed=7"))
        assert marker(os.getpid()).exists(), "the routine's first call on rank 1 kills it"
    finally:
        marker(os.getpid()).unlink(missing_ok=True)
    assert findings == [], [f"{f.check}: {f.message[:300]}" for f in findings]
    assert len(runner.events) == 1 and "rank 1 died (exit code -1)" in runner.events[0], runner.events
    assert runner.events[0].endswith("ran again in a fresh pool without a death: not a finding")


def _kernel_case(seed: int) -> KernelCase:
    return KernelCase(tp=2, T=5, v_local=4, with_entropy=True, seed=seed)


def _died(finding) -> str:
    return finding.message[finding.message.index("rank 1 died: "):]


@pytest.mark.distributed
def test_a_process_exiting_zero_every_few_calls_is_a_crash_though_each_re_run_passes():
    """Rank 1's process exits with status 0 on its 4th call: the case's re-run in a fresh pool
    passes, yet exit code 0 is no signal's, so each such case is a `crash` saying at which call of
    the process it died and in how many cases of the run. Pools of its own: the call count is the
    process's."""
    runner = Runner("tests.targets.exits_on_nth_call")
    try:
        found = {seed: runner.check(_kernel_case(seed), only={"crash"})[1] for seed in range(8)}
    finally:
        runner.close()
    assert [seed for seed, fs in found.items() if fs] == [3, 7], found
    assert _died(found[3][0]) == ("rank 1 died: rank 1 died (exit code 0) during its 4th call; exit code 0 is no "
                                  "signal: the process's own code exited; deaths in 1 case of this run")
    assert _died(found[7][0]).startswith("rank 1 died: rank 1 died (exit code 0) during its 4th call; exit code 0 "
                                         "is no signal: the process's own code exited; deaths recur across cases, "
                                         "which no stray kill does; deaths in 2 cases of this run, the first on "
                                         + _kernel_case(3).spec()), _died(found[7][0])
    assert runner.events == []


@pytest.mark.distributed
def test_a_process_sigkilled_every_few_calls_is_a_crash_once_deaths_recur():
    """Rank 1's process is SIGKILLed on its 5th call: a signal, so its first death, whose re-run
    passes, is an infrastructure event; the second case that dies makes it a `crash` saying the
    call and the count, and the event is the finding's from then on."""
    runner = Runner("tests.targets.sigkilled_on_nth_call")
    try:
        found = {}
        for seed in range(9):
            found[seed] = runner.check(_kernel_case(seed), only={"crash"})[1]
            if seed == 4:
                assert len(runner.events) == 1 and "rank 1 died (exit code -9) during its 5th call" in runner.events[0]
    finally:
        runner.close()
    assert [seed for seed, fs in found.items() if fs] == [8], found
    assert _died(found[8][0]) == ("rank 1 died: rank 1 died (exit code -9) during its 5th call; deaths recur across "
                                  "cases, which no stray kill does; deaths in 2 cases of this run, the first on "
                                  + _kernel_case(4).spec())
    assert runner.events == []


@pytest.mark.distributed
@pytest.mark.parametrize("name, died", [("exits_on_nth_call", r"died \(exit code 0\) during its \d+(st|nd|rd|th) call; "
                                                              r"exit code 0 is no signal.*deaths in 1 case of this run"),
                                        ("sigkilled_on_nth_call", r"died \(exit code -9\) during its \d+(st|nd|rd|th) "
                                                                  r"call; deaths recur across cases.*deaths in 2 cases")])
def test_check_exits_1_on_a_routine_that_ends_its_process_every_few_calls(tmp_path, name, died):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "harness", "check", "--target", f"tests.targets.{name}", "--tp", "2",
                           "--profile", "smoke", "-q", "-x", "--no-shrink", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [f["check"] for f in result["findings"]] == ["crash"], result["findings"]
    assert re.search(died, result["findings"][0]["message"]), result["findings"][0]["message"]
    assert result["infrastructure_events"] == []


@pytest.mark.distributed
def test_a_raise_only_at_cp_names_the_capability_line_and_no_hang(harness_pools):
    runner = Runner("tests.targets.no_cp_raises", pools=harness_pools)
    findings = runner.explain(runner.check(parse_case(CP_CASE))[1])
    assert [f.check for f in findings] == ["crash"], [f"{f.check}: {f.message[:200]}" for f in findings]
    assert findings[0].message.startswith("it raised only at CP > 1")
    assert 'HARNESS_CAPABILITIES = {"context_parallel": False}' in findings[0].message


@pytest.mark.distributed
def test_a_raise_on_the_cp_path_of_a_wrapper_with_cp_is_its_defect_not_a_missing_capability(harness_pools):
    """A wrapper that asks parallel_state for its CP size implements CP: the capability line that
    declares no CP would hide the defect, so the finding says so instead of offering it."""
    runner = Runner("tests.targets.cp_path_raises", pools=harness_pools)
    findings = runner.explain(runner.check(parse_case(CP_CASE))[1])
    crash = next(f for f in findings if f.check == "crash")
    assert crash.message.startswith("it raised only at CP > 1")
    assert "implements context parallelism (it asks megatron-core's parallel_state" in crash.message
    assert "would only hide it" in crash.message


@pytest.mark.distributed
def test_the_harness_step_refusing_an_output_is_named_as_the_harness_s_not_a_crash(harness_pools):
    runner = Runner("tests.targets.no_cp_wrapper", pools=harness_pools)
    found = runner.explain(runner.check(parse_case(CP_CASE))[1])
    findings = {f.check: f for f in found}
    assert "crash" not in findings and "hang" not in findings, sorted(findings)
    # The log-probs' extraction (its family: the log-prob term, at CP > 1 only), as the step refused them.
    extraction = next(f for f in found if f.check == "wrapper-extraction" and f.term == "log-prob")
    assert extraction.context == "cp=zigzag"
    message = extraction.message
    assert message.startswith("wrong only at CP > 1")
    assert "the harness's loss step, not the routine, stopped here" in message
    assert "upstream gradient of the 2 response positions this CP rank's zigzag chunks hold" in message
