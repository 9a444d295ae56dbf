"""`python -m harness mutate`: run the checks against every mutant of the catalog and print the
kill matrix. Exit 0 only when every mutant is killed by a check meant to catch it and the clean
routine has no finding.

Each mutant is hunted with the regression corpus first, then with randomized cases (no shrinking),
and the hunt stops as soon as every expected check has fired. All mutants share one set of pools.
"""
from __future__ import annotations

import argparse
import importlib
import time
from dataclasses import dataclass, field

from harness.explore import explore, run_corpus
from harness.mutants import Mutant, catalog
from harness.pool import WorkerPool
from harness.runner import Finding, Runner
from harness.targets import DEFAULT_TARGET

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


def hunt(spec: str, name: str, expected: tuple[str, ...], tps: list[int], pools: dict[int, WorkerPool],
         budget: int, seed: int, collective_timeout_s: float) -> HuntResult:
    """Corpus, then up to `budget` random cases per level, stopping once every expected check fired."""
    runner = Runner(spec, collective_timeout_s=collective_timeout_s, pools=pools)
    result = HuntResult(name, expected)
    start = time.perf_counter()

    def record(findings: list[Finding]) -> None:
        for f in findings:
            result.fired.setdefault(f.check, f)

    def done(_: list[Finding] | None = None) -> bool:
        # Hunt on until every check meant to catch it has: "killed by the right check" is then
        # shown for each of them, not only for the first to fire.
        return bool(expected) and all(c in result.fired for c in expected)

    record(run_corpus(runner, tps, stop=lambda fs: (record(fs), done())[1]))
    for level in runner.target.levels:
        if done():
            break
        record(explore(runner, level, tps, budget, seed, shrink=False,
                       stop=lambda fs: (record(fs), done())[1]))
    result.cases_run = runner.cases_run
    result.seconds = time.perf_counter() - start
    return result


def run_catalog(names: list[str] | None, tps: list[int], pools: dict[int, WorkerPool], budget: int = 60,
                seed: int = 0, collective_timeout_s: float = 5.0, include_clean: bool = True,
                baseline_hunter=None) -> list[HuntResult]:
    """Hunt every named mutant (all by default) and, first, the clean routine."""
    entries: dict[str, Mutant] = catalog()
    chosen = [entries[n] for n in (names or sorted(entries))]
    results = []
    if include_clean:
        results.append(hunt(DEFAULT_TARGET, CLEAN, (), tps, pools, budget, seed, collective_timeout_s))
    for m in chosen:
        sizes = [tp for tp in tps if tp in m.tp]
        if m.needs_baseline:
            if baseline_hunter is None:
                results.append(HuntResult(m.name, m.expected, skipped="needs a baseline (harness.baseline)"))
            else:
                results.append(baseline_hunter(m, pools))
        elif not sizes:
            results.append(HuntResult(m.name, m.expected, skipped=f"only visible at TP {m.tp}"))
        else:
            results.append(hunt(m.spec, m.name, m.expected, sizes, pools, budget, seed, collective_timeout_s))
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


def cmd_mutate(ns: argparse.Namespace) -> int:
    entries = catalog()
    if ns.list:
        for m in entries.values():
            print(f"{m.name:34} {m.defect:45} expected: {', '.join(m.expected)}"
                  + (f"  [{m.history}]" if m.history else ""))
        return 0
    unknown = [n for n in ns.mutants if n not in entries]
    if unknown:
        from harness.cli import UsageError

        raise UsageError(f"unknown mutant(s) {', '.join(unknown)}; see --list")
    own = ns.pools is None
    pools: dict[int, WorkerPool] = {} if own else ns.pools
    start = time.perf_counter()
    try:
        hunter = None
        try:
            hunter = importlib.import_module("harness.baseline").mutant_hunter(ns.tp, pools, ns.seed)
        except (ImportError, AttributeError):
            pass
        results = run_catalog(ns.mutants or None, ns.tp, pools, ns.budget, ns.seed, ns.collective_timeout,
                              baseline_hunter=hunter)
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
    from harness.cli import seed_value, tp_list

    p = sub.add_parser("mutate", help="run the checks against the mutation catalog; print the kill matrix")
    p.add_argument("mutants", nargs="*", help="mutant names (default: the whole catalog)")
    p.add_argument("--list", action="store_true", help="list the catalog and exit")
    p.add_argument("--tp", type=tp_list, default=[1, 2, 4])
    p.add_argument("--budget", type=int, default=60, help="random cases per level before a mutant survives")
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--collective-timeout", type=float, default=5.0, metavar="S",
                   help="short, so that a rank-divergent mutant costs seconds, not minutes")
    p.add_argument("--markdown", metavar="FILE", help="also write the kill matrix as markdown")
    p.set_defaults(func=cmd_mutate)
