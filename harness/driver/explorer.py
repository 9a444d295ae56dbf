"""Randomized exploration with Hypothesis: draws cases in the main process, runs them through the
runner, and shrinks each newly failing check to a minimal case that keeps the defect's size (its
|error| within `SHRINK_KEEPS_ERROR` of the first failing case's). A level with a covering draw
(`Level.cover`) has its covering cases run first, in the budget.

One Hypothesis run stops at its first failure and shrinks it. To see past a first failing check,
exploration goes in rounds: each round ignores the checks that already have a shrunk finding.

`RunLimits` (optional) keeps a run from paying for a hang twice: cases of a hang's class are
skipped once it is shrunk, shrinking a hang has a budget, and the run stops at `--max-findings`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from hypothesis import given
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

from harness.base import levels
from harness.base.errors import HarnessError
from harness.cases.case import Case
from harness.cases.corpus import CORPUS
from harness.cases.profiles import Profile, explore_settings
from harness.checks.findings import Finding
from harness.driver import torchrun
from harness.driver.limits import HANG_SHRINK_MAX_CASES, RunLimits, hung
from harness.driver.runner import Runner

CORPUS_BY_NAME = {entry.name: entry for entry in CORPUS}
# Shrinking keeps the defect's size: a smaller case is taken only where its |error| stays within this
# factor of the error on the case the search first failed (a shrunk case with |error| 3e-5 where the
# drawn one had 1 would read as a rounding matter).
SHRINK_KEEPS_ERROR = 10.0


@contextlib.contextmanager
def draws_of_the_seed() -> Iterator[None]:
    """While exploring: Hypothesis without its "local constants". Besides its own fixed constants,
    Hypothesis draws literals it finds in the modules loaded at the time (every module outside
    site-packages and test folders: an editable install's harness, the target's tree, a user's
    code), so one seed would draw different cases in `check` and in a pytest session, which load
    different modules. Without them (and without the cache of them another test of the session
    may have filled), a seed draws the same cases in any process. A Hypothesis without local
    constants has nothing to set aside."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants

        saved = providers._get_local_constants, providers.CONSTANTS_CACHE
        fresh = type(saved[1])(1024)
    except (ImportError, AttributeError, TypeError):
        yield
        return
    none = Constants()
    providers._get_local_constants, providers.CONSTANTS_CACHE = (lambda: none), fresh
    try:
        yield
    finally:
        providers._get_local_constants, providers.CONSTANTS_CACHE = saved


class _Stop(Exception):
    pass


class _Infrastructure(BaseException):
    """An error of the harness's own (a pool that cannot start) raised inside a Hypothesis run: a
    BaseException, so Hypothesis passes it on at once instead of shrinking it as a failure of the
    routine (and meeting the pool it left closed)."""
    def __init__(self, error: HarnessError):
        super().__init__(str(error))
        self.error = error


class _NewFailure(Exception):
    def __init__(self, findings: list[Finding], case: Case):
        super().__init__(f"{len(findings)} finding(s)")
        self.findings = findings
        self.case = case


def strategy_for(runner: Runner, level: str, tps: Iterable[int], dp: int = 1, cp: int = 1) -> st.SearchStrategy:
    t = runner.target
    extra = {"cp": st.just(cp)} if cp > 1 else {}  # the axis of a level with CP counts
    return levels.get(level).strategy(tp=st.sampled_from(tuple(tps)), entropy=t.supports("entropy"),
                                      keep_mask=t.supports("keep_mask"), dp=st.just(dp), **extra)


def _keeps_size(finding: Finding, origin: dict[str, float | None]) -> bool:
    """Whether a failure met while shrinking is as large as the first one of its check: within
    `SHRINK_KEEPS_ERROR` of its |error| (a check the first failure did not have, or a size that
    cannot be told, e.g. a NaN, counts as kept)."""
    first = origin.get(finding.check)
    return first is None or finding.error is None or finding.error * SHRINK_KEEPS_ERROR >= first


def _size_note(finding: Finding, origin: dict[str, float | None]) -> str:
    """What a shrunk finding says of its size next to the case's it came from (when they differ by 2x)."""
    first = origin.get(finding.check)
    if first is None or finding.error is None or first <= 2 * finding.error:
        return ""
    return f"|error| {finding.error:.3g} here, {first:.3g} on the case it was shrunk from"


