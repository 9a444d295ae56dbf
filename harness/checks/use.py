"""A target's use: the inputs its own trainer's callers never make (`HARNESS_USE`), so that a
finding on them is told apart from one in the trainer's own use.

    HARNESS_USE = [
        {"where": {"regime": "neginf"},
         "why": "swift/megatron/trainers/grpo_trainer.py:812: the logits come from the model, never masked to -inf"},
        {"where": {}, "check": ["gradients", "tp-invariance"], "term": "entropy",
         "why": "grpo_trainer.py:1040: the entropy is a metric and a mask, never in the loss"},
    ]

Each entry has `where` (case fields, as a known file's `where`: docs/known-findings.md) and `why`
(the trainer's file and line that shows its callers never make such input), and optionally `check`
(a name or a list) and `term` (the output term, `checks.terms.TERMS`) when the use is about one
output. A finding that matches an entry is `beyond-use` (with that `why`); every other finding is
`in-use`. A target that declares nothing is in use everywhere. Cases beyond the use are still drawn:
they are the contract.
"""
from __future__ import annotations

from typing import Any

from harness.base.errors import TargetError, UsageError
from harness.checks.findings import Finding
from harness.checks.known import Entry, parse_checks, parse_term, parse_where

USE_KEYS = {"where", "why", "check", "term"}


def parse_use(spec: str, raw_entries: list[Any]) -> list[Entry]:
    """A target's `HARNESS_USE`, validated: an unknown key, check, term, case field or value is the
    target's error (exit 2), never an entry that silently matches everything or nothing."""
    out = []
    for i, raw in enumerate(raw_entries):
        at = f"{spec}: HARNESS_USE entry {i + 1}"
        try:
            if not isinstance(raw, dict) or set(raw) - USE_KEYS or "why" not in raw \
                    or not {"where", "check", "term"} & set(raw):
                raise UsageError(f"{at}: an entry has `where` (case fields) and `why` (the trainer's file:line), "
                                 f"optionally `check` and `term` (got {sorted(raw) if isinstance(raw, dict) else raw!r})")
            checks = parse_checks(raw["check"], at) if "check" in raw else ()
            term = parse_term(raw["term"], at) if "term" in raw else ""
            out.append(Entry(checks, parse_where(raw.get("where", {}), at), str(raw["why"]), term=term))
        except UsageError as e:
            raise TargetError(str(e)) from None
    return out


def beyond(finding: Finding, entries: list[Entry]) -> Entry | None:
    """The first entry of the target's use that puts the finding beyond it, or None (in use)."""
    return next((e for e in entries if e.matches(finding)), None)
