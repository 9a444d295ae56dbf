"""`python -m harness mutate`: run the checks against every mutant of the catalog and print the
kill matrix. Exit 0 only when every mutant is killed by a check meant to catch it and the clean
routine has no finding.

Each mutant is hunted with the regression corpus first, then with randomized cases (no shrinking),
and the hunt stops as soon as every expected check has fired. All mutants share one set of pools.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

from harness.base import options
from harness.base.errors import UsageError
from harness.base.options import DEFAULT_TARGET, RunConfig
from harness.cases.benchmarks import PERF_CASES
from harness.checks import all_checks
from harness.checks.findings import Finding
from harness.driver.explorer import explore, run_corpus
from harness.driver.pool import WorkerPool
from harness.driver.runner import Runner
from harness.perf import gate as perf_gate
from harness.targets.mutants import Mutant, catalog

CLEAN = "clean"


@dataclass
class HuntResult:
    name: str
    expected: tuple[str, ...]
    fired: dict[str, Finding] = field(default_factory=dict)  # check -> its first finding
    cases_run: int = 0
    seconds: float = 0.0
    skipped: str = ""

    @property
    def killed(self) -> bool:
        return any(c in self.fired for c in self.expected)

    @property
    def ok(self) -> bool:
        if self.skipped:
            return False
        return not self.fired if self.name == CLEAN else self.killed


def needs_bitwise(expected: tuple[str, ...]) -> bool:
    """A mutant meant to be caught by an opt-in bitwise check is hunted with that family on."""
    checks = all_checks(bitwise=True)
    return any(c in checks and checks[c].family == "bitwise" for c in expected)


def hunt(spec: str, name: str, expected: tuple[str, ...], tps: list[int], pools: dict[int, WorkerPool],
         budget: int, seed: int, collective_timeout_s: float, bitwise: bool = False, corpus: bool = True) -> HuntResult:
    """Corpus, then up to `budget` random cases per level, stopping once every expected check fired.
    `bitwise`: the opt-in bitwise checks too (always when an expected check is one of them). `corpus`
    False: the random cases alone (what the randomized search reaches by itself)."""
    runner = Runner(spec, collective_timeout_s=collective_timeout_s, pools=pools,
                    bitwise=bitwise or needs_bitwise(expected))
    result = HuntResult(name, expected)
    start = time.perf_counter()

    def record(findings: list[Finding]) -> None:
        for f in findings:
            result.fired.setdefault(f.check, f)

    def done(_: list[Finding] | None = None) -> bool:
        # Hunt on until every check meant to catch it has: "killed by the right check" is then
        # shown for each of them, not only for the first to fire.
        return bool(expected) and all(c in result.fired for c in expected)

    if corpus:
        record(run_corpus(runner, tps, stop=lambda fs: (record(fs), done())[1]))
    for level in runner.target.levels:
        if done():
            break
        record(explore(runner, level, tps, budget, seed, shrink=False,
                       stop=lambda fs: (record(fs), done())[1]))
    result.cases_run = runner.cases_run
    result.seconds = time.perf_counter() - start
    return result


class BaselineHunter:
    """Hunts the `needs_baseline` mutants: each is compared with a baseline of the clean routine on
    the benchmark cases at the TP sizes where it can be seen (recorded once per set of sizes)."""

    def __init__(self, tps: list[int], pools: dict[int, WorkerPool]):
        self.tps, self.pools = tps, pools
        self.recorded: dict[tuple[int, ...], dict[str, Any]] = {}

    def __call__(self, m: Mutant) -> HuntResult:
        start = time.perf_counter()
        sizes = tuple(tp for tp in self.tps if tp in m.tp)
        cases = [c for c in PERF_CASES if c.tp in sizes]  # the catalog's mutants take every input
        if not cases:
            return HuntResult(m.name, m.expected, skipped=f"no benchmark case at TP {list(self.tps)}")
        if sizes not in self.recorded:
            self.recorded[sizes] = perf_gate.record(Runner(DEFAULT_TARGET, pools=self.pools), cases)
        runner = Runner(m.spec, pools=self.pools)
        cmp = perf_gate.compare(runner, self.recorded[sizes], file=f"<baseline of {DEFAULT_TARGET}>")
        fired: dict[str, Finding] = {}
        for f in cmp.findings:
            fired.setdefault(f.check, f)
        return HuntResult(m.name, m.expected, fired, runner.cases_run, time.perf_counter() - start)


def run_catalog(names: list[str] | None, tps: list[int], pools: dict[int, WorkerPool], budget: int = 60,
                seed: int = 0, collective_timeout_s: float = 5.0, include_clean: bool = True,
                bitwise: bool = False, corpus: bool = True) -> list[HuntResult]:
    """Hunt every named mutant (all by default) and, first, the clean routine (with the bitwise
    checks too when `bitwise`)."""
    entries: dict[str, Mutant] = catalog()
    chosen = [entries[n] for n in (names or sorted(entries))]
    results = []
    baseline_hunter = BaselineHunter(tps, pools)
    if include_clean:
        results.append(hunt(DEFAULT_TARGET, CLEAN, (), tps, pools, budget, seed, collective_timeout_s, bitwise,
                            corpus))
    for m in chosen:
        sizes = [tp for tp in tps if tp in m.tp]
        if m.needs_baseline:
            results.append(baseline_hunter(m))
        elif not sizes:
            results.append(HuntResult(m.name, m.expected, skipped=f"only visible at TP {m.tp}"))
        else:
            results.append(hunt(m.spec, m.name, m.expected, sizes, pools, budget, seed, collective_timeout_s,
                                corpus=corpus))
    return results


def kill_matrix(results: list[HuntResult]) -> str:
    """Markdown: one row per mutant, one column per check that fired or was expected.
    X = an expected check fired, x = another check fired too, ? = expected but silent."""
    checks = sorted({c for r in results for c in (*r.fired, *r.expected)})
    head = ["mutant", "verdict", *checks, "cases", "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = []
        for c in checks:
            cells.append("X" if c in r.fired and c in r.expected else "x" if c in r.fired
                         else "?" if c in r.expected else "")
        verdict = r.skipped or ("clean" if r.name == CLEAN and r.ok else "killed" if r.ok else
                                "FINDINGS" if r.name == CLEAN else "SURVIVED")
        lines.append("| " + " | ".join([r.name, verdict, *cells, str(r.cases_run), f"{r.seconds:.1f}"]) + " |")
    return "\n".join(lines)


def cmd_mutate(ns: argparse.Namespace, cfg: RunConfig) -> int:
    entries = catalog()
    if ns.list:
        for m in entries.values():
            print(f"{m.name:34} {m.defect:45} expected: {', '.join(m.expected)}"
                  + (f"  [{m.history}]" if m.history else ""))
        return 0
    unknown = [n for n in ns.mutants if n not in entries]
    if unknown:
        raise UsageError(f"unknown mutant(s) {', '.join(unknown)}; see --list")
    own = cfg.pools is None
    pools: dict[int, WorkerPool] = {} if cfg.pools is None else cfg.pools
    start = time.perf_counter()
    try:
        results = run_catalog(ns.mutants or None, cfg.tp, pools, ns.budget, ns.seed, cfg.collective_timeout_s,
                              bitwise=cfg.bitwise, corpus=not ns.no_corpus)
    finally:
        for pool in pools.values() if own else ():
            pool.close()
    matrix = kill_matrix(results)
    print(matrix)
    bad = [r for r in results if not r.ok]
    killed = sum(r.ok for r in results if r.name != CLEAN)
    print(f"\n{killed}/{len(results) - 1} mutants killed by an expected check; clean routine "
          f"{'has no findings' if results[0].ok else 'HAS FINDINGS'}; {time.perf_counter() - start:.1f}s")
    for r in bad:
        why = r.skipped or ("; ".join(f"[{c}] {f.message[:200]}" for c, f in r.fired.items()) or "no check fired")
        print(f"  {r.name}: {why}")
    if ns.markdown:
        with open(ns.markdown, "w") as fh:
            fh.write(matrix + "\n")
    return 0 if not bad else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mutate", help="run the checks against the mutation catalog; print the kill matrix")
    p.add_argument("mutants", nargs="*", help="mutant names (default: the whole catalog)")
    p.add_argument("--list", action="store_true", help="list the catalog and exit")
    p.add_argument("--budget", type=options.positive_int, default=60,
                   help="random cases per level before a mutant survives")
    # A short collective timeout: a rank-divergent mutant then costs seconds, not minutes.
    options.add_argparse(p, ("tp", "seed", "collective_timeout", "bitwise"), collective_timeout=5.0)
    p.add_argument("--markdown", metavar="FILE", help="also write the kill matrix as markdown")
    p.add_argument("--no-corpus", action="store_true",
                   help="leave the regression corpus out: what the randomized search kills by itself")
    p.set_defaults(func=cmd_mutate)
