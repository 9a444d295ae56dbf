"""The shipped conformance suite: `pytest --pyargs harness.conformance --target MODULE`."""
