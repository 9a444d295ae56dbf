"""Under torchrun the launched ranks replace the harness's own pools (harness/driver/torchrun.py).

The torchrun runs below spawn processes of their own: they test the launcher route itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.base.errors import LaunchError
from harness.driver import torchrun as launched

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


@pytest.mark.slow
def test_pytest_route_on_two_launched_ranks(tmp_path: Path) -> None:
    """Rank 0 runs the session; rank 1 only serves its jobs, then exits with rank 0's code."""
    run = _torchrun(2, "-m", "pytest", "--pyargs", "harness.conformance", "-p", "no:cacheprovider", "--harness-tp", "2",
                    "--harness-profile", "smoke", "-k", "values and kernel", "-q", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count(" passed") == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(per_node: int, *args: str, timeout: float = 400) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents on this machine as two 'nodes' of `per_node` ranks each, joined by a
    c10d rendezvous, each running the same command. Every wait is bounded; both agents are killed
    on timeout."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "CI")}
    env["OMP_NUM_THREADS"] = "1"
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(per_node),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"harness{port}",
           "--max-restarts", "0", *args]
    agents = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    results = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate(timeout=30)
    return results


def _verdict(path: Path) -> tuple[int, set[str]]:
    result = json.loads(path.read_text())
    return len(result["findings"]), {f["check"] for f in result["findings"]}


def test_two_nodes_tp_within_and_across_nodes_match_the_pools(tmp_path: Path, harness_pools) -> None:
    """`check` on torchrun's ranks. TP 2 groups inside the 4-rank world (TP within a node, DP 2
    replicas across the nodes): the world-group defect is found, as on the harness's own DP pools.
    TP 2 across two nodes of one rank each: a correct routine (the unfused reference target, kernel
    and wrapper levels) passes, as on the pools; global rank 0 alone reports, and the TP-1
    reference of `tp-invariance` ran beside the launched ranks."""
    from harness import cli

    defect = ["check", "--target", "mutant:world-group-reduce", "--tp", "2", "--profile", "smoke", "-q", "-x", "--no-shrink"]
    launched = _two_nodes(2, "-m", "harness", *defect, "--json", str(tmp_path / "tp2.json"))
    assert [r.returncode for r in launched] == [1, 1], launched[0].stderr[-2000:] + launched[1].stderr[-2000:]
    wrong_values = {"values", "gradients", "tp-invariance", "wrapper-extraction", "wrapper-entropy", "wrapper-gradients"}
    count, checks = _verdict(tmp_path / "tp2.json")
    assert count and checks <= wrong_values, checks  # the replicas' data crossed: replica 0's values are wrong
    assert cli.main([*defect, "--json", str(tmp_path / "tp2-pool.json")], pools=harness_pools) == 1
    count, checks = _verdict(tmp_path / "tp2-pool.json")
    assert count and checks <= wrong_values, checks

    clean = ["check", "--target", "harness.targets.naive", "--tp", "2", "--profile", "smoke", "-q"]
    launched = _two_nodes(1, "-m", "harness", *clean, "--json", str(tmp_path / "across.json"))
    assert [r.returncode for r in launched] == [0, 0], launched[0].stderr[-2000:] + launched[1].stderr[-2000:]
    assert sum(r.stdout.count("0 finding(s)") for r in launched) == 1  # global rank 0 alone reports
    assert json.loads((tmp_path / "across.json").read_text())["checks"]["tp-invariance"]["kernel"]["applied"] > 0
    assert cli.main([*clean, "--json", str(tmp_path / "across-pool.json")], pools=harness_pools) == 0
    assert _verdict(tmp_path / "across.json") == _verdict(tmp_path / "across-pool.json") == (0, set())
