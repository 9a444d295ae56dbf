"""What a run will not pay for twice: known hangs, a target that hangs everywhere, findings past
the limit the user set (`-x`, `--max-findings`).

A hang costs a grace period and a pool rebuild per case (a whole-rank hang, the case deadline). So
once a hang has been shrunk to a finding, the remaining cases of its configuration class are
skipped: they could only re-trigger it, and their other checks cannot run on ranks that never
return. The class is the entropy mode of the case (log-prob only, metric-only or differentiable
entropy): it decides which collectives the routine issues, the trigger of this family's hangs
(slime #1822). After `EVERY_CASE_AFTER` consecutive cases in which no rank returned, the target
hangs everywhere and every further case is skipped. The run says how many cases it skipped and why.

A hang is reported once per class: findings on the other hung cases of a class (the regression
corpus's, before exploration shrank it) are folded into the class's shrunk finding (`final`).
"""
from __future__ import annotations

from collections import Counter

from harness.cases.case import Case
from harness.checks import Evidence
from harness.checks.findings import Finding
from harness.engine.observations import HANG_KINDS

EVERY_CASE_AFTER = 3
# Shrinking a hang: at most this many hung cases after the first; the finding is then the smallest
# hanging case found so far. A count, not seconds: the case a run shrinks to, and so its findings,
# do not depend on how loaded the machine is (a hang found by evidence costs a second or two; a
# target that hangs whole is skipped after EVERY_CASE_AFTER cases).
HANG_SHRINK_MAX_CASES = 12


def hang_class(case: Case) -> str:
    return case.entropy_mode


def hung(ev: Evidence) -> bool:
    return any(r.error_kind in HANG_KINDS for r in ev.ranks)


class RunLimits:
    def __init__(self, max_findings: int | None = None):
        self.max_findings = max_findings
        self.found: list[Finding] = []  # every finding reported so far, in order: survives an interruption
        self.known_hangs: dict[str, str] = {}  # hang class -> the case spec of its shrunk finding
        self.skipped: Counter[str] = Counter()  # reason -> cases skipped
        self.every_case: str | None = None  # set once the target hangs on every rank, case after case
        self.hung_cases: dict[str, str] = {}  # spec of every case that hung -> its hang class
        self.first_hang: dict[str, str] = {}  # hang class -> the spec of its first hung case
        self.folded = 0
        self._whole_hangs = 0

    # ---------------------------------------------------------------- findings
    def record(self, findings: list[Finding]) -> None:
        self.found.extend(findings)

    def reached(self) -> bool:
        return self.max_findings is not None and len(self.found) >= self.max_findings

    # ---------------------------------------------------------------- hangs
    def skip_reason(self, case: Case, unshrunk: bool = False) -> str | None:
        """Why this case is not worth running, or None. `unshrunk`: a class that hung counts even
        before a shrunk finding confirms it (the corpus, which does not shrink)."""
        if self.every_case:
            return self.every_case
        cls = hang_class(case)
        if cls in self.known_hangs:
            return f"{cls} cases hang (shrunk finding: {self.known_hangs[cls]})"
        if unshrunk and cls in self.first_hang:
            return f"{cls} cases hang (as {self.first_hang[cls]} did)"
        return None

    def skip(self, case: Case, unshrunk: bool = False) -> bool:
        """Count the case as skipped when it is not worth running."""
        reason = self.skip_reason(case, unshrunk)
        if reason is not None:
            self.skipped[reason] += 1
        return reason is not None

    def observe(self, ev: Evidence) -> None:
        """After every case run: note hung cases and count the consecutive cases in which no rank returned."""
        if hung(ev):
            spec = ev.case.spec()
            self.hung_cases[spec] = hang_class(ev.case)
            self.first_hang.setdefault(hang_class(ev.case), spec)
        if ev.ranks and all(r.error_kind in HANG_KINDS for r in ev.ranks):
            self._whole_hangs += 1
            if self._whole_hangs >= EVERY_CASE_AFTER and not self.every_case:
                self.every_case = (f"the target hung on every rank in {EVERY_CASE_AFTER} cases in a row: "
                                   f"it hangs everywhere")
        else:
            self._whole_hangs = 0

    def confirm_hang(self, finding: Finding, case: Case) -> None:
        """A hang shrunk to `finding` (on `case`): skip its class from now on."""
        self.known_hangs.setdefault(hang_class(case), finding.case)

    def final(self, findings: list[Finding]) -> list[Finding]:
        """One report per hang class: findings on other hung cases of the class are folded into its
        shrunk finding (or, unshrunk, its first); a target that hangs everywhere gets one report."""
        out = []
        first = next(iter(self.hung_cases), None)
        for f in findings:
            cls = self.hung_cases.get(f.case)
            keep = first if self.every_case or cls is None else self.known_hangs.get(cls, self.first_hang.get(cls))
            if cls is not None and f.case != keep:
                self.folded += 1
                continue
            out.append(f)
        return out

    def summary(self) -> list[str]:
        lines = [f"skipped {n} case(s): {reason}" for reason, n in self.skipped.items()]
        if self.folded:
            lines.append(f"folded {self.folded} finding(s) on other hung cases into the hang reported for their class")
        return lines