def run_cover(runner: Runner, cases: list[Case], only: set[str] | None, limits: RunLimits | None,
              progress: Callable[[str], None], label: str) -> tuple[list[Finding], bool]:
    """The level's covering cases (`Level.cover`), each run once: (their findings, and whether the run
    must stop: its limits reached)."""
    found: list[Finding] = []
    for i, case in enumerate(cases, 1):
        if limits is not None and not runner.has_run(case) and limits.skip(case):
            continue
        ev, findings = runner.check(case, only=only)
        if limits is not None:
            limits.observe(ev)
            limits.record([f for f in findings if all(f.check != g.check for g in found)])  # one per check
        found += findings
        if i % 25 == 0:
            progress(f"{label}: {i} covering cases")
        if limits is not None and limits.reached():
            return found, True
    return found, False


def corpus_cases(levels: Iterable[str], tps: Iterable[int]) -> list[tuple[str, Any]]:  # a case of any level
    """The regression corpus's entries of these levels, in its order, each as (name, case) at a TP
    size asked for (a case at another size moves to the largest)."""
    tps, levels = sorted(tps), set(levels)
    return [(entry.name, _at_tp(entry.case, tps)) for entry in CORPUS if entry.case.level in levels]


def _at_tp(case: Any, tps: list[int]) -> Any:
    """The case at a TP size asked for, or as it is where its level takes no other (a per-token level's
    cases run at TP 1 whatever the sizes asked for: its case class refuses another)."""
    if case.tp in tps:
        return case
    try:
        return case.replace(tp=tps[-1])
    except ValueError:
        return case


def corpus_entry(runner: Runner, case: Case, limits: RunLimits | None = None) -> tuple[str | None, list[Finding]]:
    """One corpus case: (why it is not run, []) or (None, its findings, explained)."""
    if getattr(case, "cp", 1) > 1 and torchrun.active():
        return "a launched world has no context-parallel groups: run CP cases without the launcher", []
    if limits is not None and not runner.has_run(case) and limits.skip(case, unshrunk=True):
        return limits.skip_reason(case, unshrunk=True), []
    ev, fs = runner.check(case)
    findings = runner.explain(fs)
    if limits is not None:
        limits.observe(ev)
        limits.record(fs)
    return None, findings


def run_corpus(runner: Runner, tps: Iterable[int], progress: Callable[[str], None] = lambda s: None,
               stop: Callable[[list[Finding]], bool] | None = None, limits: RunLimits | None = None,
               levels: Iterable[str] | None = None) -> list[Finding]:
    """The regression corpus, at the TP sizes asked for (cases at other sizes move to the largest);
    `stop` ends it early once the findings so far satisfy it; `levels`: only these levels' entries."""
    levels = runner.target.levels if levels is None else [lv for lv in levels if lv in runner.target.levels]
    findings: list[Finding] = []
    for name, case in corpus_cases(levels, tps):
        skipped, fs = corpus_entry(runner, case, limits)
        if skipped:
            progress(f"corpus {name}: skipped ({skipped})")
            continue
        findings += fs
        tp = CORPUS_BY_NAME[name].case.tp
        moved = f" (ran at TP {case.tp}: its TP {tp} was not asked for)" if case.tp != tp else ""
        progress(f"corpus {name}{moved}: {'ok' if not fs else ', '.join(sorted({f.check for f in fs}))}")
        if (stop is not None and stop(findings)) or (limits is not None and limits.reached()):
            break
    return findings


