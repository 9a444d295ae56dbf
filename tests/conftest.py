"""The repository's own test session: the harness's plugin (loaded here too, so a plain checkout
works without the install) and the Hypothesis settings of its own property tests.

It lives in `tests/`, not at the checkout's root: pytest loads a conftest.py found above any
directory it collects, the installed `harness.conformance` included, so at the root it would act in
every session of a user's that runs the shipped suite from an editable install (its Hypothesis
profile loaded over the user's, the checkout put on `sys.path`). The markers and the built-in
target of these tests are named in pyproject.toml.
"""
import importlib.metadata
import os

import pytest
from hypothesis import HealthCheck, settings

if not any(ep.value == "harness.plugin" for ep in importlib.metadata.entry_points(group="pytest11")):
    pytest_plugins = ["harness.plugin"]

# Derandomized under CI (no flakes, no example database); locally more examples and a database
# that keeps failures.
settings.register_profile("harness-tests", max_examples=8 if os.environ.get("CI") else 15, deadline=None, print_blob=True, report_multiple_bugs=False,
                          suppress_health_check=list(HealthCheck), derandomize=bool(os.environ.get("CI")),
                          database=None if os.environ.get("CI") else settings.default.database)
settings.load_profile("harness-tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="CUDA is not available")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
