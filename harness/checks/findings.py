"""Findings: what a run reports, each with the one-line command that reproduces it."""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from cases.case import Case


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
