"""Targets of other designs, importable as `tests.targets.NAME` (run from the repository root)."""
