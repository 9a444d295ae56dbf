"""The conformance matrix of `python -m harness peers`: peer x check family, built from each peer's
`harness check --json` result, rendered as markdown and as a self-contained HTML page.

A column is a check, except that the memory checks are one column (`memory`) and so are the
wrapper's (`wrapper`): each column is then a question a maintainer asks ("are the values right?",
"does it leak?"). A cell is `pass` (every case a check of the column applied to passed), `known`
(findings, each matched by an entry of the peer's known file, whose reasons the report lists),
`finding` (new, in the peer's own use: no entry explains it; the count and the first repro),
`beyond` (new, but only on inputs the peer's own callers never make: its `HARNESS_USE`), `n/a`
(no case applied, and why: a level the peer lacks, a capability it does not claim) or `skipped`
(the peer did not run, and why). A column's failing cell lists its defect families
(`checks.families`: the check, the output term, the call context that decides it) apart, each with
its own state: one defect per family (`family_cells`, which `harness history` reads too).
"""
from __future__ import annotations

import sys
from typing import Any

from harness.checks import Check, all_checks
from harness.checks.families import family_label, where
from harness.checks.findings import BEYOND_USE
from harness.report.render import environment

# How bad a cell's state is: a family's history marks a rise as the commit that brought a defect
# in, a fall as the one that fixed it.
SEVERITY = {"pass": 0, "known": 1, "beyond": 2, "finding": 3}

CAPABILITY_WORDS = {"entropy": "no entropy", "keep_mask": "no keep mask",
                    "metric_only_entropy": "no metric-only entropy flag", "top_p": "no top-p replay",
                    "context_parallel": "no context parallelism", "allgather_cp": "no all-gather CP layout",
                    "cp_gradient": "no CP backward on this device"}


def family(chk: Check) -> str:
    """The matrix column of a check: its own, or the one its module gathers its checks under."""
    return getattr(sys.modules[chk.fn.__module__], "MATRIX_COLUMN", chk.name)


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


