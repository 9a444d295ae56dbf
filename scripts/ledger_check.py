"""The C++ memory ledger against the dispatch-mode ledger it replaces (docs/memory.md, "The
ledger"): each drawn case runs on its pool twice, once with each ledger, and every memory figure
of every rank must be identical, in bytes, the wrapper's kernel-pass figures included.
A dispatch mode keeps each output's Python object alive, so autograd cannot accumulate two
gradients in place into a buffer it would own (`add` where a run without the mode does `add_`):
under the mode a backward peak can be higher, and the tensors listed can name other ops. Those
runs are counted apart; any other difference fails the script.

    PYTHONPATH=. python scripts/ledger_check.py harness.targets.fused 40 1,2 [kernel,wrapper,linear] [cp]
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from harness.cases.strategies import kernel_cases, linear_cases, wrapper_cases
from harness.driver.runner import Runner

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


def main(target: str, n: int, tps: list[int], levels: list[str], cp: int) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import draw

    runner, start, compared, differ, below = Runner(target), time.perf_counter(), 0, 0, 0
    renamed: Counter = Counter()
    try:
        for level in levels:
            for tp in tps:
                extra = {"cp": st.just(cp)} if level == "wrapper" and cp > 1 else {}
                for case in draw(STRATEGIES[level](tp=st.just(tp), **extra), n):
                    pool = runner.pool(case.tp, case.dp, getattr(case, "cp", 1))
                    for rank, figures in enumerate(pool.run("tests.pool_jobs:both_ledgers", case, target)):
                        compared += 1
                        diffs = differences(figures["mode"], figures["compiled"])
                        for _, a, b in diffs:
                            if isinstance(a, list) and isinstance(b, list):
                                renamed[(str(sorted(t["op"] for t in a if t not in b)),
                                         str(sorted(t["op"] for t in b if t not in a)))] += 1
                        figures_differ = [d for d in diffs if not d[0].endswith(("_tensors", "_count"))]
                        if figures_differ and all(lower_backward_peak(d) for d in figures_differ):
                            below += 1
                        elif figures_differ:
                            differ += 1
                            print(f"DIFFER {case} rank {rank}:")
                            for where, a, b in figures_differ:
                                print(f"  {where}:\n    mode     {a}\n    compiled {b}")
    finally:
        runner.close()
    for (a, b), count in renamed.most_common():
        print(f"{count} tensor list(s) name other ops: mode {a}, compiled {b}")
    print(f"{compared} rank runs compared in {time.perf_counter() - start:.1f} s: {differ} with other figures, "
          f"{below} with a lower backward peak only")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")],
                  (sys.argv[4] if len(sys.argv) > 4 else "kernel,wrapper,linear").split(","),
                  int(sys.argv[5]) if len(sys.argv) > 5 else 1))
