"""Known findings (`--known FILE`): a finding an entry matches is reported apart and does not fail
the run; an entry that matched nothing is stale; `--strict` (pytest: `--strict-known`) fails on
either. From the CLI, from pytest, and in the file's validation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.base.errors import UsageError
from harness.cases.case import parse_case
from harness.checks.findings import Finding
from harness.checks.known import load
from harness.cli import main

MUTANT = "mutant:coef-ignored"  # entropy differentiable whatever entropy_coef: entropy-coef-rule, wrapper-gradients
COVERS_IT = '''
[[known]]
check = ["entropy-coef-rule", "wrapper-gradients", "memory-coef-zero"]
where = { entropy_coef = [0.0, -0.0, "absent"] }
reason = "coef ignored, fix under way"
link = "https://example.invalid/issue/1"
'''
STALE = '''
[[known]]
check = "finite"
where = { regime = "neginf", with_entropy = true }
reason = "NaN entropy at -inf logits"
'''


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "known.toml"
    path.write_text(text)
    return str(path)


def _finding(check: str, spec: str) -> Finding:
    return Finding(check, spec.partition(":")[0], spec, "msg", "repro")


def test_entries_match_case_fields_as_specs_write_them(tmp_path):
    known = load(_file(tmp_path, COVERS_IT + STALE))
    case = parse_case("wrapper:tp=2,v_local=5,total_lengths=6/4,response_lengths=3/2,entropy_coef=absent")
    assert known.classify(_finding("entropy-coef-rule", case.spec())) is known.entries[0]
    assert known.classify(_finding("entropy-coef-rule", case.replace(entropy_coef=0.5).spec())) is None
    assert known.classify(_finding("values", case.spec())) is None  # another check
    neginf = parse_case("kernel:tp=1,T=3,v_local=4,regime=neginf,with_entropy=1")
    assert known.classify(_finding("finite", neginf.spec())) is known.entries[1]
    assert known.classify(_finding("finite", neginf.replace(with_entropy=False).spec())) is None
    assert [e.matched for e in known.entries] == [1, 1] and not known.stale


@pytest.mark.parametrize("text, words", [
    ('[[known]]\ncheck = "no-such-check"\nreason = "x"\n', "unknown check"),
    ('[[known]]\ncheck = "values"\nwhere = { regim = "neginf" }\nreason = "x"\n', "unknown case field"),
    ('[[known]]\ncheck = "values"\n', "an entry has `check` and `reason`"),
    ('[[known]]\ncheck = "values"\nreason = "x"\nwhy = "y"\n', "an entry has `check` and `reason`"),
    ('[known]\ncheck = "values"\n', "an entry has"),
    ('check = "values"\n', "unexpected top-level key"),
    ("[[known]\n", "cannot read known findings"),
])
def test_a_bad_file_is_a_usage_error(tmp_path, text, words):
    with pytest.raises(UsageError, match=words):
        load(_file(tmp_path, text))


@pytest.mark.distributed
def test_cli_known_findings_do_not_fail_the_run(tmp_path, harness_pools, capsys):
    known, out = _file(tmp_path, COVERS_IT + STALE), tmp_path / "r.json"
    argv = ["check", "--target", MUTANT, "--tp", "2", "--profile", "smoke", "-q", "--known", known, "--json", str(out)]
    assert main(argv, pools=harness_pools) == 0
    printed = capsys.readouterr().out
    assert "KNOWN [entropy-coef-rule, wrapper-gradients, memory-coef-zero]" in printed
    assert "STALE known entry" in printed and "NaN entropy" in printed
    result = json.loads(out.read_text())
    assert result["findings"] == []
    assert result["known_findings"] and all(f["known"].startswith("[entropy-coef-rule") for f in result["known_findings"])
    assert result["known"]["stale"] == ["[finite] where regime = neginf, with_entropy = 1: NaN entropy at -inf logits"]
    assert result["checks"]["entropy-coef-rule"]["wrapper"]["known"] > 0
    assert main(argv + ["--strict"], pools=harness_pools) == 1  # known findings and a stale entry fail it
    assert main(argv + ["--fail-on", "any"], pools=harness_pools) == 1  # known findings fail it


@pytest.mark.distributed
def test_cli_new_findings_still_fail_beside_known_ones(tmp_path, harness_pools, capsys):
    only_zero = COVERS_IT.replace('[0.0, -0.0, "absent"]', "[0.0, -0.0]")  # an absent coefficient is new
    argv = ["check", "--target", MUTANT, "--tp", "2", "--profile", "smoke", "-q", "--known", _file(tmp_path, only_zero)]
    assert main(argv, pools=harness_pools) == 1
    assert "entropy_coef=absent" in capsys.readouterr().out


def test_pytest_known_findings_are_xfails(tmp_path):
    known = _file(tmp_path, COVERS_IT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # this checkout, wherever the package points

    def suite(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                               "--harness-profile", "smoke", "--harness-target", MUTANT, "--harness-tp", "2", "-k",
                               "coef-zero-metric-only", "--harness-known", known, "-rx", *extra], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240)

    run = suite()
    assert run.returncode == 0, run.stdout[-3000:]
    assert "1 xfailed" in run.stdout and "coef ignored, fix under way" in run.stdout
    assert "harness known findings" in run.stdout
    strict = suite("--harness-strict-known")
    assert strict.returncode == 1 and "1 failed" in strict.stdout


def test_pytest_ini_known_file_is_read_from_the_rootdir_and_fail_on_any_fails_known(tmp_path):
    """`harness_known` in the project's ini names a file relative to pytest's rootdir, whatever the
    working directory; `harness_fail_on = any` turns its known findings' expected failures into failures."""
    (tmp_path / "ci").mkdir()
    _file(tmp_path, COVERS_IT)
    (tmp_path / "pytest.ini").write_text(f"[pytest]\nharness_target = {MUTANT}\nharness_tp = 2\nharness_profile = smoke\n"
                                         "harness_known = known.toml\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])

    def suite(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                               "-k", "coef-zero-metric-only", "-rx", *extra], cwd=tmp_path / "ci", env=env,
                              capture_output=True, text=True, timeout=240)

    run = suite()
    assert run.returncode == 0 and "1 xfailed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    strict = suite("--harness-fail-on", "any")
    assert strict.returncode == 1 and "1 failed" in strict.stdout and "(--harness-fail-on any)" in strict.stdout


