"""The C++ memory ledger's build: cached per environment, said while it builds, a failed build said
once with the fallback to the Python ledger, `HARNESS_LEDGER` choosing (`harness.meters.ledger_build`).

The builds here fail on purpose (a compiler that fails at once) in a scratch extensions folder; the
one real build is the environment's own, which the session's first pool start makes anyway.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.base.errors import UsageError
from harness.meters import ledger_build

REPO = Path(__file__).resolve().parents[1]
PROBE = "from harness.meters import memory_meter; print(memory_meter.ledger_name())"


def test_the_build_is_named_per_torch_python_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    here = ledger_build.extension_name()
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    other_env = ledger_build.extension_name()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    other_torch = ledger_build.extension_name()
    assert len({here, other_env, other_torch}) == 3
    assert all(n.startswith("harness_ledger_") for n in (here, other_env, other_torch))


def test_what_changes_the_compile_command_changes_the_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    here = ledger_build.extension_name()
    monkeypatch.setenv("CXX", "clang++")
    other_compiler = ledger_build.extension_name()
    (tmp_path / "ccache").write_text("#!/bin/sh\n")
    (tmp_path / "ccache").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    wrapped = ledger_build.extension_name()  # torch puts a ccache on PATH before the compiler
    assert len({here, other_compiler, wrapped}) == 3


def test_one_build_however_a_process_is_started(tmp_path: Path) -> None:
    """A process started from another folder, through another name of the interpreter, with another
    `ninja` first on PATH, loads the environment's build as it is: nothing rebuilt, no build said."""
    if ledger_build.chosen() == "python" or ledger_build.compiled() is None or ledger_build.ninja_folder() is None:
        pytest.skip("the C++ ledger is not built here, or the environment has no ninja of its own")
    built = ledger_build.build_directory(ledger_build.extension_name())
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir() if p.name != "harness.flock"}  # opened each time
    log = (built / ".ninja_log").read_text()
    other_ninja = tmp_path / "bin" / "ninja"  # what a PATH with another ninja first would run
    other_ninja.parent.mkdir()
    other_ninja.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'ran'}\nexit 1\n")
    other_ninja.chmod(0o755)
    alias = next((p for p in Path(sys.executable).parent.glob("python3*") if p.name != Path(sys.executable).name),
                 Path(sys.executable))
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "PATH": f"{other_ninja.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run([str(alias), "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "cpp", run.stderr[-2000:]
    assert "building the C++ memory ledger" not in run.stderr and not (tmp_path / "ran").exists()
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir() if p.name in before} == before
    assert (built / ".ninja_log").read_text() == log


def test_harness_ledger_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ledger_build.ENV, raising=False)
    assert ledger_build.chosen() is None
    monkeypatch.setenv(ledger_build.ENV, "Python")
    assert ledger_build.chosen() == "python"
    monkeypatch.setenv(ledger_build.ENV, "rust")
    with pytest.raises(UsageError, match="HARNESS_LEDGER='rust': one of cpp, python"):
        ledger_build.chosen()


def _probe(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "false", **env}
    return subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120,
                          check=False)


def test_a_failed_build_is_said_once_and_the_python_ledger_used(tmp_path: Path) -> None:
    run = _probe(tmp_path)
    assert run.returncode == 0 and run.stdout.strip() == "python", run.stderr[-2000:]
    assert run.stderr.count("building the C++ memory ledger for this environment") == 1
    assert run.stderr.count("the C++ memory ledger does not build (") == 1
    assert "the Python ledger is used" in run.stderr


def test_python_is_chosen_without_a_build_and_cpp_insists(tmp_path: Path) -> None:
    chosen = _probe(tmp_path, HARNESS_LEDGER="python")
    assert chosen.stdout.strip() == "python" and "C++" not in chosen.stderr, chosen.stderr[-2000:]
    assert not any(tmp_path.iterdir())  # nothing was built, or tried
    insisted = _probe(tmp_path, HARNESS_LEDGER="cpp")
    assert insisted.returncode != 0 and "HARNESS_LEDGER=cpp, but the C++ memory ledger does not build" in insisted.stderr


def test_a_lock_left_by_a_killed_build_does_not_block(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch waits forever on its build lock; one left behind by a killed build is removed, since every
    live build of ours holds the flock while torch's lock exists."""
    monkeypatch.setenv("CXX", "false")  # the probe's compiler, part of the build's name
    stale = tmp_path / ledger_build.extension_name() / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    run = _probe(tmp_path)
    assert run.returncode == 0 and run.stdout.strip() == "python", run.stderr[-2000:]
    assert "the C++ memory ledger does not build (" in run.stderr
    assert not stale.exists()  # the probe's build found it, and removed it


def test_each_checkout_names_its_own_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    here = ledger_build.extension_name()
    copy = tmp_path / "ledger.cpp"
    copy.write_bytes(ledger_build.SOURCE.read_bytes())
    monkeypatch.setattr(ledger_build, "SOURCE", copy)
    assert ledger_build.extension_name() != here
