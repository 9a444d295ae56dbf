"""What the reports show, computed from the result dict alone (the JSON of `check --json`).

Sections that a run did not measure (memory, a baseline) come out as None; the templates say
"not measured" for them.
"""
from __future__ import annotations

import math
import re
from typing import Any

from harness.base import levels
from harness.checks.families import family_label
from harness.checks.findings import BEYOND_USE, IN_USE, reading_order

NEAR = 0.5  # error/tolerance above this is close enough to the line to be worth a look
SHOWN_LINES = 4  # lines of a finding's message shown before "full message"


def fmt_number(x: float | int | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def fmt_margin(x: float | None) -> str:
    """Error/tolerance: below 1e-4 the error is rounding noise, not a figure worth reading."""
    if x is None:
        return "-"
    return "<1e-4" if x < 1e-4 else fmt_number(x)


def group_order(name: str) -> tuple:
    """Configurations in reading order: level, then TP size numerically, then the rest."""
    tp = re.search(r"-tp(\d+)", name)
    return (name.split("-")[0], int(tp.group(1)) if tp else 0, name)


def margin_state(margin: float | None) -> str:
    if margin is None:
        return "none"
    return "bad" if margin > 1 else "near" if margin > NEAR else "ok"


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per check: applied/failed per level, the worst error/tolerance and where it was."""
    failing = {f["check"] for f in result["findings"]}
    rows = []
    for name, per_level in result["checks"].items():
        worst, worst_group = None, None
        for stats in per_level.values():
            for group, values in _groups(stats).items():
                top = max(values, default=None)
                if top is not None and (worst is None or top > worst):
                    worst, worst_group = top, group
        rows.append({
            "check": name,
            "cells": {lvl: per_level.get(lvl) for lvl in levels.all_levels()},
            "failed": name in failing or any(s["failed"] for s in per_level.values()),
            "known": sum(s.get("known", 0) for s in per_level.values()),
            "margin": worst, "margin_state": margin_state(worst), "worst_group": worst_group,
        })
    for name in dict.fromkeys(f["check"] for f in result["findings"]):
        if name not in result["checks"]:  # a feature's own check (a baseline gate): no per-case stats
            rows.append({"check": name, "cells": {lvl: None for lvl in levels.all_levels()}, "failed": True, "known": 0,
                         "margin": None, "margin_state": "none", "worst_group": None})
    return sorted(rows, key=lambda r: not r["failed"])  # failing checks first; otherwise run order


def _groups(stats: dict[str, Any]) -> dict[str, list[float]]:
    # Results written before margins were tagged by configuration keep one untagged group.
    if "margins_by_group" in stats:
        return stats["margins_by_group"]
    return {"all cases": stats["margins"]} if stats.get("margins") else {}


def margins(result: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Per check with measured errors: {configuration: [error/tolerance, ...]}, configurations in order."""
    out = {}
    for name, per_level in result["checks"].items():
        merged: dict[str, list[float]] = {}
        for stats in per_level.values():
            for group, values in _groups(stats).items():
                merged.setdefault(group, []).extend(values)
        if any(merged.values()):
            out[name] = {g: merged[g] for g in sorted(merged, key=group_order) if merged[g]}
    return out


def findings(result: dict[str, Any], use: str = IN_USE) -> list[dict[str, Any]]:
    """The findings in the target's use (`use` BEYOND_USE: those beyond it), each with its first
    lines (torch.testing's: what, how many, how far off) up front, in the console's order
    (`reading_order`: the shrunk finding to start from first), each with its `role` there and its
    family in words (`about`)."""
    out = []
    found = [f for f in result["findings"] if (f.get("use", IN_USE) == BEYOND_USE) == (use == BEYOND_USE)]
    for i, role in reading_order([(f.get("family", f["check"]), bool(f.get("shrunk"))) for f in found]):
        f = found[i]
        lines = [line for line in f["message"].strip().splitlines() if line.strip()] or [""]
        about = family_label(f["check"], f.get("term", ""), f.get("context", "")) \
            if f.get("term") or f.get("context") else ""
        out.append({"beyond": "", "script": "", **f, "role": role, "headline": lines[0], "lead": lines[:SHOWN_LINES],
                    "about": about,
                    "more": len(lines) > SHOWN_LINES or any(len(line) > 300 for line in lines)})
    return out


def view(result: dict[str, Any]) -> dict[str, Any]:
    rows = summary(result)
    figs = margins(result)
    return {
        "target": result["target"],
        "levels": [lvl for lvl in levels.all_levels() if lvl in result["levels"]],
        "missing_features": sorted(k for k, ok in result.get("capabilities", {}).items() if not ok),
        "run": {k: result.get(k) for k in ("profile", "seed", "tp", "cases_run", "elapsed_s", "cases_per_s")},
        "summary": rows,
        "checks_failed": len({f["check"] for f in result["findings"]}),
        "findings": findings(result),
        "beyond_use": findings(result, BEYOND_USE),
        "known": known(result),
        "margins": {r["check"]: figs[r["check"]] for r in rows if r["check"] in figs},  # summary order
        "memory": memory(result),
        "baseline": baseline(result),
        "baseline_saved": result.get("baseline_saved"),
        "bitwise": bitwise(result),
        "not_applied": not_applied(result),
    }


def known(result: dict[str, Any]) -> dict[str, Any] | None:
    """The --known file's entries, each with its count (or stale) and one example repro; None without
    a file. Known findings are shown apart from the new ones: they do not fail the run."""
    data = result.get("known")
    if not data:
        return None
    examples: dict[str, str] = {}
    for f in result.get("known_findings", []):
        examples.setdefault(f["known"], f["repro"])
    rows = []
    for e in data["entries"]:
        where = ", ".join(f"{k} in {'|'.join(map(str, v))}" for k, v in e["where"].items()) or "every case"
        label = next((k for k in examples if k.startswith(f"[{', '.join(e['checks'])}]") and e["reason"] in k), None)
        rows.append({"checks": ", ".join(e["checks"]), "where": where, "reason": e["reason"], "link": e["link"],
                     "matched": e["matched"], "example": examples.get(label, "") if label else ""})
    return {"file": data["file"], "rows": rows, "stale": len(data["stale"]), "stopped": data.get("stopped", False)}


TP_NOTE = ("TP invariance is not a bitwise property: another TP size changes the reduction tree; "
           "tp-invariance holds it to the float32 tolerance.")


def bitwise(result: dict[str, Any]) -> dict[str, Any] | None:
    """The `--bitwise` property sheet: per configuration, each property's cases held / checked."""
    sheet = result.get("bitwise")
    if not sheet:
        return None
    names = list(dict.fromkeys(n for got in sheet.values() for n in got))
    rows = [{"config": config, "cells": {n: got.get(n) for n in names},
             "fails": any(c["held"] < c["checked"] for c in got.values())} for config, got in sheet.items()]
    return {"names": names, "rows": rows, "note": TP_NOTE}


def not_applied(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Checks that a call context left without evidence, and why (docs/callers.md)."""
    return [{"check": name, "level": lvl, "note": note, "cases": n}
            for name, per_level in result["checks"].items() for lvl, st in per_level.items()
            for note, n in sorted((st.get("not_applied") or {}).items())]


MEMORY_METERS = (("retained", "retained after forward"), ("peak_forward", "peak in forward"),
                 ("peak_backward", "peak in backward"))
MEMORY_UNIT = "x T*V_local*4 bytes per rank, beyond the O(T) allowance"
LOGITS_BYTES = {"bf16": 2, "fp16": 2}  # the half-precision logits' bytes per entry: their own unit is smaller


def in_logits_unit(dtype: str, values: dict[str, float]) -> str:
    """A half-precision row's figures read in its logits' own size, T*V_local*2 (empty for float32,
    whose own size is the table's unit)."""
    size = LOGITS_BYTES.get(dtype)
    if size is None or not values:
        return ""
    labels = dict(MEMORY_METERS)
    figures = ", ".join(f"{labels[m]} {values[m] * 4 / size:.2f}" for m, _ in MEMORY_METERS if m in values)
    return f"{figures} x T*V_local*{size} ({dtype})"


def memory(result: dict[str, Any]) -> dict[str, Any] | None:
    data = result.get("memory_by_config")
    if not data:
        return None
    budget = data["budget"]
    rows = []
    for name, row in data["configs"].items():
        values = {m: w["value"] for m, w in row["worst"].items()}
        over = [m for m, v in values.items() if m in budget and v > budget[m]]
        top = max(row["worst"], key=lambda m: values[m] / budget.get(m, 1.0), default=None)  # nearest its budget
        rows.append({"config": name, "cases": row["cases"], "values": values, "over": bool(over),
                     "case": row["worst"][top]["case"] if top else "",
                     "own": in_logits_unit(row.get("dtype", "fp32"), values)})
    declared = ", ".join(f"{m} {v:g}" for m, v in budget.items())
    return {"rows": rows, "budget": budget, "meters": MEMORY_METERS, "unit": MEMORY_UNIT,
            "note": f"Budget declared by the target (HARNESS_MEMORY_BUDGET): {declared}." if budget
            else "The target declares no budget (HARNESS_MEMORY_BUDGET)."}


def baseline(result: dict[str, Any]) -> dict[str, Any] | None:
    """The comparison `check --baseline FILE` adds (harness.baseline): one row per case and metric."""
    data = result.get("baseline")
    if not data:
        return None
    rows = data.get("rows", [])  # none when nothing could be compared: the note says why
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cell = {(r["case"], r["metric"]): r for r in rows}
    grid = [{"case": c, "bad": any(cell[c, m]["bad"] for m in metrics if (c, m) in cell),
             "cells": [cell.get((c, m)) for m in metrics]} for c in cases]
    return {"note": data.get("note", ""), "rows": rows, "decision_line": data.get("decision_line"),
            "metrics": metrics, "cases": cases, "grid": grid}
