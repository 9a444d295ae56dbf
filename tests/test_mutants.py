"""The mutation catalog as a CI gate: every check can fail, and every mutant dies by the check
meant to catch it. By default a fast subset runs: the fewest mutants that between them are expected
to trip every registered check. The whole catalog runs under `-m slow`.
"""
from __future__ import annotations

import pytest

from harness.checks import all_checks
from harness.commands.mutate import CLEAN, kill_matrix, run_catalog
from harness.targets.mutants import catalog

pytestmark = pytest.mark.distributed

TPS = [1, 2, 4]


def _cover() -> list[str]:
    """Greedy set cover of the registered checks by the mutants' expected checks."""
    entries = {n: m for n, m in catalog().items() if not m.needs_baseline}
    left = set(all_checks(bitwise=True))
    chosen = []
    while left:
        name = max(sorted(entries), key=lambda n: len(left & set(entries[n].expected)))
        gained = left & set(entries[name].expected)
        if not gained:
            break
        chosen.append(name)
        left -= gained
    return chosen


def test_every_check_is_expected_to_kill_some_mutant():
    expected = {c for m in catalog().values() for c in m.expected}
    unkillable = set(all_checks(bitwise=True)) - expected
    assert not unkillable, f"checks no mutant exercises (a check that cannot fail is a defect): {unkillable}"


def test_every_mutant_names_registered_checks():
    checks = set(all_checks(bitwise=True))
    for m in catalog().values():
        assert set(m.expected) <= checks | {e for e in m.expected if e.startswith("perf-")}, m
        assert m.defect and m.expected


def _assert_all_killed(results) -> None:
    matrix = kill_matrix(results)
    clean = next(r for r in results if r.name == CLEAN)
    assert clean.ok, f"the clean routine has findings:\n{matrix}"
    survivors = [r.name for r in results if not r.ok]
    assert not survivors, f"survivors {survivors}:\n{matrix}"


def test_fast_subset_is_killed_by_expected_checks(harness_pools):
    names = _cover()
    results = run_catalog(names, TPS, harness_pools, budget=40, collective_timeout_s=6)
    _assert_all_killed(results)
    fired = {c for r in results if r.name != CLEAN for c in r.fired if c in r.expected}
    every = set(all_checks(bitwise=True))
    assert fired == every, f"checks never seen failing: {every - fired}"


@pytest.mark.slow
def test_whole_catalog_is_killed(harness_pools):
    names = [n for n, m in catalog().items() if not m.needs_baseline]
    _assert_all_killed(run_catalog(names, TPS, harness_pools, budget=60, collective_timeout_s=6))
