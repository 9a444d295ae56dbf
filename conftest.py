"""The repository's own test session: the harness's plugin (loaded here too, so a plain checkout
works without the install), its markers, and the Hypothesis settings of its own property tests.

The settings profile is registered and loaded here, for this repository's tests only: the plugin
itself leaves Hypothesis alone (it loads into every pytest session where the package is installed).
"""
import importlib.metadata
import os

import pytest
from hypothesis import HealthCheck, settings

if not any(ep.value == "harness.plugin" for ep in importlib.metadata.entry_points(group="pytest11")):
    pytest_plugins = ["harness.plugin"]

MARKERS = {
    "gpu": "needs CUDA; skipped cleanly without it",
    "distributed": "runs on the TP worker pools",
    "perf": "performance measurement or gate",
    "slow": "long-running; deselect with -m 'not slow'",
}

# Derandomized under CI (no flakes, no example database); locally more examples and a database
# that keeps failures.
settings.register_profile("harness-tests", max_examples=8 if os.environ.get("CI") else 15, deadline=None, print_blob=True, report_multiple_bugs=False,
                          suppress_health_check=list(HealthCheck), derandomize=bool(os.environ.get("CI")),
                          database=None if os.environ.get("CI") else settings.default.database)
settings.load_profile("harness-tests")


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="CUDA is not available")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
