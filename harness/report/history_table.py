"""The tables of `harness history`: one row per commit, its cells the check families of
`report.matrix`, each marked where a family starts failing (the commit that brought a defect in) and
where it passes again (the one that fixed it); the stretches between; markdown and HTML.
"""
from __future__ import annotations

import shlex
from typing import Any

from harness.checks import all_checks
from harness.driver.git_trees import Commit
from harness.driver.replay import CommitOutcome
from harness.report import matrix
from harness.report.render import environment


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


def history_rows(commits_: list[Commit], outcomes: dict[str, CommitOutcome], repo: str = "", target: str = "",
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
