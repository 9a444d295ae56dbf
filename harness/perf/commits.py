"""Performance changes from one commit to the next (`harness history --perf`, docs/performance.md).

Each checked commit's `harness check --save-baseline` records the gate's figures of its benchmark
cases (`gate.record`): collectives per op and call, the exact memory figures, the instructions of a
single-rank call under callgrind, and its time paired against the previous checked commit's routine
(imported beside it under another name, `perf.aliased`). `changes` compares two such records as the
gate compares a PR with its baseline, in both directions, with the gate's thresholds:

- collectives: any op issued more (a regression) or less (an improvement) often per call;
- memory: any figure (retained, forward peak, backward peak) larger or smaller, by even one byte;
- instructions: beyond half the threshold either way, when both were counted in one environment;
- time: only where paired, when the whole interval lies beyond half the threshold (`timing.Ratio`).

The deterministic figures decide; a time that is not paired is not judged.
"""
from __future__ import annotations

from typing import Any

from harness.perf.gate import DEFAULT_THRESHOLD

MEMORY = {"retained_bytes": "retained bytes", "peak_forward_bytes": "peak forward bytes",
          "peak_backward_bytes": "peak backward bytes"}
INSTRUCTIONS, TIME = "instructions", "time (ms)"
REGRESSION, IMPROVEMENT = "regression", "improvement"


def collective_metric(op: str) -> str:
    return f"{op} per call"


def _change(metric: str, entry: dict[str, Any], before: float, after: float, worse: bool,
            ratio: float | None = None, **extra: Any) -> dict[str, Any]:
    if ratio is None:
        ratio = after / before if before else None
    return {"metric": metric, "case": entry.get("label") or entry["case"], "spec": entry["case"],
            "before": before, "after": after, "ratio": ratio, "direction": REGRESSION if worse else IMPROVEMENT,
            **extra}


def changes(before: dict[str, Any], after: dict[str, Any], paired: bool,
            threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any]:
    """The changes from record `before` to record `after` (`gate.record`'s), and notes on what was
    not compared. `paired`: `after`'s times were paired against `before`'s routine."""
    out: list[dict[str, Any]] = []
    notes: list[str] = []
    old = {e["case"]: e for e in before.get("cases", [])}
    same_env = before.get("environment") is not None and before.get("environment") == after.get("environment")
    if not same_env:
        notes.append("instructions: not compared, " + (
            after.get("instructions_skipped") or before.get("instructions_skipped") or
            f"counted under {before.get('environment')} and {after.get('environment')}"))
    if before.get("memory_ledger") != after.get("memory_ledger"):
        notes.append(f"memory: not compared, measured by the {before.get('memory_ledger')} and the "
                     f"{after.get('memory_ledger')} ledgers")
    if not paired:
        notes.append("time: not judged (unpaired)")
    line = threshold / 2
    for entry in after.get("cases", []):
        prev = old.get(entry["case"])
        if prev is None or "error" in prev or "error" in entry:
            why = "not in the previous record" if prev is None else (prev.get("error") or entry.get("error", ""))[:200]
            notes.append(f"{entry.get('label', entry['case'])}: not compared ({why})")
            continue
        b, a = prev.get("collectives", {}), entry.get("collectives", {})
        for op in sorted(set(b) | set(a)):
            if a.get(op, 0) != b.get(op, 0):
                out.append(_change(collective_metric(op), entry, b.get(op, 0), a.get(op, 0), a.get(op, 0) > b.get(op, 0)))
        if before.get("memory_ledger") == after.get("memory_ledger"):
            for key, metric in MEMORY.items():
                mb, ma = prev.get("memory", {}).get(key), entry.get("memory", {}).get(key)
                if mb is not None and ma is not None and ma != mb:
                    out.append(_change(metric, entry, mb, ma, ma > mb))
        ib, ia = prev.get("instructions"), entry.get("instructions")
        if same_env and ib and ia and abs(ia / ib - 1) > line:
            out.append(_change(INSTRUCTIONS, entry, ib, ia, ia > ib))
        pair = entry.get("paired") or {}
        if paired and pair.get("verdict") in ("slower", "faster"):
            out.append(_change(TIME, entry, pair["old_s"] * 1e3, pair["new_s"] * 1e3, pair["verdict"] == "slower",
                               ratio=pair["ratio"], ci=pair["ci"]))
        elif paired and "error" in pair:
            notes.append(f"{entry.get('label', entry['case'])}: time not paired ({pair['error'][-300:]})")
    return {"changes": out, "notes": list(dict.fromkeys(notes))}


def figures(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A record's figures per case label, for trend plots: time (s, unpaired median), instructions,
    the memory figures, collectives per call."""
    out: dict[str, dict[str, float]] = {}
    for entry in record.get("cases", []):
        if "error" in entry:
            continue
        fig: dict[str, float] = {k: v for k, v in entry.get("memory", {}).items() if k in MEMORY or k == "peak_bytes"}
        for key in ("time_s", "instructions"):
            if entry.get(key) is not None:
                fig[key] = entry[key]
        fig["collectives"] = sum(entry.get("collectives", {}).values())
        out[entry.get("label") or entry["case"]] = fig
    return out


def summary(changes_: list[dict[str, Any]]) -> str:
    """The changes of one commit in a cell: per direction, each metric with its ratios' range and
    how many cases show it ("regression: peak backward bytes x2.40 (1 case)")."""
    parts = []
    for direction in (REGRESSION, IMPROVEMENT):
        said = []
        for metric in dict.fromkeys(c["metric"] for c in changes_ if c["direction"] == direction):
            these = [c for c in changes_ if c["direction"] == direction and c["metric"] == metric]
            if metric.endswith(" per call"):
                moves = sorted({f"{c['before']:g} -> {c['after']:g}" for c in these})
                what = ", ".join(moves)
            else:
                ratios = sorted(c["ratio"] for c in these if c["ratio"] is not None)
                what = (f"x{ratios[0]:.2f}" if ratios[0] == ratios[-1] else f"x{ratios[0]:.2f}-{ratios[-1]:.2f}") \
                    if ratios else "from 0"
            said.append(f"{metric} {what} ({len(these)} case{'s' if len(these) > 1 else ''})")
        if said:
            parts.append(f"{direction}: {', '.join(said)}")
    return "; ".join(parts)
