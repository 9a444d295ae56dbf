"""The built-in routine against the whole check registry (the shipped suite, run from the repo)."""
from harness.conformance.test_conformance import harness_session, pytest_generate_tests, test_check, test_corpus  # noqa: F401
