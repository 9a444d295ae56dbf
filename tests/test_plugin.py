"""The shipped suite as another repository uses it: `pytest --pyargs harness.conformance --target M`
from a directory outside this checkout, through the installed `pytest11` entry point.

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


def _suite(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m pytest --pyargs harness.conformance ...` in `cwd`, with only `cwd` added to the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    env["PYTHONPATH"] = str(cwd)
    return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                           "--strict-markers", "--profile", "smoke", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


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
    run = _suite(outside, "--target", "my_logprobs", "-k", "values and tp2 and fp32", "--junitxml", "report.xml")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    suite = ET.parse(outside / "report.xml").getroot().find("testsuite")
    names = {tc.get("name") for tc in suite.iter("testcase")}
    assert names == {"test_check[values-kernel-tp2-fp32-unmasked]", "test_check[values-kernel-tp2-fp32-masked]"}
    assert suite.get("failures") == "0" and suite.get("errors") == "0"


def test_one_broken_all_reduce_fails_readably(outside: Path) -> None:
    (outside / "my_broken_logprobs.py").write_text(BROKEN)
    run = _suite(outside, "--target", "my_broken_logprobs", "-k", "values and kernel and tp2 and fp32-unmasked")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    assert "[values] rank 0 log_prob" in run.stdout
    # The target came from the current directory: the repro line carries the PYTHONPATH the run used.
    assert f"repro: PYTHONPATH={outside} python -m harness repro --target my_broken_logprobs kernel:tp=2," in run.stdout
    assert "1 failed" in run.stdout


def test_log_prob_only_target_collects_what_it_can_compute(outside: Path) -> None:
    run = _suite(outside, "--target", "harness.targets.peers.megatron", "--collect-only")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "target provides no entropy: cases needing it are not drawn" in run.stdout
    assert "-masked]" not in run.stdout and "wrapper" not in run.stdout.split("collected")[-1]
    assert "test_check[values-kernel-tp4-bf16-unmasked]" in run.stdout

