"""`python -m harness`: exit codes, option validation, findings with repro lines, JSON, shrinking.

The CLI runs in-process on the session's pools (`main(argv, pools=...)`); one test runs it as a
real subprocess to show that Ctrl-C leaves no process behind.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from harness.cases.case import parse_case
from harness.cli import main

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("argv", [
    ["check", "--tp", "0"], ["check", "--tp", "two"], ["check", "--tp", ""], ["check", "--profile", "nope"],
    ["check", "--seed", "-1"], ["check", "--seed", "x"], ["repro"], ["frobnicate"],
])
def test_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("target, words", [
    ("tests.broken.neither", "defines none of the contract's functions"),
    ("tests.broken.bad_signature", "does not match the contract"),
    ("tests.broken.import_error", "cannot import target"),
    ("no.such.module", "cannot import target"),
    ("mutant:no-such-mutant", "unknown mutant"),
])
def test_unusable_target_is_a_one_line_error(target, words, capsys, harness_pools):
    assert main(["check", "--target", target, "--profile", "smoke"], pools=harness_pools) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error:") and words in err[0]


def test_bad_repro_case_is_a_usage_error(capsys, harness_pools):
    assert main(["repro", "kernel:tp=2,bogus=1"], pools=harness_pools) == 2
    assert "unknown case field 'bogus=1'" in capsys.readouterr().err


def test_clean_routine_passes_smoke_and_writes_json(tmp_path, capsys, harness_pools):
    out = tmp_path / "r.json"
    assert main(["check", "--profile", "smoke", "--tp", "1,2", "--json", str(out), "-q"], pools=harness_pools) == 0
    stdout = capsys.readouterr().out
    assert "cases/s" in stdout and "0 finding(s)" in stdout
    data = json.loads(out.read_text())
    assert data["target"] == "harness.targets.fused" and data["findings"] == []
    assert data["cases_run"] >= 20 and data["elapsed_s"] > 0
    assert data["checks"]["values"]["kernel"]["applied"] > 0


def test_broken_routine_is_reported_shrunk_with_a_working_repro(tmp_path, capsys, harness_pools):
    out = tmp_path / "r.json"
    code = main(["check", "--target", "mutant:missing-allreduce-sumexp", "--tp", "2", "--profile", "smoke",
                 "--json", str(out), "-q"], pools=harness_pools)
    assert code == 1
    findings = json.loads(out.read_text())["findings"]
    values = [f for f in findings if f["check"] == "values"]
    assert values, findings
    f = values[0]
    assert {"check", "level", "case", "message", "repro"} <= set(f)
    assert f["message"].startswith("rank 0 log_prob: worst at [") and "element(s) outside the bound" in f["message"]
    argv = shlex.split(f["repro"])
    assert argv[:4] == ["python", "-m", "harness", "repro"]
    capsys.readouterr()
    assert main(argv[3:], pools=harness_pools) == 1
    assert "[values]" in capsys.readouterr().out


def test_shrinking_reaches_a_small_case(harness_pools):
    from harness.driver.explorer import explore
    from harness.driver.runner import Runner

    runner = Runner("mutant:missing-allreduce-sumexp", pools=harness_pools)
    findings = explore(runner, "kernel", [2], max_examples=30, seed=1)
    values = next(f for f in findings if f.check == "values")
    case = parse_case(values.case)
    assert values.shrunk
    # A missing sum-exp reduction shows on one row, one token per shard, any dtype or regime.
    assert case.T == 1 and case.v_local <= 4 and case.mask == "none" and case.dtype == "fp32"


def test_ctrl_c_stops_the_run_and_leaves_no_process():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "harness", "check", "--profile", "thorough", "--tp", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the pool is up and cases are running
            line = proc.stderr.readline()
            if "randomized cases" in line:
                break
        children = _children(proc.pid)
        assert children, "the pool should be running"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    time.sleep(0.5)
    assert not [p for p in children if os.path.exists(f"/proc/{p}")], "workers outlived the run"


def test_an_error_raised_after_an_interrupt_still_ends_as_interrupted(monkeypatch, capsys):
    """Hypothesis, interrupted while it starts its engine, raises AssertionError, not the interrupt."""
    from harness import cli
    from harness.commands import check
    from harness.driver import lifecycle

    def broken(interrupted: bool):
        def command(ns, cfg):
            if interrupted:
                monkeypatch.setattr(lifecycle, "_interrupted", signal.SIGINT)  # as Ctrl-C's handler records it
            raise AssertionError("state._runner is not None")
        return command

    monkeypatch.setattr(check, "cmd_check", broken(interrupted=True))
    assert cli.main(["check", "--profile", "smoke"]) == 130
    assert "interrupted by SIGINT" in capsys.readouterr().err
    monkeypatch.setattr(lifecycle, "_interrupted", 0)
    monkeypatch.setattr(check, "cmd_check", broken(interrupted=False))
    with pytest.raises(AssertionError):  # without an interrupt, an error is an error
        cli.main(["check", "--profile", "smoke"])


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


PROBE_CHECK = '''\
"""A check in a module of its own, registered by nothing but its decorator."""
from harness.checks import check


@check("probe-new-module", evidence=("batch-rows",), needs=None)
def probe(ev):
    """Fails on every case: shows that the check ran."""
    return [f"the probe ran on {ev.case.T} rows"]
'''


def test_a_check_in_a_new_module_is_listed_and_runs_with_no_other_edit(tmp_path, monkeypatch, harness_pools, capsys):
    """A new file of `@check`s among the checks' modules is all it takes: `harness checks` lists it and
    a run evaluates it (the module is found, not named in a list)."""
    import harness.checks as checks_package

    (tmp_path / "probe_new_module.py").write_text(PROBE_CHECK)
    monkeypatch.setattr(checks_package, "__path__", [*checks_package.__path__, str(tmp_path)])
    try:
        assert main(["checks"]) == 0
        assert "probe-new-module  [kernel;" in capsys.readouterr().out
        assert main(["repro", "--target", "harness.targets.fused", "kernel:tp=1,T=2,v_local=3"], pools=harness_pools) == 1
        assert "FINDING [probe-new-module] (kernel)" in capsys.readouterr().out
    finally:
        checks_package.REGISTRY.pop("probe-new-module", None)
        sys.modules.pop("harness.checks.probe_new_module", None)
