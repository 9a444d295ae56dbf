"""Under torchrun the launched ranks replace the harness's own pools (harness/engine/torchrun.py).

The torchrun runs below spawn processes of their own: they test the launcher route itself.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.engine import torchrun as launched
from harness.errors import LaunchError

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]  # = torchrun


def _torchrun(nproc: int, *args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "CI")}
    env["OMP_NUM_THREADS"] = "1"  # quiets torchrun's banner
    return subprocess.run([*TORCHRUN, str(nproc), "--standalone", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_active_only_under_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in launched.LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    assert not launched.active()
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert launched.active()
    assert launched.check_sizes([8]) == 8
    assert launched.check_sizes([2]) == 2  # DP 4 replicas of a TP-2 group
    with pytest.raises(LaunchError, match="--tp 8 for one TP group; one of 1, 2, 4, 8\\) \\(got --tp 1,2,4\\)"):
        launched.check_sizes([1, 2, 4])
    with pytest.raises(LaunchError, match="got --tp 3"):
        launched.check_sizes([3])


def test_cli_check_on_two_launched_ranks() -> None:
    run = _torchrun(2, "-m", "harness", "check", "--tp", "2", "--profile", "smoke", "-q")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("0 finding(s)") == 1  # rank 0 alone reports
    assert "tp-invariance" in run.stdout  # the TP-1 reference ran beside the launched ranks


@pytest.mark.slow
def test_pytest_route_on_two_launched_ranks(tmp_path: Path) -> None:
    """Rank 0 runs the session; rank 1 only serves its jobs, then exits with rank 0's code."""
    run = _torchrun(2, "-m", "pytest", "--pyargs", "harness.conformance", "-p", "no:cacheprovider", "--tp", "2",
                    "--profile", "smoke", "-k", "values and kernel and fp32", "-q", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count(" passed") == 1
