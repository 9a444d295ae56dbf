"""`python -m harness history REPO --target MODULE`: replay a routine's git history.

Every commit of REPO that touches the target's files (its module file, or `--paths`), oldest first,
is exported into a temporary tree (`git archive`: the user's checkout and index are never touched,
and a bare repository works) and checked by `harness check --json` in a process of its own, with
that tree first on PYTHONPATH. Commits whose target files hold the same content as one already
checked reuse its result. The result is a table of commit x defect family (a check, the output term
and the call context that decides it: `report.matrix.family_cells`) that marks where a family first
fails (the commit that brought a defect in), where its failing configurations change, and where it
passes again (the one that fixed it); `--known` applies to every commit. With `--perf`, each
checked commit is also compared with the previous checked one as the performance gate compares a PR
with its baseline (`harness.perf.commits`): the commit's check records the gate's figures, its time
paired against the routine of the checked commit before it, imported beside it under another name (`perf.aliased`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from harness.base import extras, options
from harness.base.errors import UsageError
from harness.checks import all_checks
from harness.driver.git_trees import Commit, Git, commits, module_paths
from harness.driver.replay import run_all
from harness.perf import commits as perf_commits
from harness.perf.aliased import write_shim
from harness.perf.gate import load as load_record
from harness.report import history_table as table
from harness.report.console import finding_blocks
from harness.report.history_table import first_findings, history_rows, render_html, render_markdown, transitions
from harness.targets import contract_names, is_file_spec
from harness.targets.peers import bound_names, peers


def cmd_history(ns: argparse.Namespace, cfg: options.RunConfig) -> int:
    extras.require("jinja2", "report", "harness history (its report)")  # said before the run, not after it
    if is_file_spec(ns.target) and not ns.paths:
        raise UsageError(f"--target {ns.target} is a file: history cannot tell which of the repository's files its "
                         f"commits change; name them with --paths (e.g. --paths pkg/logprobs.py), or give the "
                         f"target as the repository's module path (--target pkg.logprobs)")
    git = Git(ns.repo)
    rev = git("rev-parse", f"{ns.rev}^{{commit}}").strip()
    paths = ns.paths or module_paths(git, rev, ns.target)
    listed = commits(git, paths, ns.since, rev)
    if not listed:
        raise UsageError(f"no commit up to {ns.rev} touches {', '.join(paths)}")
    _refuse_without_contract(git, ns.target, rev, listed)
    todo = [c for c in listed if c.same_as is None]
    print(f"[history] {len(listed)} commit(s) touch {', '.join(paths)}; {len(todo)} distinct version(s) to check, "
          f"{ns.jobs} at a time", file=sys.stderr, flush=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    perf = PerfHistory(git, todo, ns.target, ns.out) if ns.perf else None
    with tempfile.TemporaryDirectory(prefix="harness-history-") as tmp:
        outcomes = run_all(git, todo, ns, Path(tmp), perf.args if perf is not None else None)
    for c in todo:
        if outcomes[c.sha].result is not None:
            (ns.out / f"{c.short}.json").write_text(json.dumps(outcomes[c.sha].result, indent=1))
    rows = history_rows(listed, outcomes, str(Path(ns.repo).resolve()), ns.target, ns.device)
    if perf is not None:
        perf.annotate(rows)
    order = list(all_checks())  # families in check order, each check's in the order first met
    met = list(dict.fromkeys(f for r in rows for f, cell in r["cells"].items() if cell["state"] != "pass"))
    fams = sorted(met, key=lambda f: order.index(r_check) if (r_check := _check_of(rows, f)) in order else len(order))
    h = {"repo": str(ns.repo), "target": ns.target, "paths": paths, "rev": rev, "since": ns.since,
         "profile": ns.profile, "tp": list(ns.tp), "seed": ns.seed, "known": ns.known, "checked": len(todo),
         "perf": bool(ns.perf),
         "elapsed_s": round(time.perf_counter() - start, 1), "families": fams, "rows": rows,
         "transitions": transitions(rows),
         "commits": [asdict(c) | {"outcome": {k: v for k, v in asdict(outcomes[c.same_as or c.sha]).items()
                                              if k != "result"}} for c in listed]}
    (ns.out / "history.json").write_text(json.dumps(h, indent=1))
    text = render_markdown(h)
    (ns.out / "history.md").write_text(text)
    (ns.out / "history.html").write_text(render_html(h))
    print(text)
    results = {c.short: outcomes[c.same_as or c.sha].result or {} for c in listed}
    for block in finding_blocks(first_findings(h["transitions"], results)):  # as `check` prints them
        print(block)
    for line in table.perf_lines(h):
        print(line)
    print(f"written: {ns.out / 'history.md'}, {ns.out / 'history.html'}, {ns.out / 'history.json'} "
          f"and each checked commit's JSON", file=sys.stderr)
    return 2 if any(o.status == "error" for o in outcomes.values()) else 0


class PerfHistory:
    """`--perf`: the options that make each commit's check record the gate's figures (`DIR/<sha>.baseline.json`),
    its time paired against the previous checked commit's routine; then each row's changes."""

    def __init__(self, git: Git, todo: list[Commit], target: str, out: Path):
        self.git, self.target, self.out = git, target, out.resolve()
        # the commit each one's time is paired against: the previous one to check
        self.previous = {c.sha: p for p, c in zip(todo, todo[1:], strict=False)}

    def record_path(self, short: str) -> Path:
        return self.out / f"{short}.baseline.json"

    def args(self, commit: Commit, workdir: Path) -> list[str]:
        args = ["--save-baseline", str(self.record_path(commit.short))]
        prev = self.previous.get(commit.sha)
        if prev is None:
            return args
        tree = workdir / f"{commit.short}-prev-{prev.short}"
        tree.mkdir()
        try:
            self.git.export(prev.sha, tree)
        except (UsageError, OSError, subprocess.SubprocessError) as e:  # time is then not paired; the other figures stand
            print(f"[history] {commit.short}: time not paired, cannot export {prev.short}: {e}", file=sys.stderr)
            return args
        module = Path(self.target).with_suffix("").as_posix().replace("/", ".") if is_file_spec(self.target) \
            else self.target  # a file target of the tree, as a module of either tree
        shim = write_shim(tree, module, workdir / "aliases", f"{prev.short}_for_{commit.short}")
        return [*args, "--baseline-target", str(shim)]

    def annotate(self, rows: list[dict]) -> None:
        """Each row's `perf`: its changes from the last commit before it with figures (`perf.commits`),
        the figures themselves, and what was not compared."""
        records: dict[str, dict] = {}
        for row in rows:
            path = self.record_path(row["short"])
            if row["same_as"] is None and path.is_file():
                records[row["sha"]] = load_record(path)
        last: dict | None = None  # the last row with figures
        for row in rows:
            version = row["same_as"] or row["sha"]
            record = records.get(version)
            if record is None:
                row["perf"] = {"changes": [], "notes": ["no figures recorded" + (f": {row['reason']}" if row["reason"] else "")]}
                continue
            perf: dict = {"changes": [], "notes": [], "figures": perf_commits.figures(record)}
            if last is None:
                perf["notes"] = ["the first commit with figures: nothing to compare with"]
            elif (last["same_as"] or last["sha"]) == version:
                perf.update(against=last["short"], notes=["same files as the commit before"])
            else:
                prev = self.previous.get(row["sha"]) if row["same_as"] is None else None
                paired = prev is not None and prev.sha == (last["same_as"] or last["sha"])
                perf.update(against=last["short"], **perf_commits.changes(records[last["same_as"] or last["sha"]],
                                                                          record, paired))
            row["perf"] = perf
            last = row


def _check_of(rows: list[dict], family: str) -> str:
    return next(r["cells"][family].get("check", family) for r in rows if family in r["cells"])


def _refuse_without_contract(git: Git, target: str, rev: str, listed: list[Commit]) -> None:
    """A target module of the repository that defines none of the contract's functions in any commit
    to check: every commit would be untestable, each after a check's start-up. Refused at once,
    naming the adapters that map that module's functions onto the contract."""
    if is_file_spec(target) or ":" in target:
        return
    try:
        path = module_paths(git, rev, target)[0]
    except UsageError:
        return  # not the repository's module (an adapter, an installed target): its checks say
    contract = {*contract_names(), "*"}
    for c in listed:
        try:
            source = git("show", f"{c.sha}:{path}")
        except UsageError:
            continue  # not in that commit
        if contract & bound_names(source):
            return
    adapters = [p.spec for p in peers() if any(u.split()[0].rpartition(".")[0] == target for u in p.upstream)]
    hint = (f"--target {adapters[0]} --paths {path}" + (f" (or {', '.join(adapters[1:])})" if adapters[1:] else "")
            if adapters else f"--target ADAPTER --paths {path}, where ADAPTER maps its functions onto the contract "
                             f"(docs/peers.md)")
    raise UsageError(f"{target} defines none of the contract's functions ({', '.join(contract_names())}) in any of "
                     f"the {len(listed)} commit(s) touching {path}: there is nothing to check. Check its functions "
                     f"through an adapter: {hint}")


def add_repro_arguments(p: argparse.ArgumentParser) -> None:
    """`harness repro --repo R --commit SHA`: the case on that commit's tree (`repro_at_commit`)."""
    p.add_argument("--repo", type=Path, metavar="REPO",
                   help="re-run the case on a commit of this git repository (a work tree or a bare one), "
                        "exported into a temporary tree first on PYTHONPATH (as `harness history` checks it)")
    p.add_argument("--commit", default="HEAD", metavar="REV", help="the commit of --repo (default: HEAD)")


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
    p.add_argument("--perf", action="store_true",
                   help="also compare each checked commit with the previous one as the performance gate compares "
                        "a PR: collectives, exact memory, instructions (callgrind, TP 1), time paired against the "
                        "routine of the checked commit before (docs/performance.md)")
    p.add_argument("--out", type=Path, default=Path("harness-history"), metavar="DIR",
                   help="where to write history.md, history.html, history.json and each commit's check JSON "
                        "(default: ./harness-history)")
    p.set_defaults(func=cmd_history)
