"""The tables of `harness history`: one row per commit, its cells the defect families of
`report.matrix.family_cells` (a check, the output term, the call context that decides it), each
marked where a family starts failing (the commit that brought a defect in), where it passes again
(the one that fixed it), and where it fails on before and after but its failing configurations
change (a new defect, or a partial fix, in a family that already failed); the stretches between;
markdown and HTML.
"""
from __future__ import annotations

import shlex
from typing import Any

from harness.checks.families import changed, describe
from harness.checks.findings import Finding, from_json, script_command
from harness.checks.verdicts import KNOWN_KEPT
from harness.driver.git_trees import Commit
from harness.driver.replay import CommitOutcome
from harness.perf.commits import summary as perf_summary
from harness.report import matrix
from harness.report.render import environment

PERF_MARK = "PERF CHANGES HERE"
MARKS = {"introduced": "FAILS FROM HERE: ", "failing": "FAILS ALREADY: ", "fixed": "FIXED HERE: ",
         "changed": "CHANGES HERE: "}
NO_RECORD = "no finding recorded"


def repro_line(repo: str, sha: str, target: str, case: str, device: str = "cpu") -> str:
    """The `harness repro` line that re-runs `case` on commit `sha` of `repo`: it exports that
    commit's tree itself, so the line works after the run (whose trees are gone) and never checks
    the user's current checkout instead of the commit."""
    dev = "" if device == "cpu" else f" --device {shlex.quote(device)}"
    return (f"python -m harness repro --repo {shlex.quote(repo)} --commit {sha} --target {shlex.quote(target)}"
            f"{dev} {shlex.quote(case)}")


def history_rows(commits_: list[Commit], outcomes: dict[str, CommitOutcome], repo: str = "", target: str = "",
                 device: str = "cpu") -> list[dict[str, Any]]:
    """One row per commit: its cells (`matrix.family_cells`: one per defect family), each marked
    `failing` where the family fails on the first commit checked (it may be older), `introduced`
    where its state gets worse (a pass, a known or a beyond-use state, then a new finding in use),
    `fixed` where it gets better (the peer fixed what its known file does not explain), and
    `changed` where it fails before and after at the same state but a configuration checked at both
    commits starts or stops failing (`families.changed`). A failing cell's repro is its lead
    finding's, as a line that exports the commit itself (`repro_line`), with the line that writes its
    stand-alone script beside it where one can be written."""
    rows: list[dict[str, Any]] = []
    before: dict[str, dict[str, Any]] = {}  # family -> its cell at the last commit checked so far
    checked_before = False
    for c in commits_:
        outcome = outcomes[c.same_as or c.sha]
        row = {"sha": c.sha, "short": c.short, "date": c.date, "subject": c.subject, "same_as": c.same_as,
               "status": outcome.status, "reason": outcome.reason, "seconds": outcome.seconds, "cells": {}}
        if outcome.result is not None:
            r = outcome.result
            row.update(cases=r["cases_run"], levels=r["levels"], inferred=r.get("inferred_capabilities", {}),
                       not_checked=r.get("not_checked", {}), new=len(r["findings"]),
                       known=len(r.get("known_findings", [])))
            for fam, cell in matrix.family_cells(r).items():
                state, prev = cell["state"], before.get(fam)
                fails = state != "pass"
                if fails and cell.get("case"):
                    cell["repro"] = repro_line(repo, c.sha, target, cell["case"], device)
                    if cell.get("script"):
                        cell["script"] = script_command(cell["repro"], cell["check"], cell.get("term", ""))
                # A family first met after the first commit checked had no failing case before it.
                was = matrix.SEVERITY[prev["state"]] if prev is not None else 0 if checked_before else None
                now = matrix.SEVERITY[state]
                if fails and was is None:
                    cell["mark"] = "failing"
                elif was is not None and now > was:
                    cell["mark"] = "introduced"
                elif was is not None and now < was:
                    cell["mark"] = "fixed"
                elif was and fails and prev is not None:
                    started, stopped = changed(prev.get("configs", {}), cell.get("configs", {}))
                    if started or stopped:
                        cell.update(mark="changed", started=started, stopped=stopped)
                before[fam] = cell
                row["cells"][fam] = cell
            checked_before = True
        rows.append(row)
    return rows


