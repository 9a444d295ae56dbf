"""A pytest plugin for `test_route_parity.py` (`-p tests.parity_probe`, the checkout on PYTHONPATH):
records each finding the shipped suite's tests fail with into `pytest.json` in the current directory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

FINDINGS: list[dict] = []


def pytest_configure(config: pytest.Config) -> None:
    import harness.conformance.test_conformance as suite

    conclude = suite._conclude

    def recording(request, findings, known, what):
        FINDINGS.extend({"check": f.check, "case": f.case, "shrunk": f.shrunk} for f in findings)
        return conclude(request, findings, known, what)
    suite._conclude = recording


def pytest_sessionfinish(session: pytest.Session) -> None:
    Path("pytest.json").write_text(json.dumps({"findings": FINDINGS}))
