"""What `check` prints of a run: the summary table (per check and level, cases checked and failed,
the largest error over tolerance), the findings check by check with the shrunk one first, the
bitwise property sheet and the known findings. The JSON of the same run is `report.result`'s."""
from __future__ import annotations

from harness.checks.families import family_label
from harness.checks.findings import BEYOND_USE, FOLDED, SHRUNK, START, Finding, reading_order
from harness.driver.runner import Runner


def summary_table(runner: Runner, findings: list[Finding]) -> str:
    levels = list(runner.target.levels)
    rows = [("check", *[f"{lvl} (checked/failed)" for lvl in levels], "max err/tol", "not applied")]
    notes: list[str] = []
    for name in runner.checks:
        cells, margin, skipped = [], 0.0, 0
        for lvl in levels:
            st = runner.verdicts.stats.get((name, lvl))
            cells.append("-" if st is None else f"{st.applied}/{st.failed}" + (f" (+{st.known} known)" if st.known else ""))
            if st and st.margins:
                margin = max(margin, max(st.margins))
            for note, n in sorted((st.not_applied if st else {}).items()):
                skipped += n
                notes.append(f"  {name} ({lvl}), {n} case(s): {note}")
        if all(c == "-" for c in cells):
            continue
        rows.append((name, *cells, f"{margin:.3f}" if margin else "-", str(skipped) if skipped else "-"))
    lines = _table(rows)
    if notes:
        lines += ["", "checks not applied to some cases, and why:", *notes]
    return "\n".join(lines)


FOLDED_SHOWN = 8  # a check's other findings listed, one line each, under its shrunk one


def finding_blocks(findings: list[Finding], json_file: str | None = None) -> list[str]:
    """What the run prints of its findings: those in the target's use first, then, under a line that
    says so, those beyond it (on inputs its own callers never make: `HARNESS_USE`). Each group in
    `reading_order`: each check's leading findings in full, the first shrunk one labelled as the one
    to start from; the check's other findings folded under them, one line each. The JSON keeps every
    finding in full."""
    in_use = [f for f in findings if f.use != BEYOND_USE]
    outside = [f for f in findings if f.use == BEYOND_USE]
    blocks = _blocks(in_use, json_file, start=True)
    if outside:
        blocks.append(f"\nBEYOND THE TARGET'S USE: {len(outside)} finding(s) on inputs its own callers never make "
                      "(its HARNESS_USE says where, citing its callers): hardening, not defects of its training runs")
        blocks += _blocks(outside, json_file, start=not in_use)
    return blocks


def _blocks(findings: list[Finding], json_file: str | None, start: bool) -> list[str]:
    blocks: list[str] = []
    folded: list[Finding] = []

    def fold() -> None:
        if folded:
            where = f"in full in {json_file}" if json_file else "in full with --json FILE"
            lines = [f"    {f.case}" for f in folded[:FOLDED_SHOWN]]
            if len(folded) > FOLDED_SHOWN:
                lines.append(f"    ... and {len(folded) - FOLDED_SHOWN} more")
            blocks.append(f"  and {len(folded)} more [{folded[0].family}] finding(s) on other cases ({where}):\n"
                          + "\n".join(lines))
            folded.clear()

    for i, role in reading_order([(f.family, f.shrunk) for f in findings]):
        f = findings[i]
        if role == FOLDED:
            folded.append(f)
            continue
        fold()
        label = {START: " shrunk, start from this one:" if start else " shrunk:", SHRUNK: " shrunk:"}.get(role, "")
        message = f.message[:1500].replace("\n", "\n  ")
        about = f"  about: {family_label(f.check, f.term, f.context)}\n" if f.term or f.context else ""
        if f.use == BEYOND_USE:
            about += f"  beyond the target's use: {f.beyond}\n"
        script = f"\n  script: {f.script}" if f.script else ""
        blocks.append(f"\nFINDING [{f.check}] ({f.level}){label} {f.case}\n{about}  {message}\n  repro: {f.repro}{script}")
    fold()
    return blocks


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def bitwise_table(runner: Runner) -> str:
    """The bitwise property sheet: per configuration, in how many cases each property held."""
    names = [n for n, c in runner.checks.items() if c.family == "bitwise"]
    rows = [("configuration", *names)]
    for config in sorted(runner.verdicts.properties):
        got = runner.verdicts.properties[config]
        rows.append((config, *[("-" if n not in got else f"{'holds' if got[n][0] == got[n][1] else 'FAILS'} "
                                f"{got[n][1]}/{got[n][0]}") for n in names]))
    return "\n".join(["bitwise properties (cases where it held / cases checked):", *_table(rows),
                      "TP invariance is not a bitwise property: another TP size changes the reduction tree "
                      "(docs/bitwise.md); tp-invariance holds it to the float32 tolerance."])


def known_summary(runner: Runner, stopped: bool = False) -> str:
    """The known entries that matched, with their counts, then the stale ones; `stopped` (the run
    ended before its last case): no entry is stale, it may match what the run did not reach."""
    lines = []
    for e in runner.verdicts.known.entries:
        if e.matched:
            lines.append(f"KNOWN {e.describe()}: {e.matched} finding(s)" + (f" ({e.link})" if e.link else ""))
    unmatched = runner.verdicts.known.stale
    if stopped and unmatched:
        lines.append(f"{len(unmatched)} known entr{'y' if len(unmatched) == 1 else 'ies'} matched nothing before "
                     f"the run stopped; not reported as stale (the run did not reach every case)")
    elif not stopped:
        lines += [f"STALE known entry, matched nothing in this run: {e.describe()}" for e in unmatched]
    return "\n".join(lines)