def transitions(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per family, each stretch of failing commits: where it came in (or that it already failed at the
    first commit checked), the commits inside it where its failing configurations changed, and where
    it was fixed (or None): it passes again, or what was new is gone and only known or beyond-use
    findings remain."""
    out: list[dict[str, Any]] = []
    open_: dict[str, dict[str, Any]] = {}
    for row in rows:
        for fam, cell in row["cells"].items():
            mark = cell.get("mark")
            if mark in ("introduced", "failing") and fam not in open_:
                open_[fam] = {"family": fam, "label": matrix.label(fam, cell), "introduced": row["short"],
                              "fixed": None, "already_at_first": mark == "failing", "check": cell.get("check"),
                              "state": cell["state"], "repro": cell.get("repro"), "script": cell.get("script", ""),
                              "case": cell.get("case"), "shrunk": cell.get("shrunk", False), "changes": []}
                out.append(open_[fam])
            elif mark in ("introduced", "changed") and fam in open_:
                what = "a new finding in use" if mark == "introduced" else \
                    "; ".join(p for p in (f"starts failing {describe(cell['started'])}" if cell.get("started") else "",
                                          f"stops failing {describe(cell['stopped'])}" if cell.get("stopped") else "")
                              if p)
                open_[fam]["changes"].append({"commit": row["short"], "what": what, "repro": cell.get("repro"),
                                              "script": cell.get("script", "")})
                open_[fam]["state"] = cell["state"]
            elif mark == "fixed" and fam in open_:
                open_.pop(fam)["fixed"] = row["short"]
    return out


def cell_text(cell: dict[str, Any]) -> str:
    return MARKS.get(cell.get("mark", ""), "") + matrix.cell_text(cell)


def cell_title(cell: dict[str, Any]) -> str:
    """A failing cell's hover text on the page: its lead finding's message and repro. A result may
    count a family's failures and list none of its findings (a check keeps the first KNOWN_KEPT
    known ones, and stops at --max-findings): then the count is all there is to say."""
    if "note" in cell:
        return f"{cell['note']} | {cell['repro']}"
    return (f"{cell['failed'] + cell['known']} failing case(s) counted, {NO_RECORD} (a check keeps the first "
            f"{KNOWN_KEPT} known findings, and stops at --max-findings)")


def no_family_note(h: dict[str, Any]) -> str:
    """Why the table has no family column, where it has none."""
    if any(row["status"] == "checked" for row in h["rows"]):
        return "No defect family fails on any commit checked."
    return "No commit could be checked: each row says why."


def perf_cell(row: dict[str, Any]) -> str:
    """A row's perf column: its changes named (`PERF CHANGES HERE: regression: ...`), or why none."""
    perf = row.get("perf") or {}
    if perf.get("changes"):
        return f"{PERF_MARK}: {perf_summary(perf['changes'])}"
    if "against" in perf:
        return "no change"
    return "; ".join(perf.get("notes", [])) or "-"


def perf_detail(h: dict[str, Any]) -> list[dict[str, Any]]:
    """Every change of every row, with its commit and the commit it is measured against."""
    return [{"commit": row["short"], "against": row["perf"].get("against", ""), **c}
            for row in h["rows"] for c in (row.get("perf") or {}).get("changes", [])]


def _perf_value(metric: str, x: Any) -> str:
    if isinstance(x, float) and not x.is_integer():
        return f"{x:.3f}"
    return f"{int(x):,}" if isinstance(x, (int, float)) else str(x)


def perf_ratio(c: dict[str, Any]) -> str:
    text = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
    return text + (f" [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}]" if c.get("ci") else "")


def perf_markdown(h: dict[str, Any]) -> list[str]:
    """The perf table: one line per change (commit, metric, case, before, after, ratio, direction)."""
    detail = perf_detail(h)
    if not detail:
        return ["No performance change between the commits compared."]
    lines = ["| commit | against | metric | case | before | after | ratio | direction |", "|---|---|---|---|---:|---:|---:|---|"]
    for c in detail:
        lines.append("| " + " | ".join(_md([f"`{c['commit']}`", f"`{c['against']}`", c["metric"], c["case"],
                                              _perf_value(c["metric"], c["before"]), _perf_value(c["metric"], c["after"]),
                                              perf_ratio(c), c["direction"]])) + " |")
    return lines


def perf_lines(h: dict[str, Any]) -> list[str]:
    """The console's perf block: a "PERF CHANGES HERE" line per commit that changed, then its changes."""
    if not h.get("perf"):
        return []
    out = [""]
    for row in h["rows"]:
        changes = (row.get("perf") or {}).get("changes", [])
        if changes:
            out.append(f"{PERF_MARK} on {row['short']} ({row['subject'][:60]}), against {row['perf']['against']}: "
                       f"{perf_summary(changes)}")
            out += [f"  {c['direction']:<11} {c['metric']}: {_perf_value(c['metric'], c['before'])} -> "
                    f"{_perf_value(c['metric'], c['after'])} ({perf_ratio(c)}) on {c['case']}" for c in changes]
    return out if len(out) > 1 else ["", "no performance change between the commits compared"]


