"""Findings: what a run reports, each with the one-line command that reproduces it."""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.cases.case import Case


@dataclass
class Finding:
    check: str
    level: str
    case: str  # the case spec; `parse_case` rebuilds it
    message: str
    repro: str
    ranks: list[int] = field(default_factory=list)
    shrunk: bool = False
    known: str = ""  # the known-findings entry it matched (harness.checks.known), "" for a new finding

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def repro_command(target: str, case: Case, env: str = "") -> str:
    """`env`: what the line must set to import the target from anywhere (`targets.repro_env`)."""
    return f"{env}python -m harness repro --target {shlex.quote(target)} {shlex.quote(case.spec())}"


START, SHRUNK, LEAD, FOLDED = "start", "shrunk", "lead", "folded"  # a finding's place in `reading_order`


def reading_order(findings: list[tuple[str, bool]]) -> list[tuple[int, str]]:
    """How a run's findings read, in the console and in the reports alike. `findings`: (check,
    shrunk) per finding, in the order found. Check by check, the checks with a shrunk (minimal)
    finding first, each in the order it first failed; within a check its shrunk findings lead and
    its other findings (the corpus's, larger cases) are folded under them; without a shrunk one, its
    first finding leads. The run's first shrunk finding is the one to start from: one start.
    Returns (index into `findings`, START | SHRUNK | LEAD | FOLDED), every index once."""
    by_check: dict[str, list[int]] = {}
    for i, (check, _) in enumerate(findings):
        by_check.setdefault(check, []).append(i)
    groups = sorted(by_check.values(), key=lambda idx: not any(findings[i][1] for i in idx))  # stable
    out: list[tuple[int, str]] = []
    for idx in groups:
        lead = [i for i in idx if findings[i][1]] or idx[:1]
        for i in lead:
            shrunk = findings[i][1]
            out.append((i, START if shrunk and not out else SHRUNK if shrunk else LEAD))
        out += [(i, FOLDED) for i in idx if i not in lead]
    return out
