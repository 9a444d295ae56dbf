"""Judging: a check's evidence turned into a finding, and what a run's checks concluded.

The driver runs cases and hands each check's evidence over (`Verdicts.judge`); everything a verdict
is made of lives here: the check's problems become a finding with its repro line, the finding is new
or matches a known entry, and the run's statistics (cases checked, failed and known per check and
level, the share of the tolerance used), the bitwise property sheet and the "not applied" notes are
counted. The console, the result JSON and the pytest route read them from here.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from harness.checks import Check, Evidence
from harness.checks.findings import Finding
from harness.checks.known import KnownFindings

KNOWN_KEPT = 200  # known findings kept for the report; every match is counted on its entry


@dataclass
class CheckStats:
    applied: int = 0
    failed: int = 0  # new findings
    known: int = 0  # findings a --known entry matched
    margins_by_group: dict[str, list[float]] = field(default_factory=dict)  # max error / tolerance, per case.group()
    not_applied: dict[str, int] = field(default_factory=dict)  # "not applied: why" -> cases

    @property
    def margins(self) -> list[float]:
        return [m for group in self.margins_by_group.values() for m in group]


class Verdicts:
    """A run's verdicts: per (check, level) statistics, the bitwise property sheet, and the findings
    a known-findings file accepts, kept apart from the new ones."""

    def __init__(self, known: KnownFindings | None = None):
        self.known = known if known is not None else KnownFindings()
        self.stats: dict[tuple[str, str], CheckStats] = defaultdict(CheckStats)
        # The bitwise property sheet: case.config() -> check -> [cases checked, cases where it held].
        self.properties: dict[str, dict[str, list[int]]] = defaultdict(dict)
        self.known_findings: list[Finding] = []

    def judge(self, chk: Check, ev: Evidence, repro: str) -> Finding | None:
        """Evaluate `chk` on the evidence of one case (its twin already in `ev.twins` where it asks for
        one) and count the verdict; the new finding, or None (passed, or a known finding)."""
        case = ev.case
        first = len(ev.margins)
        try:
            problems = chk.fn(ev)
        except Exception as e:  # outputs malformed beyond what the check anticipated
            problems = [f"the check could not evaluate the outputs: {type(e).__name__}: {e}"]
        stats = self.stats[(chk.name, case.level)]
        stats.applied += 1
        used = [m for _, m in ev.margins[first:] if m == m]
        if used:
            stats.margins_by_group.setdefault(case.group(), []).extend(used)
        if chk.family == "bitwise":
            held = self.properties[case.config()].setdefault(chk.name, [0, 0])
            held[0] += 1
            held[1] += not problems
        if not problems:
            return None
        finding = Finding(chk.name, case.level, case.spec(), "; ".join(problems)[:4000], repro,
                          ranks=sorted({r.rank for r in ev.failed_ranks}))
        if self.new_findings([finding]):
            stats.failed += 1
            return finding
        stats.known += 1
        return None

    def new_findings(self, findings: list[Finding]) -> list[Finding]:
        """The findings no known-findings entry matches; the others are kept apart as known."""
        new = []
        for f in findings:
            entry = self.known.classify(f)
            if entry is None:
                new.append(f)
                continue
            f.known = entry.describe() + (f" ({entry.link})" if entry.link else "")
            if len(self.known_findings) < KNOWN_KEPT:
                self.known_findings.append(f)
        return new

    def not_applied(self, chk: Check, ev: Evidence) -> None:
        """A check that would apply to the case in the training context, but not in its own, says
        why ("not applied: ..."), in the summary and the JSON, rather than skipping silently."""
        note = chk.not_applied(ev.case, ev.target)
        if note:
            counts = self.stats[(chk.name, ev.case.level)].not_applied
            counts[note] = counts.get(note, 0) + 1