def explore(runner: Runner, level: str, tps: Iterable[int], max_examples: int, seed: int,
            shrink: bool = True, progress: Callable[[str], None] = lambda s: None,
            stop: Callable[[list[Finding]], bool] | None = None, limits: RunLimits | None = None,
            dp: int = 1, cp: int = 1, only: set[str] | None = None) -> list[Finding]:
    """Random cases of one level (TP groups in a world of `dp` replicas, and of `cp` CP ranks at the
    wrapper level); returns one finding per
    (newly) failing check, shrunk when asked. Without shrinking, every finding of every case is
    returned; `stop` ends the search early once the findings so far satisfy it. `only`: these
    checks alone (None: every check of the runner)."""
    strategy = strategy_for(runner, level, tps, dp, cp)
    label = level + (f" (DP {dp})" if dp > 1 else "") + (f" (CP {cp})" if cp > 1 else "")
    known: set[str] = set()
    out: list[Finding] = []
    # The level's covering draw first, in the budget: every combination it stands for is reached at any
    # seed and TP sizes. Without shrinking its findings are reported as they come; with it, they wait for
    # the random search to fail the same check on a case it can shrink, and are reported as drawn if not.
    cover = levels.get(level).cover
    covering = cover(sorted(set(tps)), seed, max_examples, dp) if cover is not None and cp == 1 else []
    covered, halted = run_cover(runner, covering, only, limits, progress, label) if covering else ([], False)
    max_examples -= len(covering)
    if not shrink:
        out += covered
        if halted or (stop is not None and stop(out)):
            return out
    for round_ in range(len(only or runner.checks) + 1):
        if halted:
            break
        collected: list[Finding] = list(out) if not shrink else []
        count = [0]
        hang_shrink = {"on": False, "cases": 0}
        origin: dict[str, float | None] = {}  # the first failure's |error| per check, which shrinking keeps

        @hyp_seed(seed * 1000 + round_)
        @explore_settings(max_examples, shrink)
        @given(strategy)
        def probe(case):
            if limits is not None and not runner.has_run(case):
                if hang_shrink["on"] and hang_shrink["cases"] >= HANG_SHRINK_MAX_CASES:
                    return  # shrinking budget spent: the smallest hanging case so far is the finding
                if limits.skip(case):
                    return
            try:
                ev, findings = runner.check(case, only=only)
            except HarnessError as e:
                raise _Infrastructure(e) from None
            count[0] += 1
            if count[0] % 25 == 0:
                progress(f"{label}: {count[0]} cases")
            if limits is not None:
                limits.observe(ev)
                if hang_shrink["on"] and hung(ev):
                    hang_shrink["cases"] += 1
            new = [f for f in findings if f.check not in known]
            if new and shrink:
                if not origin:
                    origin.update((f.check, f.error) for f in new)
                new = [f for f in new if _keeps_size(f, origin)]
                if not new:
                    return  # a smaller defect than the one found: not what is being shrunk
                hang_shrink["on"] = hang_shrink["on"] or hung(ev)
                raise _NewFailure(new, case)
            collected.extend(new)
            if limits is not None:
                limits.record(new)
            if (stop is not None and stop(collected)) or (limits is not None and limits.reached()):
                raise _Stop

        try:
            with draws_of_the_seed():
                probe()
        except _Stop:
            pass
        except _Infrastructure as stopped:
            raise stopped.error from None
        except _NewFailure as failure:  # re-raised by Hypothesis from the shrunk example
            for f in runner.explain(failure.findings):
                f.shrunk = True
                note = _size_note(f, origin)
                if note:
                    f.message = f"{f.message}; {note}"[:4000]
                known.add(f.check)
                out.append(f)
                progress(f"{label}: {f.check} fails; shrunk to {f.case}" + (f" ({note})" if note else ""))
            if limits is not None:
                limits.record(failure.findings)
                if any(f.check == "hang" for f in failure.findings):
                    limits.confirm_hang(failure.findings[0], failure.case)
                if limits.reached():
                    break
            continue
        out = collected if not shrink else out + collected
        break
    # Covering findings of checks the random search did not fail: reported on the case drawn (the first).
    pending: dict[str, Finding] = {}
    for f in covered if shrink else ():
        if f.check not in known:
            pending.setdefault(f.check, f)
    for f in runner.explain(list(pending.values())):
        out.append(f)
        progress(f"{label}: {f.check} fails on a covering case (not shrunk): {f.case}")
    return out


def plan(profile: Profile, levels_of_run: Iterable[str], tps: list[int], launched: bool = False,
         cp: Iterable[int] | None = None) -> list[tuple[str, list[int], int, int, int]]:
    """What `harness check` explores: (level, TP sizes, cases, DP, CP) per step. Every TP size asked
    for, then the profile's extra ones (except under a launcher, whose world is fixed) in a step of
    their own at the profile's share of the per-size counts, at DP 1;
    then the profile's DP sizes, TP groups inside a world of 2 replicas; then wrapper cases in
    TP x CP worlds of the levels that take CP, at the CP sizes asked for (`cp`; None: the profile's).
    The counts per TP size are each level's own at the profile (`Level.counts`)."""
    asked = sorted(set(tps))
    extra = [] if launched else sorted(set(profile.extra_tp) - set(tps))
    sizes = sorted(asked + extra)
    counts = {lv: levels.get(lv).counts for lv in levels_of_run}
    dp_sizes = [] if launched else [tp for tp in sizes if tp in profile.dp_tp]
    steps = []
    for level, n in ((lv, c.cases.get(profile.name, 0)) for lv, c in counts.items()):
        if not n:
            continue
        steps.append((level, asked, n * len(asked), 1, 1))
        if extra:
            steps.append((level, extra, max(1, round(n * profile.extra_tp_share)) * len(extra), 1, 1))
    if dp_sizes:
        steps += [(level, dp_sizes, n * len(dp_sizes), 2, 1) for level, c in counts.items()
                  if (n := c.dp.get(profile.name, 0))]
    cp_sizes = [] if launched else sorted(set(profile.cp_sizes if cp is None else cp) - {1})
    cp_tps = [tp for tp in sizes if tp in profile.cp_tp] or sizes[:1]
    steps += [(level, cp_tps, n * len(cp_tps), 1, size) for level, c in counts.items()
              if (n := c.cp.get(profile.name, 0)) for size in cp_sizes]
    return steps
