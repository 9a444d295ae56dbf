"""The C++ memory ledger against the dispatch-mode ledger it replaces, at scale (docs/memory.md, "The
ledger"): each drawn case runs on its pool twice, once with each ledger, and every memory figure
of every rank must be identical, in bytes, the wrapper's kernel-pass figures included.
A dispatch mode keeps each output's Python object alive, so autograd cannot accumulate two
gradients in place into a buffer it would own (`add` where a run without the mode does `add_`):
under the mode a backward peak can be higher, and the tensors listed can name other ops. Those
runs are counted apart; any other difference fails. `test_memory.py` compares the two on a few
cases at TP 2 in every session; this is the slow comparison, and a command, from the checkout's root:

    pytest -m slow tests/test_ledger_parity.py
    python -m tests.test_ledger_parity harness.targets.fused 40 1,2 [kernel,wrapper,linear] [cp]
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cases.strategies import kernel_cases, linear_cases, wrapper_cases
from harness.driver.runner import Runner
from harness.meters import memory_meter

STRATEGIES = {"kernel": kernel_cases, "linear": linear_cases, "wrapper": wrapper_cases}


def differences(a: Any, b: Any, where: str = "") -> list[tuple[str, Any, Any]]:
    """Where two figure trees differ: the innermost differing value, by its path."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    return [] if a == b else [(where, a, b)]


def lower_backward_peak(difference: tuple[str, Any, Any]) -> bool:
    """The one difference the mode causes: its backward peak is higher, where the routine run
    unobserved accumulates a gradient in place."""
    where, mode, compiled = difference
    return where.endswith("peak_backward") and compiled < mode


@dataclass
class Tally:
    compared: int = 0  # rank runs
    below: int = 0  # rank runs whose figures differ by a lower backward peak only
    differ: list[str] = field(default_factory=list)  # each rank run with other figures, said
    renamed: Counter = field(default_factory=Counter)  # (ops only the mode lists, ops only the C++ ledger lists)

    def add(self, case: Any, rank: int, figures: dict) -> None:
        self.compared += 1
        diffs = differences(figures["mode"], figures["compiled"])
        for _, a, b in diffs:
            if isinstance(a, list) and isinstance(b, list):
                self.renamed[(str(sorted(t["op"] for t in a if t not in b)),
                              str(sorted(t["op"] for t in b if t not in a)))] += 1
        figures_differ = [d for d in diffs if not d[0].endswith(("_tensors", "_count"))]
        if figures_differ and all(lower_backward_peak(d) for d in figures_differ):
            self.below += 1
        elif figures_differ:
            self.differ.append(f"DIFFER {case} rank {rank}:\n" + "\n".join(
                f"  {where}:\n    mode     {a}\n    compiled {b}" for where, a, b in figures_differ))


def compare(runner: Runner, n: int, tps: list[int], levels: list[str], cp: int) -> Tally:
    """Up to `n` drawn cases per level and TP size (wrapper cases at CP `cp`), each rank's figures
    by both ledgers."""
    tally = Tally()
    for level in levels:
        for tp in tps:
            extra = {"cp": st.just(cp)} if level == "wrapper" and cp > 1 else {}

            # Nothing raises in here: each case is compared, none is shrunk.
            @settings(max_examples=n, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(STRATEGIES[level](tp=st.just(tp), **extra))
            def one(case):
                pool = runner.pool(case.tp, case.dp, getattr(case, "cp", 1))
                for rank, figures in enumerate(pool.run("tests.pool_jobs:both_ledgers", case, runner.target.spec)):
                    tally.add(case, rank, figures)

            one()
    return tally


@pytest.mark.slow
@pytest.mark.distributed
def test_both_ledgers_give_the_built_in_routine_the_same_figures(harness_pools):
    if memory_meter.compiled_ledger() is None:
        pytest.skip("the C++ ledger cannot be built here (no compiler)")
    tally = compare(Runner("harness.targets.fused", pools=harness_pools), 15, [1, 2, 4], list(STRATEGIES), cp=1)
    assert tally.compared and not tally.differ, "\n".join(tally.differ)


def main(target: str, n: int, tps: list[int], levels: list[str], cp: int) -> int:
    runner, start = Runner(target), time.perf_counter()
    try:
        tally = compare(runner, n, tps, levels, cp)
    finally:
        runner.close()
    for block in tally.differ:
        print(block)
    for (a, b), count in tally.renamed.most_common():
        print(f"{count} tensor list(s) name other ops: mode {a}, compiled {b}")
    print(f"{tally.compared} rank runs compared in {time.perf_counter() - start:.1f} s: {len(tally.differ)} with "
          f"other figures, {tally.below} with a lower backward peak only")
    return 1 if tally.differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")],
                  (sys.argv[4] if len(sys.argv) > 4 else "kernel,wrapper,linear").split(","),
                  int(sys.argv[5]) if len(sys.argv) > 5 else 1))
