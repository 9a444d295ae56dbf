"""Known findings: a TOML file of findings a CI gate accepts while they are being fixed.

    [[known]]
    check = "finite"                        # a check name, or a list of them
    where = { regime = "neginf" }           # case fields as case specs write them ("absent", 0/1
                                            # for flags); a list means any of them; omitted: every case
    term = "entropy"                        # optional: the output term the findings are about
    reason = "NaN entropy when a logit is -inf"
    link = "https://github.com/OWNER/REPO/issues/N"

A finding whose check and case match an entry is *known*: reported apart, and it does not fail the
run. An entry that matched nothing in the run is *stale* (the defect is fixed, or the run did not
reach it). `--strict` makes known findings and stale entries fail the run too.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library (installed on 3.10 only: pyproject)
    import tomli as tomllib  # pyright: ignore[reportMissingImports]

from harness.base import levels
from harness.base.errors import UsageError
from harness.cases.case import fmt_field, valid_values
from harness.checks import BASELINE_CHECKS, all_checks
from harness.checks.findings import Finding
from harness.checks.terms import TERMS

ENTRY_KEYS = {"check", "where", "term", "reason", "link"}


@dataclass
class Entry:
    checks: tuple[str, ...]  # () in a HARNESS_USE entry that names none: every check
    where: dict[str, tuple[Any, ...]]
    reason: str
    link: str = ""
    matched: int = 0
    term: str = ""  # the output term the findings must be about (`checks.terms.TERMS`); "": any

    def matches(self, finding: Finding) -> bool:
        if self.checks and finding.check not in self.checks:
            return False
        if self.term and finding.term != self.term:
            return False
        if not self.where:
            return True
        case = levels.parse(finding.case)
        # A field the finding's level does not have (a wrapper case's dtype) is not matched.
        return all(hasattr(case, key) and _field(case, key) in allowed for key, allowed in self.where.items())

    def describe(self) -> str:
        where = ", ".join(f"{k} = {v[0]}" if len(v) == 1 else f"{k} in {'|'.join(v)}" for k, v in self.where.items())
        checks = f"[{', '.join(self.checks)}]" if self.checks else "[every check]"
        term = f" ({self.term} term)" if self.term else ""
        return checks + term + (f" where {where}" if where else "") + f": {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"checks": list(self.checks), "where": {k: list(v) for k, v in self.where.items()},
                "term": self.term, "reason": self.reason, "link": self.link, "matched": self.matched}


def _spec_text(value: Any) -> str:
    """A TOML value as case specs write it: `true` and 1 are both "1", "absent" stays "absent"."""
    return value if isinstance(value, str) else fmt_field(value)


def _field(case: Any, key: str) -> str:
    return fmt_field(getattr(case, key))


def _choices() -> dict[str, tuple[str, ...]]:
    """The values a `where` condition may name, per field with a fixed set (any level's)."""
    out: dict[str, tuple[str, ...]] = {"level": tuple(levels.case_types())}
    for cls in levels.case_types().values():
        for name, values in valid_values(cls).items():
            out[name] = out.get(name, ()) + tuple(v for v in values if v not in out.get(name, ()))
    return out


@dataclass
class KnownFindings:
    entries: list[Entry] = field(default_factory=list)
    path: str = ""

    def classify(self, finding: Finding) -> Entry | None:
        """The first entry the finding matches (counted), or None for a new finding."""
        for entry in self.entries:
            if entry.matches(finding):
                entry.matched += 1
                return entry
        return None

    @property
    def stale(self) -> list[Entry]:
        return [e for e in self.entries if not e.matched]


def parse_checks(raw: Any, where: str) -> tuple[str, ...]:
    """A `check` value (a name or a list of names), every name a check's."""
    check_names = set(all_checks()) | set(BASELINE_CHECKS)
    checks = (raw,) if isinstance(raw, str) else tuple(raw)
    unknown = [c for c in checks if c not in check_names]
    if unknown:
        raise UsageError(f"{where}: unknown check(s) {unknown}; `python -m harness checks` lists them")
    return checks


def parse_term(raw: Any, where: str) -> str:
    if raw not in TERMS:
        raise UsageError(f"{where}: unknown term {raw!r}; valid: {', '.join(TERMS)}")
    return str(raw)


def parse_where(conditions: Any, where: str) -> dict[str, tuple[Any, ...]]:
    """A `where` table: case fields as specs write them, each a value or a list of them; an unknown
    field or value is a usage error, not silence."""
    if not isinstance(conditions, dict):
        raise UsageError(f"{where}: `where` is a table of case fields, got {conditions!r}")
    fields = {f for cls in levels.case_types().values() for f in cls.__dataclass_fields__} | {"T", "level", "vocab"}
    bad = sorted(set(conditions) - fields)
    if bad:
        raise UsageError(f"{where}: unknown case field(s) {bad}; known: {sorted(fields)} "
                         "(`python -m harness fields` lists them with their values)")
    choices = _choices()
    values = {k: tuple(map(_spec_text, v if isinstance(v, list) else [v])) for k, v in conditions.items()}
    for key, given in values.items():
        unknown = [v for v in given if key in choices and v not in choices[key]]
        if unknown:
            raise UsageError(f"{where}: unknown {key} value(s) {unknown}; valid: {', '.join(choices[key])}")
    return values


def load(path: str | Path) -> KnownFindings:
    """Parse and validate the file: unknown checks, fields or keys are usage errors, not silence."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"cannot read known findings {path}: {e}") from None
    entries = []
    for i, raw in enumerate(data.get("known", [])):
        where = f"{path}: entry {i + 1}"
        if not isinstance(raw, dict) or set(raw) - ENTRY_KEYS or "check" not in raw or "reason" not in raw:
            raise UsageError(f"{where}: an entry has `check` and `reason`, optionally `where`, `term` and `link` "
                             f"(got {sorted(raw) if isinstance(raw, dict) else raw!r})")
        term = parse_term(raw["term"], where) if "term" in raw else ""
        entries.append(Entry(parse_checks(raw["check"], where), parse_where(raw.get("where", {}), where),
                             str(raw["reason"]), str(raw.get("link", "")), term=term))
    if set(data) - {"known"}:
        raise UsageError(f"{path}: unexpected top-level key(s) {sorted(set(data) - {'known'})}; use [[known]] tables")
    return KnownFindings(entries, str(path))
