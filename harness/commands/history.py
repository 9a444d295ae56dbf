"""`python -m harness history REPO --target MODULE`: replay a routine's git history.

Every commit of REPO that touches the target's files (its module file, or `--paths`), oldest first,
is exported into a temporary tree (`git archive`: the user's checkout and index are never touched,
and a bare repository works) and checked by `harness check --json` in a process of its own, with
that tree first on PYTHONPATH. Commits whose target files hold the same content as one already
checked reuse its result. The result is a table of commit x check family (the families of
`harness peers`, `report.matrix`) that marks where a check first fails (the commit that brought a
defect in) and where it passes again (the one that fixed it); `--known` applies to every commit.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.base import extras, options
from harness.base.errors import UsageError
from harness.checks import all_checks
from harness.report import matrix
from harness.report.render import environment

HARNESS_ROOT = Path(__file__).resolve().parents[2]  # what the checking processes import the harness from
STOP_GRACE_S = 15  # after SIGTERM, how long a timed-out check may take to write what it found
INTERRUPT_GRACE_S = 3  # after Ctrl-C or SIGTERM, how long the running checks get before SIGKILL: none is kept
KILL_SWEEP_S = 5  # how long SIGKILL is sent again to what a stopped check's processes are still starting
STOPPED = "not checked: the run was stopped"


@dataclass
class Commit:
    sha: str
    subject: str
    date: str
    content: str  # the target files' blob ids: equal content, equal result
    same_as: str | None = None  # an earlier commit with the same content, whose result this one reuses

    @property
    def short(self) -> str:
        return self.sha[:10]


@dataclass
class Outcome:
    """One commit's check: `checked` (its result JSON kept), `untestable` (the check refused the
    target: not importable, no callable routine), or `error` (a timeout, a crash of the run)."""
    status: str
    seconds: float = 0.0
    reason: str = ""
    result: dict[str, Any] | None = field(default=None, repr=False)


class Git:
    """Read-only access to a repository (a work tree's or a bare one)."""

    def __init__(self, repo: Path):
        found = subprocess.run(["git", "-C", str(repo), "rev-parse", "--absolute-git-dir"],
                               capture_output=True, text=True, timeout=60)
        if found.returncode:
            raise UsageError(f"{repo} is not a git repository: {found.stderr.strip()}")
        self.dir = found.stdout.strip()

    def __call__(self, *args: str) -> str:
        proc = subprocess.run(["git", "--git-dir", self.dir, *args], capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise UsageError(f"git {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def export(self, sha: str, dest: Path) -> list[str]:
        """The commit's tree into `dest`, through `git archive | tar` (no checkout, no index). A
        mirror may lack some blobs (large files left out of a snapshot): then the tree is written
        blob by blob, those left out; their paths are returned (none when the archive worked)."""
        archive = subprocess.Popen(["git", "--git-dir", self.dir, "archive", sha], stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL)
        assert archive.stdout is not None  # stdout=PIPE
        try:
            untar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True,
                                   timeout=600)
        finally:
            archive.stdout.close()
            archive.wait(timeout=60)
        if archive.returncode == 0 and untar.returncode == 0:
            return []
        return self._export_blobs(sha, dest)

    def _export_blobs(self, sha: str, dest: Path) -> list[str]:
        entries = [line.split("\t", 1) for line in self("ls-tree", "-r", "-z", sha).split("\0") if line]
        blobs = [(meta.split(), path) for meta, path in entries if meta.split()[1] == "blob"]
        cat = subprocess.run(["git", "--git-dir", self.dir, "cat-file", "--batch"],
                             input="".join(f"{m[2]}\n" for m, _ in blobs).encode(), capture_output=True, timeout=600)
        out, pos, absent = cat.stdout, 0, []
        for (mode, _, _), path in blobs:
            end = out.index(b"\n", pos)
            header = out[pos:end].decode().split()
            pos = end + 1
            if header[-1] == "missing":
                absent.append(path)
                continue
            size = int(header[2])
            data, pos = out[pos:pos + size], pos + size + 1
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                target.unlink(missing_ok=True)
                target.symlink_to(data.decode())
            else:
                target.write_bytes(data)
                if mode == "100755":
                    target.chmod(0o755)
        return absent


def module_paths(git: Git, rev: str, module: str) -> list[str]:
    """The file that defines `module` at `rev` (a module file or a package's __init__.py)."""
    base = module.replace(".", "/")
    for path in (f"{base}.py", f"{base}/__init__.py"):
        if git("ls-tree", "--name-only", rev, "--", path).strip():
            return [path]
    raise UsageError(f"{module} is not in the repository at {rev} ({base}.py): give its files with --paths")


def commits(git: Git, paths: list[str], since: str | None, rev: str) -> list[Commit]:
    """The commits touching `paths` up to `rev`, oldest first, from `since` (included, whether it
    touches them or not: the starting point) when given; each marked with the earlier commit whose
    target files it repeats, if any."""
    fmt = "--format=%H%x00%cs%x00%s"
    log = (git("log", "-1", fmt, since, "--") if since else "") + \
        git("log", "--reverse", fmt, f"{since}..{rev}" if since else rev, "--", *paths)
    out: list[Commit] = []
    seen: dict[str, str] = {}
    for line in log.splitlines():
        sha, date, subject = line.split("\0", 2)
        tree = git("ls-tree", sha, "--", *paths)
        content = " ".join(row.split()[2] for row in tree.splitlines())
        out.append(Commit(sha, subject, date, content, seen.get(content)))
        seen.setdefault(content, sha)
    return out


def check_command(ns: argparse.Namespace, json_path: Path) -> list[str]:
    cmd = [sys.executable, "-m", "harness", "check", "--target", ns.target, "--profile", ns.profile,
           "--tp", ",".join(map(str, ns.tp)), "--device", ns.device, "--json", str(json_path), "-q"]
    if ns.seed is not None:
        cmd += ["--seed", str(ns.seed)]
    if ns.known:
        cmd += ["--known", str(Path(ns.known).resolve())]
    return cmd


class Checks:
    """The `harness check` processes running, each the leader of a session of its own (its worker
    pools and whatever else it starts are in it). Once `stop` is called, none starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a check is never started after `stop` collected the running ones
        self._running: set[subprocess.Popen] = set()
        self.stopped = False

    def start(self, cmd: list[str], **popen: Any) -> subprocess.Popen | None:
        """The check, started; None once stopped."""
        with self._lock:
            if self.stopped:
                return None
            proc = subprocess.Popen(cmd, start_new_session=True, **popen)
            self._running.add(proc)
            return proc

    def finished(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(proc)

    def stop(self, grace_s: float) -> None:
        """Every running check stopped, all within `grace_s` (`stop_sessions`), and no new one started."""
        with self._lock:
            self.stopped = True
            running = list(self._running)
        stop_sessions(running, grace_s)


def stop_sessions(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every process of the sessions these lead, all at once (a check writes what it found
    and closes its pools), then SIGKILL to what is left of them after `grace_s`, exited leader or not.
    Sessions, not process groups: ninja runs each compiler of the memory ledger's build in a group of
    its own, and those outlived a check stopped mid-build."""
    sessions = {proc.pid for proc in procs}
    _signal_sessions(sessions, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        # Again until none is left: a dying process may still have started one.
        until = time.monotonic() + KILL_SWEEP_S
        while _signal_sessions(sessions, signal.SIGKILL) and time.monotonic() < until:
            time.sleep(0.05)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a leader in uninterruptible sleep
                proc.wait(timeout=60)


def _signal_sessions(sessions: set[int], sig: int) -> int:
    """`sig` to every live process of these sessions (`/proc`; a zombie is dead already); how many."""
    sent = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state, _, _, session = f.read().rsplit(b")", 1)[1].split()[:4]  # after "pid (comm)"
            if int(session) in sessions and state != b"Z":
                os.kill(int(entry.name), sig)
                sent += 1
        except (OSError, ValueError):  # gone meanwhile
            continue
    return sent


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Ctrl-C and SIGTERM ignored (in the main thread, where handlers live): a second one while the
    checks are being stopped would leave the rest running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def check_commit(git: Git, commit: Commit, ns: argparse.Namespace, workdir: Path, checks: Checks) -> Outcome:
    """`harness check` on one commit's tree, in its own process (session), stopped after
    `--commit-timeout` seconds: SIGTERM, so that it writes what it found, then SIGKILL."""
    if checks.stopped:
        return Outcome("error", reason=STOPPED)
    tree = workdir / commit.short
    tree.mkdir()
    start = time.perf_counter()
    try:
        git.export(commit.sha, tree)
    except (UsageError, subprocess.SubprocessError) as e:
        return Outcome("error", reason=f"cannot export the commit: {e}")
    out = workdir / f"{commit.short}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), str(HARNESS_ROOT),
                                                                      os.environ.get("PYTHONPATH")])))
    with open(workdir / f"{commit.short}.log", "w+") as log:
        proc = checks.start(check_command(ns, out), cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
        if proc is None:
            return Outcome("error", reason=STOPPED)
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
        return Outcome("error", seconds, f"did not finish within --commit-timeout {ns.commit_timeout} s")
    if code == 2 and not out.exists():
        return Outcome("untestable", seconds, tail[0].removeprefix("harness: error: ")[:500])
    if code not in (0, 1) or not out.exists():
        return Outcome("error", seconds, f"`harness check` exited {code}: {tail[0][:500]}")
    return Outcome("checked", seconds, result=json.loads(out.read_text()))


def run_all(git: Git, todo: list[Commit], ns: argparse.Namespace, workdir: Path) -> dict[str, Outcome]:
    """Each commit's outcome, `--jobs` at a time, with a progress line per commit done."""
    outcomes: dict[str, Outcome] = {}
    checks = Checks()
    start = time.perf_counter()
    workers = ThreadPoolExecutor(max_workers=ns.jobs)
    try:
        futures = {workers.submit(check_commit, git, c, ns, workdir, checks): c for c in todo}
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
        with _signals_ignored():
            checks.stop(INTERRUPT_GRACE_S)
        # The threads end with their checks (one exporting a tree ends before starting its check),
        # before the trees are deleted; the interpreter would wait for them at exit anyway.
        workers.shutdown(cancel_futures=True)
        raise
    workers.shutdown()
    return outcomes


def repro_line(repo: str, sha: str, target: str, case: str, device: str = "cpu") -> str:
    """The `harness repro` line that re-runs `case` on commit `sha` of `repo`: it exports that
    commit's tree itself, so the line works after the run (whose trees are gone) and never checks
    the user's current checkout instead of the commit."""
    dev = "" if device == "cpu" else f" --device {shlex.quote(device)}"
    return (f"python -m harness repro --repo {shlex.quote(repo)} --commit {sha} --target {shlex.quote(target)}"
            f"{dev} {shlex.quote(case)}")


def lead_finding(result: dict[str, Any], checks: set[str]) -> dict[str, Any] | None:
    """The finding a stretch is reported by: a shrunk (minimal) one of those checks when there is
    one (the corpus's cases are not shrunk), new findings before known ones."""
    for pool_ in (result.get("findings", []), result.get("known_findings", [])):
        mine = [f for f in pool_ if f["check"] in checks]
        if mine:
            return next((f for f in mine if f.get("shrunk")), mine[0])
    return None


def history_rows(commits_: list[Commit], outcomes: dict[str, Outcome], repo: str = "", target: str = "",
                 device: str = "cpu") -> list[dict[str, Any]]:
    """One row per commit: its cells (`report.matrix`'s), each marked `introduced` where the family
    fails after passing (or has new findings where it had only known ones), `failing` where it fails
    on the first commit checked (it may be older), and `fixed` where it passes after failing, or
    where its new findings are gone and only known ones remain (the peer fixed what its known file
    does not explain). A failing cell's repro is its shrunk finding's, as a line that exports the
    commit itself (`repro_line`)."""
    families: dict[str, set[str]] = {}
    for chk in all_checks().values():
        families.setdefault(matrix.family(chk), set()).add(chk.name)
    rows: list[dict[str, Any]] = []
    before: dict[str, str] = {}  # family -> its state at the last commit checked so far
    for c in commits_:
        outcome = outcomes[c.same_as or c.sha]
        row = {"sha": c.sha, "short": c.short, "date": c.date, "subject": c.subject, "same_as": c.same_as,
               "status": outcome.status, "reason": outcome.reason, "seconds": outcome.seconds, "cells": {}}
        if outcome.result is not None:
            r = outcome.result
            row.update(cases=r["cases_run"], levels=r["levels"], inferred=r.get("inferred_capabilities", {}),
                       not_checked=r.get("not_checked", {}), new=len(r["findings"]),
                       known=len(r.get("known_findings", [])))
            for fam, cell in matrix.peer_cells(r).items():
                if cell["state"] == "n/a":
                    row["cells"][fam] = cell
                    continue
                fails = cell["state"] in ("finding", "known")
                lead = lead_finding(r, families[fam]) if fails else None
                if lead is not None:
                    cell.update(case=lead["case"], check=lead["check"], shrunk=lead.get("shrunk", False),
                                repro=repro_line(repo, c.sha, target, lead["case"], device))
                state, prev = cell["state"], before.get(fam)
                if fails and prev is None:
                    cell["mark"] = "failing"
                elif fails and (prev == "pass" or (state, prev) == ("finding", "known")):
                    cell["mark"] = "introduced"
                elif prev is not None and prev != state and prev != "pass" and state != "finding":
                    cell["mark"] = "fixed"
                before[fam] = state
                row["cells"][fam] = cell
        rows.append(row)
    return rows


def transitions(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Per family, each stretch of failing commits: where it came in (or that it already failed at the
    first commit checked) and where it was fixed (or None)."""
    out: list[dict[str, Any]] = []
    open_: dict[str, dict[str, Any]] = {}
    for row in rows:
        for fam, cell in row["cells"].items():
            if cell.get("mark") in ("introduced", "failing"):
                open_[fam] = {"family": fam, "introduced": row["short"], "fixed": None,
                              "already_at_first": cell["mark"] == "failing",
                              "check": cell.get("check"), "repro": cell.get("repro")}
                open_[fam]["case"] = cell.get("case")
                open_[fam]["shrunk"] = cell.get("shrunk", False)
                out.append(open_[fam])
            elif cell.get("mark") == "fixed" and fam in open_:
                open_.pop(fam)["fixed"] = row["short"]
    return out


def cell_text(cell: dict[str, Any]) -> str:
    mark = {"introduced": "FAILS FROM HERE: ", "failing": "FAILS ALREADY: ",
            "fixed": "FIXED HERE: "}.get(cell.get("mark", ""), "")
    return mark + matrix.cell_text(cell)


def render_markdown(h: dict[str, Any]) -> str:
    fams = h["families"]
    lines = [f"# `harness history`: {h['target']} over {len(h['rows'])} commit(s)", "",
             f"Repository `{h['repo']}`, files {', '.join(f'`{p}`' for p in h['paths'])}; profile {h['profile']}, "
             f"TP {', '.join(map(str, h['tp']))}; {h['checked']} distinct version(s) checked in {h['elapsed_s']:.0f} s.", "",
             "| commit | date | subject | result | " + " | ".join(fams) + " |",
             "|---|---|---|---|" + "---|" * len(fams)]
    for row in h["rows"]:
        if row["status"] == "checked":
            result = f"{row['new']} new, {row['known']} known, {row['cases']} cases"
            if row["inferred"]:
                result += "; inferred " + ", ".join(f"{k}: {v}" for k, v in row["inferred"].items())
            if row["not_checked"]:
                result += "; not checked: " + ", ".join(row["not_checked"])
            if row["same_as"]:
                result += f" (same files as {row['same_as'][:10]})"
            cells = [cell_text(row["cells"][f]) if f in row["cells"] else "-" for f in fams]
        else:
            result, cells = f"{row['status']}: {row['reason']}", ["-"] * len(fams)
        lines.append("| " + " | ".join(_md([f"`{row['short']}`", row["date"], row["subject"][:60], result, *cells])) + " |")
    lines += ["", "| family | brought in by | fixed by | first finding's repro |", "|---|---|---|---|"]
    for t in h["transitions"]:
        came = f"`{t['introduced']}`" + (" (already at the first commit checked)" if t["already_at_first"] else "")
        repro = (f"`{t['repro']}`" + ("" if t.get("shrunk") else " (not shrunk)")) if t["repro"] else "-"
        lines.append("| " + " | ".join(_md([t["family"], came, f"`{t['fixed']}`" if t["fixed"]
                                            else "not fixed", repro])) + " |")
    return "\n".join(lines) + "\n"


def _md(cells: list[str]) -> list[str]:
    return [str(c).replace("|", "\\|").replace("\n", " ") for c in cells]


def render_html(h: dict[str, Any]) -> str:
    return environment(autoescape=True).get_template("history.html.j2").render(h=h, cell_text=cell_text)


def cmd_history(ns: argparse.Namespace, cfg: options.RunConfig) -> int:
    extras.require("jinja2", "report", "harness history (its report)")  # said before the run, not after it
    git = Git(ns.repo)
    rev = git("rev-parse", f"{ns.rev}^{{commit}}").strip()
    paths = ns.paths or module_paths(git, rev, ns.target)
    listed = commits(git, paths, ns.since, rev)
    if not listed:
        raise UsageError(f"no commit up to {ns.rev} touches {', '.join(paths)}")
    todo = [c for c in listed if c.same_as is None]
    print(f"[history] {len(listed)} commit(s) touch {', '.join(paths)}; {len(todo)} distinct version(s) to check, "
          f"{ns.jobs} at a time", file=sys.stderr, flush=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="harness-history-") as tmp:
        outcomes = run_all(git, todo, ns, Path(tmp))
    for c in todo:
        if outcomes[c.sha].result is not None:
            (ns.out / f"{c.short}.json").write_text(json.dumps(outcomes[c.sha].result, indent=1))
    rows = history_rows(listed, outcomes, str(Path(ns.repo).resolve()), ns.target, ns.device)
    fams = [f for f in matrix.columns() if any(r["cells"].get(f, {}).get("state") in ("finding", "known")
                                               for r in rows)]
    h = {"repo": str(ns.repo), "target": ns.target, "paths": paths, "rev": rev, "since": ns.since,
         "profile": ns.profile, "tp": list(ns.tp), "seed": ns.seed, "known": ns.known, "checked": len(todo),
         "elapsed_s": round(time.perf_counter() - start, 1), "families": fams, "rows": rows,
         "transitions": transitions(rows),
         "commits": [asdict(c) | {"outcome": {k: v for k, v in asdict(outcomes[c.same_as or c.sha]).items()
                                              if k != "result"}} for c in listed]}
    (ns.out / "history.json").write_text(json.dumps(h, indent=1))
    text = render_markdown(h)
    (ns.out / "history.md").write_text(text)
    (ns.out / "history.html").write_text(render_html(h))
    print(text)
    print(f"written: {ns.out / 'history.md'}, {ns.out / 'history.html'}, {ns.out / 'history.json'} "
          f"and each checked commit's JSON", file=sys.stderr)
    return 2 if any(o.status == "error" for o in outcomes.values()) else 0


def add_repro_arguments(p: argparse.ArgumentParser) -> None:
    """`harness repro --repo R --commit SHA`: the case on that commit's tree (`repro_at_commit`)."""
    p.add_argument("--repo", type=Path, metavar="REPO",
                   help="re-run the case on a commit of this git repository (a work tree or a bare one), "
                        "exported into a temporary tree first on PYTHONPATH (as `harness history` checks it)")
    p.add_argument("--commit", default="HEAD", metavar="REV", help="the commit of --repo (default: HEAD)")


def repro_at_commit(ns: argparse.Namespace) -> int:
    """`harness repro` in a process of its own on `--commit`'s tree (exported with `git archive`, put
    first on PYTHONPATH, then this harness; deleted afterwards): its exit status, so `git bisect run`
    and the 125 of an untestable commit work as without --repo."""
    git = Git(ns.repo)
    sha = git("rev-parse", f"{ns.commit}^{{commit}}").strip()
    cmd = [sys.executable, "-m", "harness", "repro", "--target", ns.target, "--device", ns.device, ns.case]
    with tempfile.TemporaryDirectory(prefix="harness-repro-") as tmp:
        git.export(sha, Path(tmp))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tmp, str(HARNESS_ROOT),
                                                                        os.environ.get("PYTHONPATH")])))
        print(f"[repro] {ns.repo} at {sha[:10]}", file=sys.stderr, flush=True)
        return subprocess.run(cmd, cwd=tmp, env=env, check=False).returncode


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("history", help="check every commit of a repository that touches the target's files, "
                                       "and mark where each check first fails and where it passes again")
    p.add_argument("repo", type=Path, help="a git repository (a work tree or a bare one); it is only read")
    options.add_argparse(p, ("target", "device", "tp", "profile", "seed", "known"))
    p.add_argument("--since", metavar="REV", help="the oldest commit to check (default: the first touching the files)")
    p.add_argument("--rev", default="HEAD", metavar="REV", help="the newest commit to check (default: HEAD)")
    p.add_argument("--paths", nargs="+", metavar="P",
                   help="the files whose commits to check (default: the target module's file)")
    p.add_argument("--jobs", type=options.positive_int, default=os.cpu_count() or 1, metavar="N",
                   help="commits checked at once (default: the core count)")
    p.add_argument("--commit-timeout", type=options.positive_int, default=3600, metavar="S",
                   help="seconds one commit's check may take before it is stopped (default 3600)")
    p.add_argument("--out", type=Path, default=Path("harness-history"), metavar="DIR",
                   help="where to write history.md, history.html, history.json and each commit's check JSON "
                        "(default: ./harness-history)")
    p.set_defaults(func=cmd_history)
