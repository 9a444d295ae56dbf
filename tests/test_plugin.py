"""The shipped suite as another repository uses it: `pytest --pyargs harness.conformance
--harness-target M` from a directory outside this checkout, through the installed `pytest11` entry
point; and the plugin inert in every other session there.

These few tests start a pytest (and its pools) of their own: that is what they test, the packaging.
They keep to `-k` selections and the smoke profile.
"""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BROKEN = '''\
"""One statistic left out of the all-reduce: the sum of exponentials is never reduced over the TP group."""
from harness.targets.fused import FusedLogProbEntropy


class ForgetsSumExp(FusedLogProbEntropy):
    def reduce_stats(self, stats, op, group):
        reduced = super().reduce_stats({k: v for k, v in stats.items() if k != "sumexp"}, op, group)
        return {**stats, **reduced}


ROUTINE = ForgetsSumExp()
calculate_log_probs_and_entropy = ROUTINE.calculate_log_probs_and_entropy
get_log_probs_and_entropy = ROUTINE.get_log_probs_and_entropy
'''


def _pytest(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m pytest ...` in `cwd`, with only `cwd` added to the path (and this checkout, which the
    installed package may point elsewhere than)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    env["PYTHONPATH"] = os.pathsep.join((str(cwd), str(REPO)))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--strict-markers", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _suite(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The shipped suite at the smoke profile, run from `cwd`."""
    return _pytest(cwd, "--pyargs", "harness.conformance", "--harness-profile", "smoke", *args, timeout=timeout)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    assert REPO not in tmp_path.parents
    return tmp_path


def _documented_example() -> str:
    """The complete example module of docs/check-your-routine.md, as printed there."""
    doc = (REPO / "docs" / "check-your-routine.md").read_text()
    block = doc.split("<!-- example: my_logprobs.py -->\n```python\n", 1)[1]
    return block.split("```", 1)[0]


def test_documented_example_passes_with_junit_xml(outside: Path) -> None:
    (outside / "my_logprobs.py").write_text(_documented_example())
    run = _suite(outside, "--harness-target", "my_logprobs", "--harness-tp", "2", "-k", "values and kernel-tp2",
                 "--junitxml", "report.xml")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    suite = ET.parse(outside / "report.xml").getroot().find("testsuite")
    names = {tc.get("name") for tc in suite.iter("testcase")}
    assert names == {"test_check[values-kernel-tp2]"}
    assert suite.get("failures") == "0" and suite.get("errors") == "0"


def test_one_broken_all_reduce_fails_readably(outside: Path) -> None:
    (outside / "my_broken_logprobs.py").write_text(BROKEN)
    run = _suite(outside, "--harness-target", "my_broken_logprobs", "--harness-tp", "2", "-k", "values and kernel")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    # The harness's shrunk case and its repro line; not Hypothesis's advice, which an installed suite cannot take.
    assert "FINDING [values] (kernel) shrunk, start from this one: kernel:tp=2,T=1," in run.stdout
    assert "rank 0 log_prob" in run.stdout and "reproduce_failure" not in run.stdout + run.stderr
    # The target came from the current directory: the repro line carries the PYTHONPATH the run used.
    assert f"repro: PYTHONPATH={outside}" in run.stdout
    assert " python -m harness repro --target my_broken_logprobs kernel:tp=2," in run.stdout
    assert "1 failed" in run.stdout


def test_log_prob_only_target_collects_what_it_can_compute(outside: Path) -> None:
    run = _suite(outside, "--harness-target", "harness.targets.peers.megatron", "--collect-only")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "target provides no entropy: cases needing it are not drawn" in run.stdout
    assert "wrapper" not in run.stdout.split("collected")[-1]
    # check's plan: one step over every TP size; the corpus entry by entry
    assert "test_check[values-kernel-tp1-tp2-tp4]" in run.stdout and "test_corpus[kernel-odd-vocab-tp2]" in run.stdout



USER_CONFTEST = '''\
from hypothesis import settings

settings.register_profile("ci", max_examples=7)
settings.load_profile("ci")


def pytest_addoption(parser):
    for name in ("--device", "--target", "--seed", "--profile", "--tp"):
        parser.addoption(name, default="users")
'''
USER_TESTS = '''\
import sys

from hypothesis import settings


def test_own_options(request):
    assert request.config.getoption("--device") == request.config.getoption("--tp") == "users"


def test_no_torch_imported():
    assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith(("torch", "harness")))


def test_own_hypothesis_profile_in_force():
    assert settings().max_examples == 7
'''


def test_plugin_is_inert_in_a_project_of_its_own(outside: Path) -> None:
    """A project declaring the options the CLI uses, with a Hypothesis profile named as the docs name
    theirs, runs its own suite untouched: no clash, no torch import, no header, its profile loaded."""
    (outside / "conftest.py").write_text(USER_CONFTEST)
    (outside / "test_own.py").write_text(USER_TESTS)
    run = _pytest(outside, "-q", timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 passed" in run.stdout and "harness:" not in run.stdout


def test_ini_keys_choose_the_target_and_checks_decided_before_drawing(outside: Path) -> None:
    """`harness_target` in the project's ini file is the session's target; a check the target cannot
    take is skipped before any case is drawn (no pool starts), its reason in the user's words, located
    at the suite's test, not in pytest's own code."""
    (outside / "conftest.py").write_text(USER_CONFTEST)
    (outside / "my_logprobs.py").write_text(_documented_example())
    (outside / "pytest.ini").write_text("[pytest]\nharness_target = my_logprobs\nharness_tp = 1\n")
    run = _suite(outside, "-k", "memory-budget and kernel", "-rs", timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "harness: target my_logprobs, levels kernel, TP [1], profile smoke" in run.stdout
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all("test_conformance.py" in line and "no `HARNESS_MEMORY_BUDGET`" in line for line in skipped)
    assert "_pytest" not in run.stdout
    bad = _suite(outside, "--collect-only", "-o", "harness_tp=two", timeout=120)
    assert bad.returncode == 4 and "ini harness_tp: --tp takes comma-separated" in bad.stderr, bad.stderr[-2000:]


USER_CASES = {
    "cases/__init__.py": "WHOSE = 'the user'\n",
    "cases/mine.py": "SHAPES = [(2, 3)]\n",
    "reference.py": "def log_prob(x):\n    return 'the user reference'\n",
    # The user's own code first, at conftest import (before the harness imports anything of its own).
    "conftest.py": "import cases\nimport cases.mine\nimport reference\n",
    # Here the harness's modules first, then the user's.
    "test_names.py": (
        "def test_harness_first_then_mine():\n"
        "    import harness.cases.case\n"
        "    import harness.reference\n"
        "    import cases\n"
        "    import reference\n"
        "    assert cases.WHOSE == 'the user' and reference.log_prob(0) == 'the user reference'\n"
        "    assert harness.cases.case.KernelCase and harness.reference.log_probs\n"
    ),
}


def test_a_repo_with_its_own_cases_and_reference_runs_beside_the_suite(outside: Path) -> None:
    """The harness's `cases/` and `reference/` install as `harness.cases` and `harness.reference`: a
    repository with a `cases` package and a `reference.py` of its own runs its tests and the shipped
    suite in one session, whichever imports first."""
    for name, text in USER_CASES.items():
        (outside / name).parent.mkdir(exist_ok=True)
        (outside / name).write_text(text)
    run = _pytest(outside, "test_names.py", "--pyargs", "harness.conformance", "--harness-target",
                  "harness.targets.fused", "--harness-tp", "1", "--harness-profile", "smoke",
                  "-k", "test_harness_first or values-kernel-tp1", "-q", timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout, run.stdout[-2000:]


USER_REPO = {
    # verl's kind of setup: its own file pattern, its own Hypothesis profile, its routine in its `tests` package.
    "pytest.ini": "[pytest]\npython_files = *_on_cpu.py\nharness_target = tests.my_logprobs\nharness_tp = 1\n"
                  "harness_profile = smoke\n",
    "conftest.py": "from hypothesis import settings\n\nsettings.register_profile('users', max_examples=7)\n"
                   "settings.load_profile('users')\n",
    "tests/__init__.py": "",
    "tests/test_mine_on_cpu.py": (
        "import os\nimport sys\n\nfrom hypothesis import settings\n\n\n"
        "def test_own_profile_and_own_tests_package():\n"
        "    import tests\n"
        "    assert settings().max_examples == 7\n"
        "    assert tests.__file__ == __file__.replace('test_mine_on_cpu.py', '__init__.py')\n"
        "    assert 'tests.my_logprobs' in sys.modules  # the suite's target, imported from here\n"
        f"    assert {str(REPO)!r} not in [os.path.realpath(p) for p in sys.path]  # the checkout is not\n"
    ),
}


def test_a_user_repo_of_its_own_setup_runs_its_tests_and_the_suite_on_its_own_target(outside: Path) -> None:
    """A repository with `python_files = *_on_cpu.py`, its own Hypothesis profile and its routine in its
    own `tests` package, run with a known file inside the harness's checkout (whose ini names the
    built-in routine), from an editable-style install (only the `harness` package on the path): the
    suite is collected, pytest's rootdir and ini are the repository's, its target and its profile
    are its own, and nothing of the checkout (its `tests`, its conftest) enters the session."""
    for name, text in USER_REPO.items():
        (outside / name).parent.mkdir(exist_ok=True)
        (outside / name).write_text(text)
    (outside / "tests" / "my_logprobs.py").write_text(_documented_example())
    site = outside.parent / f"{outside.name}-site"  # the package alone, as the editable install maps it
    site.mkdir()
    (site / "harness").symlink_to(REPO / "harness")
    known = REPO / "docs" / "examples" / "known-neginf.toml"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "harness.conformance",
                          "tests", "--harness-known", str(known), "-k", "on_cpu or values-kernel", "-v"],
                         cwd=outside, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"rootdir: {outside}" in run.stdout and "configfile: pytest.ini" in run.stdout, run.stdout[:1500]
    assert "harness: target tests.my_logprobs, levels kernel, TP [1], profile smoke" in run.stdout
    assert "test_mine_on_cpu.py::test_own_profile_and_own_tests_package PASSED" in run.stdout
    assert "test_check[values-kernel-tp1] PASSED" in run.stdout, run.stdout[-3000:]