def family_cells(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One cell per defect family of a `harness check --json` result (`checks.families`), keyed by
    the family's name: its state, counts, the lead finding (in use before beyond it before known)
    with its repro and script lines, and what its failing configurations share (`where`). A result
    written before families were counted gives one family per check."""
    fams = result.get("families")
    if fams is None:
        return {name: cell for name, cell in _check_cells(result).items() if cell["state"] != "n/a"}
    new = result.get("findings", [])
    old = result.get("known_findings", [])
    cells: dict[str, dict[str, Any]] = {}
    for key, fam in fams.items():
        mine = [f for f in new if f.get("family", f["check"]) == key]
        in_use = [f for f in mine if f.get("use") != BEYOND_USE]
        beyond = [f for f in mine if f.get("use") == BEYOND_USE]
        known = [f for f in old if f.get("family", f["check"]) == key]
        base = {"check": fam["check"], "term": fam["term"], "context": fam["context"], "label": fam["label"],
                "applied": fam["applied"], "configs": fam["configs"]}
        if not (mine or known or fam["failed"] or fam["known"]):
            cells[key] = {**base, "state": "pass"}
            continue
        state = "finding" if in_use or fam["failed"] > fam["beyond"] else "beyond" if beyond or fam["beyond"] \
            else "known"
        first = next((f for group in (in_use, beyond, known) for f in group if f.get("shrunk")), None) \
            or (in_use or beyond or known or [None])[0]
        cells[key] = {**base, "state": state, "failed": max(fam["failed"], len(mine)),
                      "beyond": max(fam["beyond"], len(beyond)), "known": max(fam["known"], len(known)),
                      "where": where(fam["configs"]), "reasons": sorted({f["known"] for f in known if f.get("known")}),
                      "use_why": sorted({f["beyond"] for f in beyond if f.get("beyond")})}
        if first is not None:
            cells[key].update(note=first["message"].splitlines()[0][:300], repro=first["repro"],
                              script=first.get("script", ""), case=first["case"], shrunk=first.get("shrunk", False))
    return cells


def peer_cells(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One peer's cells, one per column, from its `harness check --json` result (run with the peer's
    known file): the column's checks' counts, and where one fails, its failing families apart
    (`families`, each a `family_cells` cell) and the worst of their states."""
    cells = _check_cells(result)
    if result.get("families") is None:
        return cells
    by_family: dict[str, set[str]] = {}
    for chk in all_checks().values():
        by_family.setdefault(family(chk), set()).add(chk.name)
    fams = family_cells(result)
    for column, names in by_family.items():
        failing = {k: c for k, c in fams.items() if c["check"] in names and c["state"] != "pass"}
        if not failing or cells[column]["state"] == "n/a":
            continue
        worst = max(failing.values(), key=lambda c: SEVERITY[c["state"]])
        cells[column].update(state=worst["state"], families=failing,
                             beyond=sum(c.get("beyond", 0) for c in failing.values()))
    return cells


def _check_cells(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One peer's cells per column from its checks' counts alone."""
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
    """A cell in words; a column cell with failing families says each apart ("gradients [log-prob]:
    NEW FINDING (5/40); gradients [entropy]: beyond use (5/40)")."""
    families = cell.get("families")
    if families and (len(families) > 1 or any(c["term"] or c["context"] for c in families.values())):
        return "; ".join(f"{key}: {cell_text(c)}" for key, c in families.items())
    state = cell["state"]
    if state == "pass":
        return f"pass ({cell['applied']})"
    if state == "finding":
        beyond = f", +{cell['beyond']} beyond use" if cell.get("beyond") else ""
        known = f", +{cell['known']} known" if cell["known"] else ""
        return f"NEW FINDING ({cell['failed'] - cell.get('beyond', 0)}/{cell['applied']}){beyond}{known}"
    if state == "beyond":
        known = f", +{cell['known']} known" if cell["known"] else ""
        return f"beyond use ({cell['beyond']}/{cell['applied']}){known}"
    if state == "known":
        return f"known ({cell['known']}/{cell['applied']})"
    return f"{state}: {cell.get('note', '')}" if cell.get("note") else state


def label(key: str, cell: dict[str, Any]) -> str:
    """A family's name in words with what its failing configurations share: "log-prob gradients at TP > 1"."""
    text = family_label(cell["check"], cell["term"], cell["context"]) if "check" in cell and "term" in cell else key
    return f"{text} {cell['where']}" if cell.get("where") else text


def listing(matrix: dict[str, Any]) -> list[dict[str, Any]]:
    """Every failing family of every peer that ran, one row each, for the reports' list: new findings
    in the peer's own use first (what its maintainers should hear), then those beyond its use
    (hardening notes), then the known ones."""
    rows = []
    for p in matrix["peers"]:
        if p.get("status") != "ran":
            continue
        for column, cell in p["cells"].items():
            if cell["state"] not in SEVERITY or cell["state"] == "pass":
                continue
            for key, fam in (cell.get("families") or {column: cell}).items():
                rows.append({"peer": p["name"], "column": column, "family": key, "label": label(key, fam),
                             **{k: fam.get(k, "") for k in ("state", "check", "note", "repro", "script")},
                             "reasons": fam.get("reasons", []), "use_why": fam.get("use_why", [])})
    return sorted(rows, key=lambda r: -SEVERITY[r["state"]])


def render_markdown(matrix: dict[str, Any]) -> str:
    return environment(autoescape=False).get_template("peers.md.j2").render(m=matrix, cell_text=cell_text,
                                                                            listing=listing(matrix))


def render_html(matrix: dict[str, Any]) -> str:
    return environment(autoescape=True).get_template("peers.html.j2").render(m=matrix, cell_text=cell_text,
                                                                             listing=listing(matrix))
