"""Findings: what a run reports, each with the one-line command that reproduces it."""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.cases.case import Case
from harness.checks.families import family_key

IN_USE, BEYOND_USE = "in-use", "beyond-use"


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
    term: str = ""  # the output term it is about ("log-prob", "entropy"; `checks.terms`), "" for none
    context: str = ""  # the call context that decides it (`checks.families.context_of`), "" for none
    use: str = IN_USE  # IN_USE, or BEYOND_USE: on inputs the target's own callers never make (HARNESS_USE)
    beyond: str = ""  # why it is beyond the target's use: the HARNESS_USE entry's `why`
    script: str = ""  # the line that writes its stand-alone script (`script_command`), where one can be written
    # The size of the defect on its case: the largest |actual - expected| of its problems' worst entries
    # (None where no problem compares finite values), so that shrinking can keep it (`driver.explorer`).
    error: float | None = None

    @property
    def family(self) -> str:
        return family_key(self.check, self.term, self.context)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"family": self.family}


def gated(findings: list[Finding], fail_on: str) -> list[Finding]:
    """The new findings that fail a run under `--fail-on` (`options.FAIL_ON`): under in-use, only
    those in the target's use; the others are printed all the same."""
    return [f for f in findings if f.use == IN_USE] if fail_on == IN_USE else findings


def from_json(data: dict[str, Any]) -> Finding:
    """A finding of a result JSON (`to_json`) back."""
    return Finding(**{k: v for k, v in data.items() if k in Finding.__dataclass_fields__})


def repro_command(target: str, case: Case, env: str = "") -> str:
    """`env`: what the line must set to import the target from anywhere (`targets.repro_env`)."""
    return f"{env}python -m harness repro --target {shlex.quote(target)} {shlex.quote(case.spec())}"


def script_command(repro: str, check: str, term: str = "") -> str:
    """The repro line that writes the finding's stand-alone script for the routine's maintainers
    (`harness repro --script`: torch and the routine's own code, no harness)."""
    name = "_".join(p.replace("-", "_") for p in (check, term) if p)
    return f"{repro} --check {check}" + (f" --term {term}" if term else "") + f" --script {name}_repro.py"


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
