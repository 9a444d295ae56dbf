"""A pytest plugin for `route_parity.py` (`-p parity_probe`, this folder on PYTHONPATH): records each
finding the shipped suite's tests fail with, and when the session's first test failed (time.time()), into
`pytest.json` in the current directory."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

FINDINGS: list[dict] = []
FIRST: list[float] = []


def pytest_configure(config: pytest.Config) -> None:
    import harness.conformance.test_conformance as suite

    conclude = suite._conclude

    def recording(request, findings, known, what):
        FINDINGS.extend({"check": f.check, "case": f.case, "shrunk": f.shrunk} for f in findings)
        return conclude(request, findings, known, what)
    suite._conclude = recording


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and not FIRST:
        FIRST.append(time.time())


def pytest_sessionfinish(session: pytest.Session) -> None:
    Path("pytest.json").write_text(json.dumps({"findings": FINDINGS, "first_failure_at": FIRST[0] if FIRST else None}))
