"""Only the context-parallel part of `harness check`: the CP corpus entries, then N randomized wrapper
cases per CP size over TP 1 and 2 (both layouts drawn), with a known-findings file. What
docs/context-parallel.md and docs/real-routines.md measure:

    PYTHONPATH=.:path/to/slime python scripts/studies/cp_check.py slime.backends.megatron_utils.loss 80 \\
        docs/examples/slime-known.toml
"""
from __future__ import annotations

import sys
import time

from harness.cases.corpus import CORPUS
from harness.checks.known import load
from harness.driver.explorer import explore
from harness.driver.runner import Runner
from harness.report.console import finding_blocks


def main(target: str, n: int, cp_sizes: list[int], known: str | None = None) -> int:
    runner = Runner(target)
    if known:
        runner.verdicts.known = load(known)
    start, findings = time.perf_counter(), []
    try:
        for entry in CORPUS:
            if getattr(entry.case, "cp", 1) > 1:
                findings += runner.check(entry.case)[1]
        for cp in cp_sizes:
            findings += explore(runner, "wrapper", [1, 2], n, 0, shrink=True, cp=cp)
    finally:
        runner.close()
    for block in finding_blocks(findings):
        print(block)
    print(f"{runner.cases_run} case runs in {time.perf_counter() - start:.1f} s, {len(findings)} finding(s), "
          f"{len(runner.verdicts.known_findings)} known")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")],
                  sys.argv[4] if len(sys.argv) > 4 else None))
