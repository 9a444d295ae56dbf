"""A repro line that works from anywhere. A target written in a temporary folder is checked by module
name from its own folder (the current directory) and by file path from another one, and each
printed repro line, run as printed from a third directory, reproduces the finding."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]

BROKEN = '''\
"""The built-in kernel with every log-prob off by 0.25: a defect at any TP size."""
from harness.targets.fused import calculate_log_probs_and_entropy as _fused


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    log_prob, entropy = _fused(logits, tokens, tp_group, with_entropy, chunk_size, log_prob_keep_mask,
                               with_entropy_grad)
    return log_prob + 0.25, entropy
'''


def _env() -> dict[str, str]:
    """The harness of this checkout on the path (as an install would give), `python` on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _check(cwd: Path, target: str) -> str:
    """`harness check` on `target` from `cwd`; the repro line of its first finding."""
    out = cwd / "r.json"
    run = subprocess.run([sys.executable, "-m", "harness", "check", "--target", target, "--tp", "1",
                          "--profile", "smoke", "-x", "--no-shrink", "--json", str(out)],
                         cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(out.read_text())["findings"][0]["repro"]


def _reproduces(line: str, cwd: Path) -> None:
    run = subprocess.run(["bash", "-c", line], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, line + "\n" + run.stdout[-2000:] + run.stderr[-2000:]
    assert "FINDING [values] (kernel)" in run.stdout and "rank 0 log_prob: worst at" in run.stdout


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path, Path]:
    own, other, third = tmp_path / "own", tmp_path / "other", tmp_path / "third"
    for d in (own, other, third):
        d.mkdir()
    (own / "mylp_broken.py").write_text(BROKEN)
    return own, other, third


def test_a_module_from_the_current_directory_gets_its_pythonpath_in_the_repro(folders):
    own, _, third = folders
    line = _check(own, "mylp_broken")
    assert line.startswith(f"PYTHONPATH={own}{os.pathsep}{REPO} python -m harness repro --target mylp_broken ")
    _reproduces(line, third)


def test_a_file_path_from_another_directory_is_named_absolutely_in_the_repro(folders):
    own, other, third = folders
    line = _check(other, "../own/mylp_broken.py")
    assert line.startswith(f"python -m harness repro --target {own / 'mylp_broken.py'} ")
    _reproduces(line, third)


def test_pool_workers_forked_before_the_file_existed_resolve_it(tmp_path, harness_pools, capsys):
    path = tmp_path / "mylp_pooled.py"
    path.write_text(BROKEN)
    spec = "kernel:tp=2,T=3,v_local=4"
    assert main(["repro", "--target", str(path), spec], pools=harness_pools) == 1
    assert "FINDING [values]" in capsys.readouterr().out


def test_a_missing_file_is_a_one_line_error(tmp_path, capsys):
    """`check` refuses it (exit 2); `repro` calls it untestable (exit 125), so that `git bisect run`
    skips a commit on which the routine's file does not exist yet."""
    assert main(["check", "--target", str(tmp_path / "nope.py"), "--profile", "smoke"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["repro", "--target", str(tmp_path / "nope.py"), "kernel:tp=1,T=1,v_local=1"]) == 125
    assert "no such file" in capsys.readouterr().err
