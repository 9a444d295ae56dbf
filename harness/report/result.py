"""The result JSON of `check --json`, which the reports (`render`, `view`, `matrix`), `peers` and
`history` read back: the run's target, cases, per-check statistics and findings (`result_json`),
and its known findings apart from the new ones (`known_json`). `check` adds the run's settings, and
each feature of `check` its own section (`baseline`, `memory_by_config`)."""
from __future__ import annotations

from typing import Any

from harness.checks.findings import Finding
from harness.driver.runner import Runner
from harness.meters import memory_meter


def result_json(runner: Runner, findings: list[Finding], elapsed: float, extra: dict[str, Any]) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for (name, lvl), st in runner.verdicts.stats.items():
        checks.setdefault(name, {})[lvl] = {"applied": st.applied, "failed": st.failed, "known": st.known,
                                             "max_margin": max(st.margins, default=None), "margins": st.margins,
                                             "margins_by_group": st.margins_by_group, "not_applied": st.not_applied}
    return {
        "target": runner.target.spec, "levels": list(runner.target.levels),
        "capabilities": runner.target.capabilities, "inferred_capabilities": runner.target.inferred,
        "not_checked": runner.target.not_checked, "cases_run": runner.cases_run,
        "elapsed_s": round(elapsed, 3), "case_seconds": round(runner.run_seconds, 3),
        "cases_per_s": round(runner.cases_run / runner.run_seconds, 2) if runner.run_seconds else None,
        "memory_ledger": memory_meter.ledger_name(),  # "cpp" or "python" (HARNESS_LEDGER)
        "findings": [f.to_json() for f in findings], "checks": checks,
        # Each family (`checks.families`): one defect's cases checked, failed, known, beyond the use.
        "families": {key: fam.to_json() for key, fam in runner.verdicts.families.items()},
        "use": [e.to_json() for e in runner.verdicts.use],
        "infrastructure_events": list(runner.events),  # not findings: a rank that died once, not again
        "bitwise": {config: {n: {"checked": c, "held": h} for n, (c, h) in got.items()}
                    for config, got in sorted(runner.verdicts.properties.items())} if runner.verdicts.properties else None,
        **extra,
    }


def known_json(runner: Runner, stopped: bool = False) -> dict[str, Any]:
    """The known findings apart from the new ones, and each entry of the --known file with its count.
    `stopped`: the run ended before its last case (`-x`, `--max-findings`, a signal), so an entry
    that matched nothing may match what it did not reach: none is stale."""
    if not runner.verdicts.known.path:
        return {"known_findings": [], "known": None}
    return {"known_findings": [f.to_json() for f in runner.verdicts.known_findings],
            "known": {"file": runner.verdicts.known.path, "entries": [e.to_json() for e in runner.verdicts.known.entries],
                      "stale": [] if stopped else [e.describe() for e in runner.verdicts.known.stale],
                      "stopped": stopped}}
