"""The built-in routine against the whole check registry (the shipped suite, run from the repo)."""
from harness.conformance.test_conformance import (test_corpus, test_check, harness_session,  # noqa: F401
                                                  pytest_generate_tests)