def render_markdown(h: dict[str, Any]) -> str:
    fams = h["families"]
    perf = bool(h.get("perf"))
    head = ["commit", "authored", "subject", "result", *fams, *(["perf"] if perf else [])]
    lines = [f"# `harness history`: {h['target']} over {len(h['rows'])} commit(s)", "",
             f"Repository `{h['repo']}`, files {', '.join(f'`{p}`' for p in h['paths'])}; profile {h['profile']}, "
             f"TP {', '.join(map(str, h['tp']))}; {h['checked']} distinct version(s) checked in {h['elapsed_s']:.0f} s.", "",
             "| " + " | ".join(_md(head)) + " |", "|" + "---|" * len(head)]
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
        cells += [perf_cell(row)] if perf else []
        lines.append("| " + " | ".join(_md([f"`{row['short']}`", row["date"], row["subject"][:60], result, *cells])) + " |")
    if perf:
        lines += ["", "Performance, each commit against the previous one with figures (docs/performance.md):", "",
                  *perf_markdown(h)]
    if not fams:  # no failing family, so no stretch either: an empty table would not say why
        return "\n".join([*lines, "", no_family_note(h)]) + "\n"
    lines += ["", "| family | brought in by | changed at | fixed by | first finding's repro |", "|---|---|---|---|---|"]
    for t in h["transitions"]:
        came = f"`{t['introduced']}`" + (" (already at the first commit checked)" if t["already_at_first"] else "")
        repro = (f"`{t['repro']}`" + ("" if t.get("shrunk") else " (not shrunk)")) if t["repro"] else NO_RECORD
        if t.get("script"):
            repro += f"; stand-alone script: `{t['script']}`"
        changes = "; ".join(f"`{c['commit']}`: {c['what']}" for c in t.get("changes", [])) or "-"
        lines.append("| " + " | ".join(_md([f"{t.get('label', t['family'])} (`{t['family']}`, {t['state']})", came, changes,
                                            f"`{t['fixed']}`" if t["fixed"] else "not fixed", repro])) + " |")
    lines += ["", *stretch_lines(h["transitions"])]
    return "\n".join(lines) + "\n"


def stretch_lines(transitions_: list[dict[str, Any]]) -> list[str]:
    """Each stretch in one line, as a maintainer reads it: "log-prob gradients at TP > 1: FIXED HERE
    on `0684a6d838`", "crash: FAILS FROM HERE on `33f97ca9fb`, CHANGES HERE on ..."."""
    out = []
    for t in transitions_:
        said = [f"{'FAILS ALREADY at' if t['already_at_first'] else 'FAILS FROM HERE on'} `{t['introduced']}`"]
        said += [f"CHANGES HERE on `{c['commit']}` ({c['what']})" for c in t.get("changes", [])]
        said.append(f"FIXED HERE on `{t['fixed']}`" if t["fixed"] else "not fixed")
        out.append(f"- {t.get('label', t['family'])}: {', '.join(said)}")
    return out


def first_findings(transitions_: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[Finding]:
    """Each stretch's finding on the commit that brought it in (`results`: each commit's check JSON by
    its short sha), the shrunk one where there is one, with the stretch's repro line: it re-runs the
    case on that commit's tree, which outlives the run (the check's own line named a deleted one)."""
    out = []
    for t in transitions_:
        found = [from_json(f) for f in results.get(t["introduced"], {}).get("findings", [])
                 if f.get("family") == t["family"]]
        if found:
            first = next((f for f in found if f.shrunk), found[0])
            first.repro = t["repro"] or first.repro
            out.append(first)
    return out


def _md(cells: list[str]) -> list[str]:
    return [str(c).replace("|", "\\|").replace("\n", " ") for c in cells]


def render_html(h: dict[str, Any]) -> str:
    return environment(autoescape=True).get_template("history.html.j2").render(
        h=h, cell_text=cell_text, cell_title=cell_title, no_family_note=no_family_note(h), no_record=NO_RECORD,
        perf_cell=perf_cell, perf_detail=perf_detail(h), perf_value=_perf_value, perf_ratio=perf_ratio)
