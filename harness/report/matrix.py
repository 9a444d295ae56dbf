"""The conformance matrix of `python -m harness peers`: peer x check family, built from each peer's
`harness check --json` result, rendered as markdown and as a self-contained HTML page.

A family is a check, except that the memory checks are one family (`memory`) and so are the
wrapper's (`wrapper`): each column is then a question a maintainer asks ("are the values right?",
"does it leak?"). A cell is `pass` (every case a check of the family applied to passed), `known`
(findings, each matched by an entry of the peer's known file, whose reasons the report lists),
`finding` (new: no entry explains it; the count and the first repro), `n/a` (no case applied,
and why: a level the peer lacks, a capability it does not claim) or `skipped` (the peer did not
run, and why).
"""
from __future__ import annotations

from typing import Any

from harness.checks import Check, all_checks
from harness.report.render import environment

CAPABILITY_WORDS = {"entropy": "no entropy", "keep_mask": "no keep mask",
                    "metric_only_entropy": "no metric-only entropy flag", "top_p": "no top-p replay",
                    "context_parallel": "no context parallelism", "allgather_cp": "no all-gather CP layout",
                    "cp_gradient": "no CP backward on this device"}


def family(chk: Check) -> str:
    module = chk.fn.__module__.rpartition(".")[2]
    return module if module in ("memory", "wrapper") else chk.name


def columns() -> list[str]:
    out: list[str] = []
    for chk in all_checks().values():
        if family(chk) not in out:
            out.append(family(chk))
    return out


def _na_reason(checks: list[Check], result: dict[str, Any]) -> str:
    notes = [note for c in checks for st in result.get("checks", {}).get(c.name, {}).values()
             for note in st.get("not_applied", {})]
    if notes:  # the run said why: its first clause is the cell's
        return notes[0].removeprefix("not applied: ").split(",")[0]
    levels = set(result.get("levels", []))
    if not any(levels & set(c.levels) for c in checks):
        wanted = sorted({lvl for c in checks for lvl in c.levels})
        return f"no {'/'.join(wanted)} level"
    lacking = [CAPABILITY_WORDS.get(k, f"no {k}") for k, ok in sorted(result.get("capabilities", {}).items())
               if not ok and k in CAPABILITY_WORDS]
    if lacking:
        return f"applies to no case it can take ({', '.join(lacking)})"
    if max(result.get("tp", [1])) < min(c.min_ranks for c in checks):
        return "needs TP > 1"
    return "applied to no drawn case"


def peer_cells(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One peer's cells, from its `harness check --json` result (run with the peer's known file)."""
    by_family: dict[str, list[Check]] = {}
    for chk in all_checks().values():
        by_family.setdefault(family(chk), []).append(chk)
    cells = {}
    for fam, checks in by_family.items():
        names = {c.name for c in checks}
        applied = failed = known = 0
        for name in names:
            for st in result.get("checks", {}).get(name, {}).values():
                applied += st["applied"]
                failed += st["failed"]
                known += st.get("known", 0)
        new = [f for f in result.get("findings", []) if f["check"] in names]
        old = [f for f in result.get("known_findings", []) if f["check"] in names]
        first = (new or old or [None])[0]
        if first is None:
            cells[fam] = {"state": "pass", "applied": applied} if applied else \
                {"state": "n/a", "note": _na_reason(checks, result)}
            continue
        reasons = sorted({f["known"] for f in old if f.get("known")})
        cells[fam] = {"state": "finding" if new else "known", "applied": applied,
                      "failed": max(failed, len(new)), "known": max(known, len(old)),
                      "note": first["message"].splitlines()[0][:300], "repro": first["repro"],
                      "check": first["check"], "reasons": reasons}
    return cells


def cell_text(cell: dict[str, Any]) -> str:
    state = cell["state"]
    if state == "pass":
        return f"pass ({cell['applied']})"
    if state == "finding":
        known = f", +{cell['known']} known" if cell["known"] else ""
        return f"NEW FINDING ({cell['failed']}/{cell['applied']}){known}"
    if state == "known":
        return f"known ({cell['known']}/{cell['applied']})"
    return f"{state}: {cell.get('note', '')}" if cell.get("note") else state


def render_markdown(matrix: dict[str, Any]) -> str:
    return environment(autoescape=False).get_template("peers.md.j2").render(m=matrix, cell_text=cell_text)


def render_html(matrix: dict[str, Any]) -> str:
    return environment(autoescape=True).get_template("peers.html.j2").render(m=matrix, cell_text=cell_text)
