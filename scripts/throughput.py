"""Cases per second of the engine, per TP size: small randomized kernel and wrapper cases (3:1),
every registered check evaluated, twins included; pools started once, start-up timed separately.

    python scripts/throughput.py [--cases 200]
"""
from __future__ import annotations

import argparse
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from cases.strategies import kernel_cases, wrapper_cases
from harness.engine.runner import Runner


def draw(strategy: st.SearchStrategy, n: int) -> list:
    """n cases as Hypothesis draws them, reproducibly."""
    out: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None)
    @given(strategy)
    def collect(case):
        out.append(case)

    collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", type=int, default=200)
    ns = p.parse_args()
    runner = Runner("harness.targets.fused")
    print("| TP | pool start-up (s) | distributed cases run | cases/s |")
    print("|---|---|---|---|")
    for tp in (1, 2, 4):
        start = time.perf_counter()
        runner.pool(tp)
        startup = time.perf_counter() - start
        mix = draw(kernel_cases(tp=st.just(tp)), ns.cases * 3 // 4) + draw(wrapper_cases(tp=st.just(tp)), ns.cases // 4)
        before, start = runner.cases_run, time.perf_counter()
        for case in mix:
            runner.check(case)
        took = time.perf_counter() - start
        ran = runner.cases_run - before
        print(f"| {tp} | {startup:.2f} | {ran} | {ran / took:.1f} |", flush=True)
    runner.close()


if __name__ == "__main__":
    main()
