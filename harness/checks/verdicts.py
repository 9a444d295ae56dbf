"""Judging: a check's evidence turned into a finding, and what a run's checks concluded.

The conversation runs one way. The driver runs cases and hands each check's evidence over
(`Verdicts.evaluate`: the check's problems, nothing counted); once the ranks are free it splits a
failing verdict's problems by family, running the case's variants where that takes them
(`Runner.about`), and hands the verdict back to be counted (`Verdicts.record`). Everything a verdict
is made of lives here: the check's problems become a finding with its repro line, the finding is new
or matches a known entry, and the run's statistics (cases checked, failed and known per check and
level, the share of the tolerance used), the bitwise property sheet and the "not applied" notes are
counted. The console, the result JSON and the pytest route read them from here.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from harness.checks import Check, Evidence
from harness.checks import script as scripts
from harness.checks.families import FamilyStats, context_of, family_key
from harness.checks.findings import BEYOND_USE, Finding, script_command
from harness.checks.known import Entry, KnownFindings
from harness.checks.problems import Problem
from harness.checks.terms import exercised, split_by_term
from harness.checks.use import beyond

Groups = list[tuple[str, str, list[str]]]  # a verdict's problems by family: (term, context, problems)


@dataclass(frozen=True)
class Judged:
    """A check's verdict on one case before it is counted: its problems (none: it passed)."""
    problems: list[str]

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


def _error(problems: list[str]) -> float | None:
    """The largest |actual - expected| among the problems' worst entries (None: none compares finite values)."""
    sizes = [abs(p.actual - p.expected) for p in problems if isinstance(p, Problem)
             and p.actual is not None and p.expected is not None and math.isfinite(p.actual - p.expected)]
    return max(sizes, default=None)


class Verdicts:
    """A run's verdicts: per (check, level) statistics, the bitwise property sheet, and the findings
    a known-findings file accepts, kept apart from the new ones; each finding in or beyond the
    target's use (`use`: its HARNESS_USE entries), and counted on its family (`families`)."""

    def __init__(self, known: KnownFindings | None = None, use: list[Entry] | None = None):
        self.known = known if known is not None else KnownFindings()
        self.use = use or []
        self.stats: dict[tuple[str, str], CheckStats] = defaultdict(CheckStats)
        self.families: dict[str, FamilyStats] = {}
        # The bitwise property sheet: case.config() -> check -> [cases checked, cases where it held].
        self.properties: dict[str, dict[str, list[int]]] = defaultdict(dict)
        self.known_findings: list[Finding] = []

    @staticmethod
    def evaluate(chk: Check, ev: Evidence) -> Judged:
        """`chk` on the evidence of one case (its twin already in `ev.twins` where it asks for one):
        what it found, nothing counted yet. The share of each bound it used goes to `ev.margins`."""
        try:
            return Judged(chk.fn(ev))
        except Exception as e:  # outputs malformed beyond what the check anticipated
            return Judged([f"the check could not evaluate the outputs: {type(e).__name__}: {e}"])

    def record(self, chk: Check, ev: Evidence, judged: Judged, groups: Groups, repro: str,
               margins: list[tuple[str, float]]) -> list[Finding]:
        """Count a verdict (`evaluate`'s) and make its findings: one per family of `groups` ((term,
        context, problems), the driver's split of the problems; none when it passed). The new ones,
        none when every finding is known. `margins`: what the evaluation added to `ev.margins`."""
        case, problems = ev.case, judged.problems
        stats = self.stats[(chk.name, case.level)]
        stats.applied += 1
        used = [m for _, m in margins if m == m]
        if used:
            stats.margins_by_group.setdefault(case.group(), []).extend(used)
        if chk.family == "bitwise":
            held = self.properties[case.config()].setdefault(chk.name, [0, 0])
            held[0] += 1
            held[1] += not problems
        ranks = sorted({r.rank for r in ev.failed_ranks})
        findings = [Finding(chk.name, case.level, case.spec(), "; ".join(said)[:4000], repro, ranks=ranks,
                            term=term, context=context, error=_error(said)) for term, context, said in groups]
        for f in findings:  # the line that writes its stand-alone script, where one can be written
            if scripts.refusal(ev.target, scripts.script_case(case, f.check, f.term), f.check) is None:
                f.script = script_command(repro, f.check, f.term)
        new = self.new_findings(findings)
        self._count_families(chk, ev, findings, new)
        if new:
            stats.failed += 1
        elif findings:
            stats.known += 1
        return new

    def _count_families(self, chk: Check, ev: Evidence, findings: list[Finding], new: list[Finding]) -> None:
        """Count the case on every family it was checked in: per term it exercises (and any term a
        finding names), on the plain path and, in a call context, in that context too."""
        case, context = ev.case, context_of(ev.case)
        failing = {(f.term, f.context): f for f in findings}
        terms = list(dict.fromkeys([*(exercised(case) if split_by_term(chk.terms, case) else ("",)),
                                    *(t for t, _ in failing)]))
        for term in terms:
            for ctx in dict.fromkeys(("", context)):
                key = family_key(chk.name, term, ctx)
                fam = self.families.get(key) or self.families.setdefault(key, FamilyStats(chk.name, term, ctx))
                f = failing.get((term, ctx))
                fam.count(case, f is not None)
                if f is None:
                    continue
                if any(f is n for n in new):
                    fam.failed += 1
                    fam.beyond += f.use == BEYOND_USE
                else:
                    fam.known += 1

    def new_findings(self, findings: list[Finding]) -> list[Finding]:
        """The findings no known-findings entry matches; the others are kept apart as known. Each is
        marked in or beyond the target's use first."""
        new = []
        for f in findings:
            outside = beyond(f, self.use)
            if outside is not None:
                f.use, f.beyond = BEYOND_USE, outside.reason
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
