"""The built-in routine against the whole check registry (the shipped suite, run from the repo)."""
from harness.conformance.test_conformance import pytest_generate_tests, test_check  # noqa: F401
