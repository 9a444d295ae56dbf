"""What the shipped suite explores, and the session's explorations of it.

The suite explores what `harness check` explores with the same profile (`explorer.plan`: every TP
size asked for, the profile's extra TP sizes, DP replicas and CP sizes, the same case counts), one
family of cases per level and size, plus the regression corpus. Each family is explored once per
session, for every check of it the session selected, each failing check shrunk as `check` shrinks
it; the tests of the family then read their check's outcome. A case runs once however many checks
read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.cases.profiles import Profile
from harness.checks.findings import Finding
from harness.driver.explorer import explore, plan, run_corpus
from harness.driver.limits import RunLimits
from harness.driver.runner import Runner


@dataclass(frozen=True)
class Family:
    """The randomized cases of one level at one TP size (in a world of `dp` replicas, with `cp` CP
    ranks), `cases` of them."""
    level: str
    tp: int
    cases: int
    dp: int = 1
    cp: int = 1

    @property
    def id(self) -> str:
        return f"{self.level}-tp{self.tp}" + (f"-dp{self.dp}" if self.dp > 1 else "") + (f"-cp{self.cp}" if self.cp > 1 else "")


def families(profile: Profile, levels: tuple[str, ...], tps: list[int], launched: bool,
             cp: list[int] | None) -> list[Family]:
    """`check`'s plan, one family per TP size of each step (a step's cases are per TP size times
    its sizes)."""
    return [Family(level, tp, n // len(sizes), dp, cp_size)
            for level, sizes, n, dp, cp_size in plan(profile, levels, tps, launched, cp) for tp in sizes]


@dataclass
class CheckOutcome:
    """One check over one family (or one level of the corpus)."""
    findings: list[Finding] = field(default_factory=list)
    applied: int = 0
    known: int = 0
    not_applied: dict[str, int] = field(default_factory=dict)


class Session:
    """The explorations of one pytest session, on its runner, each run at first use."""

    def __init__(self, runner: Runner, seed: int, selected: dict[str, set[str]], first_only: bool = False):
        self.runner = runner
        self.seed = seed
        self.selected = selected  # family id -> the checks the session selected of it
        # A hang shrunk once is not hunted again in the next family; `first_only` (pytest -x): the
        # first finding ends every exploration, as `check -x` stops at it.
        self.limits = RunLimits(1 if first_only else None)
        self._done: dict[str, dict[str, CheckOutcome]] = {}

    def family(self, fam: Family) -> dict[str, CheckOutcome]:
        if fam.id not in self._done:
            only = self.selected.get(fam.id) or set(self.runner.checks)
            self._done[fam.id] = self._measure(fam.level, only, lambda: explore(
                self.runner, fam.level, [fam.tp], fam.cases, self.seed, shrink=True, limits=self.limits,
                dp=fam.dp, cp=fam.cp, only=only))
        return self._done[fam.id]

    def corpus(self, level: str, tps: list[int]) -> dict[str, CheckOutcome]:
        key = f"corpus-{level}"
        if key not in self._done:
            self._done[key] = self._measure(level, set(self.runner.checks), lambda: run_corpus(
                self.runner, tps, limits=self.limits, levels=[level]))
        return self._done[key]

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
