"""A target's declared capabilities hold on every path that makes cases: the Hypothesis strategies,
the regression corpus, the twins the checks ask for, and the benchmark cases of the performance
gate. The target below raises on anything it declared it does not take."""
from __future__ import annotations

import pytest

from harness.base.levels import fit
from harness.cases.benchmarks import PERF_CASES
from harness.cases.capabilities import needs
from harness.cases.corpus import CORPUS
from harness.checks import all_checks
from harness.driver.explorer import explore, run_corpus
from harness.driver.runner import Runner
from harness.perf.gate import benchmark_cases

LIMITED = "tests.targets.limited"


@pytest.fixture(scope="module")
def runner(harness_pools):
    return Runner(LIMITED, collective_timeout_s=6, pools=harness_pools)


def test_fit_removes_exactly_what_is_missing():
    lacks_all = lambda feature: False  # noqa: E731
    for entry in CORPUS:
        fitted = fit(entry.case, lacks_all)
        assert not needs(fitted)
        assert fit(entry.case, lambda f: True) == entry.case
        assert fit(fitted, lacks_all) == fitted  # idempotent


@pytest.mark.distributed
def test_corpus_and_twins_honour_the_capabilities(runner):
    findings = run_corpus(runner, [1, 2])
    assert not findings, [f"{f.check}: {f.message[:200]}" for f in findings]
    twin_checks = [c for c in all_checks().values() if c.twin is not None]
    assert any(runner.verdicts.stats[(c.name, lvl)].applied for c in twin_checks for lvl in c.levels)


@pytest.mark.distributed
def test_strategies_honour_the_capabilities(runner):
    for level in runner.target.levels:
        findings = explore(runner, level, [1, 2], 15, seed=3, shrink=False)
        assert not findings, [f"{f.check}: {f.message[:200]}" for f in findings]


@pytest.mark.distributed
def test_benchmark_cases_honour_the_capabilities(runner):
    cases = benchmark_cases(runner, [1, 2, 4])
    assert cases and all(not needs(c) for c in cases)
    assert len(cases) < len(PERF_CASES) or any(c not in PERF_CASES for c in cases)
    for case in cases:
        assert not runner.run(case).failed_ranks
