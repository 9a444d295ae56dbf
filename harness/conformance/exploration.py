"""What the shipped suite explores, and the session's explorations of it: `harness check`'s run, in
its order, with its cases.

The suite's tests are `check`'s plan (`explorer.plan`): one test per entry of the regression corpus,
in the corpus's order, then one test per check and step of randomized cases (every TP size asked
for, the profile's extra TP sizes, its DP and CP steps, the same case counts). A step is explored
once per session, by the same Hypothesis run `check` makes (the same seed, strategy and shrinking,
over all of the step's TP sizes at once), at the first of its tests; its tests then read their
check's outcome. So each check's findings are the CLI's with the same seed and profile, and the
first failing test comes when `check` finds its first failure. One `RunLimits` serves the session,
as it serves one `check` run: a hang's class is not hunted again, and `pytest -x` stops the
exploration at its first finding, as `check -x` does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.cases.case import Case
from harness.cases.profiles import Profile
from harness.checks.findings import Finding
from harness.driver.explorer import corpus_entry, explore, plan
from harness.driver.limits import RunLimits
from harness.driver.runner import Runner


@dataclass(frozen=True)
class Step:
    """One step of `check`'s plan: `cases` randomized cases of one level drawn over its TP sizes
    (TP groups in a world of `dp` replicas, with `cp` CP ranks)."""
    level: str
    tps: tuple[int, ...]
    cases: int
    dp: int = 1
    cp: int = 1

    @property
    def id(self) -> str:
        """`kernel-tp1-tp2-tp4`, `kernel-tp2-dp2`, `wrapper-tp1-tp2-cp2`: `-k tp2` selects the
        steps that draw TP 2 cases."""
        return "-".join([self.level, *(f"tp{tp}" for tp in self.tps)]) \
            + (f"-dp{self.dp}" if self.dp > 1 else "") + (f"-cp{self.cp}" if self.cp > 1 else "")


def steps(profile: Profile, levels: tuple[str, ...], tps: list[int], launched: bool,
          cp: list[int] | None) -> list[Step]:
    """`check`'s plan, step by step, in its order."""
    return [Step(level, tuple(sizes), n, dp, cp_size)
            for level, sizes, n, dp, cp_size in plan(profile, levels, tps, launched, cp)]


@dataclass
class CheckOutcome:
    """One check over one step (or one corpus entry)."""
    findings: list[Finding] = field(default_factory=list)
    applied: int = 0
    known: int = 0
    not_applied: dict[str, int] = field(default_factory=dict)


class Session:
    """The explorations of one pytest session, on its runner, each run at first use."""

    def __init__(self, runner: Runner, seed: int, selected: dict[str, set[str]], first_only: bool = False):
        self.runner = runner
        self.seed = seed
        # step id -> the checks the session selected of it, and every check it has a test of
        self.selected = selected
        self.limits = RunLimits(1 if first_only else None)
        self._done: dict[str, dict[str, CheckOutcome]] = {}

    def reported(self, findings: list[Finding]) -> list[Finding]:
        """The findings as `check` reports them: one per hang class, a finding on another hung case
        of a class folded into the one reported for it (`RunLimits.final`, as things stand when
        the test reads them)."""
        return self.limits.final(findings)

    @property
    def stopped(self) -> bool:
        """Whether the session's first finding ended its exploration (`pytest -x`)."""
        return self.limits.reached()

    def step(self, step: Step, checks: set[str]) -> dict[str, CheckOutcome]:
        """`checks`: every check the suite has a test of in this step; the session explores for
        those it selected, for all of them as `check` does when it selected every one."""
        if step.id not in self._done:
            chosen = self.selected.get(step.id) or checks
            only = None if chosen >= checks else chosen
            self._done[step.id] = self._measure(step.level, only or set(self.runner.checks), lambda: explore(
                self.runner, step.level, step.tps, step.cases, self.seed, shrink=True, limits=self.limits,
                dp=step.dp, cp=step.cp, only=only))
        return self._done[step.id]

    def corpus(self, name: str, case: Case) -> tuple[str | None, dict[str, CheckOutcome]]:
        """One corpus entry: (why it is not run, {}) or (None, each check's outcome on it)."""
        skipped: list[str | None] = [None]

        def run() -> list[Finding]:
            skipped[0], findings = corpus_entry(self.runner, case, self.limits)
            return findings
        outcomes = self._measure(case.level, set(self.runner.checks), run)
        return skipped[0], ({} if skipped[0] else outcomes)

    def _measure(self, level: str, checks: set[str], run: Any) -> dict[str, CheckOutcome]:
        """Run, and read each check's outcome off the runner's counts before and after."""
        stats = self.runner.verdicts.stats
        before = {n: (stats[(n, level)].applied, stats[(n, level)].known, dict(stats[(n, level)].not_applied))
                  for n in checks}
        findings = run()
        out = {}
        for n, (applied, known, not_applied) in before.items():
            st = stats[(n, level)]
            out[n] = CheckOutcome([f for f in findings if f.check == n], st.applied - applied, st.known - known,
                                  {k: v - not_applied.get(k, 0) for k, v in st.not_applied.items()
                                   if v > not_applied.get(k, 0)})
        return out
