"""The benchmarks need pytest-benchmark, an extra of the package (`bench`): without it the session
stops at once with the line that installs it (exit 2)."""
import importlib.util

import pytest

from harness.base.extras import install_line


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("pytest_benchmark") is None:
        pytest.exit(f"benchmarks/ needs pytest-benchmark (the `bench` extra): {install_line('bench')}", returncode=2)