@pytest.mark.distributed
def test_documented_example_gates_the_neginf_defect(harness_pools, capsys):
    """docs/known-findings.md: the -inf defect is known, so the run passes; a routine without it
    makes the entry stale."""
    known = str(Path(__file__).resolve().parents[1] / "docs" / "examples" / "known-neginf.toml")
    argv = ["check", "--tp", "1,2", "--profile", "smoke", "-q", "--known", known]
    assert main(argv + ["--target", "mutant:entropy-nan-at-neginf"], pools=harness_pools) == 0
    assert "KNOWN [finite, values" in capsys.readouterr().out
    assert main(argv + ["--target", "harness.targets.fused"], pools=harness_pools) == 0
    assert "STALE known entry" in capsys.readouterr().out
    assert main(argv + ["--target", "harness.targets.fused", "--strict"], pools=harness_pools) == 1


@pytest.mark.distributed
def test_a_stopped_run_calls_no_entry_stale(harness_pools, capsys, tmp_path):
    """`-x` stops at the first finding: an entry the run never reached matched nothing, but is not
    stale; the JSON lists no stale entry and says the run stopped."""
    known = str(Path(__file__).resolve().parents[1] / "docs" / "examples" / "known-neginf.toml")
    out_json = tmp_path / "r.json"
    argv = ["check", "--target", MUTANT, "--tp", "1,2", "--profile", "smoke", "-q", "-x", "--known", known,
            "--json", str(out_json)]
    assert main(argv, pools=harness_pools) == 1  # the mutant's first finding, new
    out = capsys.readouterr().out
    assert "STALE" not in out, out[-2000:]
    assert "1 known entry matched nothing before the run stopped; not reported as stale" in out
    result = json.loads(out_json.read_text())
    assert result["known"]["stale"] == [] and result["known"]["stopped"] is True
