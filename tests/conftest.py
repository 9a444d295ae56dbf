"""The Hypothesis settings of the repository's own property tests. What its sessions share with the
benchmarks' (the checkout importable, the harness's plugin without the install, the `gpu` marker)
is in the root conftest.py; the benchmarks draw no cases with Hypothesis, so the profile stays here.
The markers and the built-in target of these tests are named in pyproject.toml.
"""
import importlib
import os

import pytest
from hypothesis import HealthCheck, settings

# Derandomized under CI (no flakes, no example database); locally more examples and a database
# that keeps failures.
settings.register_profile("harness-tests", max_examples=8 if os.environ.get("CI") else 15, deadline=None, print_blob=True, report_multiple_bugs=False,
                          suppress_health_check=list(HealthCheck), derandomize=bool(os.environ.get("CI")),
                          database=None if os.environ.get("CI") else settings.default.database)
settings.load_profile("harness-tests")


@pytest.fixture
def reload_adapter(monkeypatch, request):
    """The test module's `adapter` re-imported under a tree put on sys.path, and again without it after
    the test (an adapter reads its trainer's files when it is imported)."""
    adapter = request.module.adapter

    def at(root):
        monkeypatch.syspath_prepend(str(root))
        return importlib.reload(adapter)
    yield at
    monkeypatch.undo()
    importlib.reload(adapter)
