"""The shipped conformance suite: `pytest --pyargs harness.conformance --harness-target MODULE`."""
