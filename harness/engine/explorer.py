"""Randomized exploration with Hypothesis: draws cases in the main process, runs them through the
runner, and shrinks each newly failing check to a minimal case.

One Hypothesis run stops at its first failure and shrinks it. To see past a first failing check,
exploration goes in rounds: each round ignores the checks that already have a shrunk finding.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from hypothesis import given
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

from cases.corpus import CORPUS
from cases.profiles import explore_settings
from cases.strategies import LEVEL_STRATEGIES
from harness.engine.runner import Runner
from harness.findings import Finding


class _Stop(Exception):
    pass


class _NewFailure(Exception):
    def __init__(self, findings: list[Finding]):
        super().__init__(f"{len(findings)} finding(s)")
        self.findings = findings


def strategy_for(runner: Runner, level: str, tps: Iterable[int]) -> st.SearchStrategy:
    t = runner.target
    return LEVEL_STRATEGIES[level](tp=st.sampled_from(tuple(tps)), entropy=t.supports("entropy"),
                                   keep_mask=t.supports("keep_mask"))


def run_corpus(runner: Runner, tps: Iterable[int], progress: Callable[[str], None] = lambda s: None,
               stop: Callable[[list[Finding]], bool] | None = None) -> list[Finding]:
    """The regression corpus, at the TP sizes asked for (cases at other sizes move to the largest);
    `stop` ends it early once the findings so far satisfy it."""
    tps = sorted(tps)
    findings: list[Finding] = []
    for entry in CORPUS:
        case = entry.case
        if case.level not in runner.target.levels:
            continue
        if case.tp not in tps:
            case = case.replace(tp=tps[-1])
        _, fs = runner.check(case)
        findings += fs
        progress(f"corpus {entry.name}: {'ok' if not fs else ', '.join(sorted({f.check for f in fs}))}")
        if stop is not None and stop(findings):
            break
    return findings


def explore(runner: Runner, level: str, tps: Iterable[int], max_examples: int, seed: int,
            shrink: bool = True, progress: Callable[[str], None] = lambda s: None,
            stop: Callable[[list[Finding]], bool] | None = None) -> list[Finding]:
    """Random cases of one level; returns one finding per (newly) failing check, shrunk when asked.
    Without shrinking, every finding of every case is returned; `stop` ends the search early once
    the findings so far satisfy it."""
    strategy = strategy_for(runner, level, tps)
    known: set[str] = set()
    out: list[Finding] = []
    for round_ in range(len(runner.checks) + 1):
        collected: list[Finding] = []
        count = [0]

        @hyp_seed(seed * 1000 + round_)
        @explore_settings(max_examples, shrink)
        @given(strategy)
        def probe(case):
            _, findings = runner.check(case)
            count[0] += 1
            if count[0] % 25 == 0:
                progress(f"{level}: {count[0]} cases")
            new = [f for f in findings if f.check not in known]
            if new and shrink:
                raise _NewFailure(new)
            collected.extend(new)
            if stop is not None and stop(collected):
                raise _Stop

        try:
            probe()
        except _Stop:
            pass
        except _NewFailure as failure:  # re-raised by Hypothesis from the shrunk example
            for f in failure.findings:
                f.shrunk = True
                known.add(f.check)
                out.append(f)
                progress(f"{level}: {f.check} fails; shrunk to {f.case}")
            continue
        out.extend(collected)
        break
    return out
