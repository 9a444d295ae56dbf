"""Replaying a routine's git history: each commit's tree, exported (`git_trees`), is checked by
`harness check --json` in a process session of its own (`sessions`) with that tree first on
PYTHONPATH, `--jobs` at a time, each stopped after `--commit-timeout`; `repro_at_commit` re-runs one
case on one commit the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.base.errors import UsageError
from harness.driver.git_trees import Commit, Git
from harness.driver.sessions import Sessions, signals_ignored, stop_sessions

HARNESS_ROOT = Path(__file__).resolve().parents[2]  # what the checking processes import the harness from
STOP_GRACE_S = 15  # after SIGTERM, how long a timed-out check may take to write what it found
INTERRUPT_GRACE_S = 3  # after Ctrl-C or SIGTERM, how long the running checks get before SIGKILL: none is kept
STOPPED = "not checked: the run was stopped"
# Replays run eager: a routine whose trainer compiles it (torch.compile, megatron-core's jit_fuser)
# recompiles in every exported tree's fresh processes, minutes per commit where eager takes seconds,
# and a replay asks what each commit computes, not how its compiler fuses it (docs/history.md).
EAGER = {"TORCHDYNAMO_DISABLE": "1"}
ExtraArgs = Callable[[Commit, Path], list[str]]


@dataclass
class CommitOutcome:
    """One commit's check: `checked` (its result JSON kept), `untestable` (the check refused the
    target: not importable, no callable routine), or `error` (a timeout, a crash of the run)."""
    status: str
    seconds: float = 0.0
    reason: str = ""
    result: dict[str, Any] | None = field(default=None, repr=False)


def check_command(ns: argparse.Namespace, json_path: Path) -> list[str]:
    cmd = [sys.executable, "-m", "harness", "check", "--target", ns.target, "--profile", ns.profile,
           "--tp", ",".join(map(str, ns.tp)), "--device", ns.device, "--json", str(json_path), "-q"]
    if ns.seed is not None:
        cmd += ["--seed", str(ns.seed)]
    if ns.known:
        cmd += ["--known", str(Path(ns.known).resolve())]
    return cmd


def check_commit(git: Git, commit: Commit, ns: argparse.Namespace, workdir: Path, checks: Sessions,
                 extra_args: ExtraArgs | None = None) -> CommitOutcome:
    """`harness check` on one commit's tree, in its own process (session), stopped after
    `--commit-timeout` seconds: SIGTERM, so that it writes what it found, then SIGKILL.
    `extra_args(commit, workdir)`: more options of that commit's check (`history --perf`'s)."""
    if checks.stopped:
        return CommitOutcome("error", reason=STOPPED)
    tree = workdir / commit.short
    tree.mkdir()
    start = time.perf_counter()
    try:
        git.export(commit.sha, tree)
    except (UsageError, subprocess.SubprocessError) as e:
        return CommitOutcome("error", reason=f"cannot export the commit: {e}")
    out = workdir / f"{commit.short}.json"
    env = dict(os.environ, **EAGER, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), str(HARNESS_ROOT),
                                                                               os.environ.get("PYTHONPATH")])))
    with open(workdir / f"{commit.short}.log", "w+") as log:
        cmd = check_command(ns, out) + (extra_args(commit, workdir) if extra_args is not None else [])
        proc = checks.start(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
        if proc is None:
            return CommitOutcome("error", reason=STOPPED)
        try:
            code = proc.wait(timeout=ns.commit_timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            stop_sessions([proc], STOP_GRACE_S)
            timed_out, code = True, proc.returncode
        finally:
            checks.finished(proc)
        log.seek(0)
        tail = [line for line in log.read().splitlines() if line.strip()][-1:] or ["no output"]
    seconds = round(time.perf_counter() - start, 1)
    if timed_out:
        return CommitOutcome("error", seconds, f"did not finish within --commit-timeout {ns.commit_timeout} s")
    if code == 2 and not out.exists():
        return CommitOutcome("untestable", seconds, tail[0].removeprefix("harness: error: ")[:500])
    if code not in (0, 1) or not out.exists():
        return CommitOutcome("error", seconds, f"`harness check` exited {code}: {tail[0][:500]}")
    return CommitOutcome("checked", seconds, result=json.loads(out.read_text()))


def run_all(git: Git, todo: list[Commit], ns: argparse.Namespace, workdir: Path,
            extra_args: ExtraArgs | None = None) -> dict[str, CommitOutcome]:
    """Each commit's outcome, `--jobs` at a time, with a progress line per commit done."""
    outcomes: dict[str, CommitOutcome] = {}
    checks = Sessions()
    start = time.perf_counter()
    workers = ThreadPoolExecutor(max_workers=ns.jobs)
    try:
        futures = {workers.submit(check_commit, git, c, ns, workdir, checks, extra_args): c for c in todo}
        for done, future in enumerate(as_completed(futures), 1):
            commit = futures[future]
            outcome = outcomes[commit.sha] = future.result()
            elapsed = time.perf_counter() - start
            left = elapsed / done * (len(todo) - done)
            what = outcome.status if outcome.status != "checked" or outcome.result is None else \
                f"{len(outcome.result['findings'])} new finding(s)"
            print(f"[history] commit {done} of {len(todo)}: {commit.short} {commit.subject[:50]}: {what} "
                  f"({outcome.seconds:.0f}s); elapsed {elapsed:.0f}s, about {left:.0f}s left",
                  file=sys.stderr, flush=True)
    except BaseException:  # Ctrl-C, SIGTERM: the checks run in sessions of their own, stop them too
        with signals_ignored():
            checks.stop(INTERRUPT_GRACE_S)
        # The threads end with their checks (one exporting a tree ends before starting its check),
        # before the trees are deleted; the interpreter would wait for them at exit anyway.
        workers.shutdown(cancel_futures=True)
        raise
    workers.shutdown()
    return outcomes


def repro_at_commit(ns: argparse.Namespace) -> int:
    """`harness repro` in a process of its own on `--commit`'s tree (exported with `git archive`, put
    first on PYTHONPATH, then this harness; deleted afterwards): its exit status, so `git bisect run`
    and the 125 of an untestable commit work as without --repo."""
    git = Git(ns.repo)
    sha = git("rev-parse", f"{ns.commit}^{{commit}}").strip()
    cmd = [sys.executable, "-m", "harness", "repro", "--target", ns.target, "--device", ns.device, ns.case]
    for option in ("script", "check", "term"):  # `repro --script`: written from that commit's tree
        if getattr(ns, option, None) is not None:
            cmd += [f"--{option}", str(getattr(ns, option))]
    with tempfile.TemporaryDirectory(prefix="harness-repro-") as tmp:
        git.export(sha, Path(tmp))
        env = dict(os.environ, **EAGER, PYTHONPATH=os.pathsep.join(filter(None, [tmp, str(HARNESS_ROOT),
                                                                                 os.environ.get("PYTHONPATH")])))
        print(f"[repro] {ns.repo} at {sha[:10]}", file=sys.stderr, flush=True)
        return subprocess.run(cmd, cwd=tmp, env=env, check=False).returncode
