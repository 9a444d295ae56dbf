"""Shrinking keeps the finding's size, and the covering draw runs first (`harness.driver.explorer`).

A stub runner stands in for the ranks: its "routine" is wrong on every case of two rows or more, by
about 1 on most seeds and by 3e-5 on seeds below 1000 (where the inputs happen to hide it), so that
plain shrinking, which takes the seed to 0, would report a defect that reads as rounding. No process
is started.
"""
from __future__ import annotations

from types import SimpleNamespace

from harness.cases.case import Case, DistillCase, KernelCase
from harness.cases.strategies import DISTILL_COMBINATIONS, FAR_TAIL_FUNCTIONS, distill_cover
from harness.checks.findings import Finding
from harness.driver import explorer
from harness.driver.explorer import SHRINK_KEEPS_ERROR, explore

LARGE = 1.0  # |error| on most seeds
SMALL = 3e-5  # on seeds below 1000


class StubRunner:
    """The part of `Runner` the explorer uses: one check, `values`, failing on two rows or more."""

    def __init__(self, error_of=lambda case: LARGE if case.seed >= 1000 else SMALL):
        self.target = SimpleNamespace(supports=lambda capability: True)
        self.checks = {"values": None}
        self.error_of = error_of
        self.ran: list[Case] = []

    def has_run(self, case: Case) -> bool:
        return False

    def check(self, case: Case, only=None):
        self.ran.append(case)
        ev = SimpleNamespace(ranks=[])  # no rank hung
        if case.T < 2:
            return ev, []
        return ev, [Finding("values", case.level, case.spec(), "values: wrong", "repro",
                              error=self.error_of(case))]

    def explain(self, findings: list[Finding]) -> list[Finding]:
        return findings


def test_shrinking_keeps_the_size_of_the_defect():
    """Without the rule, Hypothesis shrinks the seed to 0, where the error is 3e-5: the finding would
    understate a defect of size 1 by 30000x. With it, the shrunk case keeps an error within 10x."""
    (found,) = explore(StubRunner(), "kernel", [1], 40, seed=0)
    assert found.shrunk and found.error is not None
    assert found.error * SHRINK_KEEPS_ERROR >= LARGE, found.case
    assert "T=2," in found.case and "seed=1000" in found.case  # still the smallest such case


def test_a_shrunk_finding_names_the_error_it_was_shrunk_from():
    """Within the factor but smaller: the finding says both sizes."""
    runner = StubRunner(lambda case: LARGE if case.seed >= 1000 else 0.2)
    (found,) = explore(runner, "kernel", [1], 40, seed=0)
    assert found.error == 0.2 and "on the case it was shrunk from" in found.message


def test_covering_cases_run_first_within_the_budget():
    """At the distillation level every combination of the contract is drawn, at any TP sizes, first and
    within the budget; without shrinking, their findings are reported as they come."""
    runner = StubRunner()
    findings = explore(runner, "distill", [1, 2], 40, seed=1, shrink=False)
    cover = distill_cover([1, 2], 1, 40)
    n = len(DISTILL_COMBINATIONS) + len(FAR_TAIL_FUNCTIONS)
    assert len(cover) == n and runner.ran[:n] == cover and len(runner.ran) <= 40
    assert {(c.kind, c.teacher, c.renormalize) for c in cover[:len(DISTILL_COMBINATIONS)]
            if c.teacher != "full"} == {t for t in DISTILL_COMBINATIONS if t[1] != "full"}
    assert {c.tp for c in cover} == {1, 2} and len(findings) >= n


def test_a_covering_finding_waits_for_a_shrinkable_one():
    """With shrinking, a check the covering cases fail is reported on the random search's shrunk case
    when the search fails it too, and on the covering case (not shrunk) only when it does not."""
    only_cover = StubRunner(lambda case: LARGE)
    cover = set(distill_cover([1], 0, 40))
    only_cover.check = lambda case, only=None: StubRunner.check(only_cover, case) if case in cover \
        else (SimpleNamespace(ranks=[]), [])
    (found,) = explore(only_cover, "distill", [1], 40, seed=0)
    assert not found.shrunk and explorer.levels.parse(found.case) in cover
    (shrunk,) = explore(StubRunner(lambda case: LARGE), "distill", [1], 40, seed=0)
    assert shrunk.shrunk


def test_cover_needs_room_for_a_random_case():
    assert distill_cover([1, 2, 4], 0, 20) == []
    assert all(isinstance(c, DistillCase) and c.T >= 1 and 2 <= c.k < c.vocab for c in distill_cover([4], 3, 99))
    assert not isinstance(distill_cover([1], 0, 99)[0], KernelCase)
