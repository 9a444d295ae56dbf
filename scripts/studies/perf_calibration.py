"""Measure the time gate's false-alarm rate and its detection rate for injected slowdowns.

    .venv/bin/python scripts/studies/perf_calibration.py                    # the figures in docs/performance.md
    .venv/bin/python scripts/studies/perf_calibration.py --background 2     # with two CPU-bound neighbours
    .venv/bin/python scripts/studies/perf_calibration.py --clock wall       # wall clock instead of CPU time
    .venv/bin/python scripts/studies/perf_calibration.py --comparisons 0 --instruction-runs 3   # callgrind repeatability

Each comparison is exactly what `check --baseline` does for one case: rounds of `perf.jobs.paired_job`
on the case's worker pool (`perf.PAIRS` pairs each, more rounds while the interval straddles the
decision line: `perf.sequential_ratio`), then `Ratio.verdict(threshold)`.

- False alarms: the built-in routine against itself, `--comparisons` times per case.
- Detection: the same routine where every call of the "new" side is followed by busy work lasting
  a fixed fraction of that call's own duration on the measuring clock (`perf.jobs.paired_job(inject=...)`),
  so the slowdown holds whatever the machine does meanwhile. The busy work also costs the next
  call some cache refills (about +1%), so the fraction for 5%, 10% and 20% is set per case by one
  long paired run (`--calibration-pairs`) and corrected by what it measured. The median ratio the
  comparisons themselves measured is printed next to each rate.
Settings are interleaved (same, 5%, 10%, 20%, same, ...) so that a change of load hits them alike.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.base.options import DEFAULT_TARGET  # noqa: E402
from harness.cases.benchmarks import PERF_CASES  # noqa: E402
from harness.driver.pool import WorkerPool  # noqa: E402
from harness.perf import timing as perf  # noqa: E402
from harness.perf.gate import DEFAULT_THRESHOLD, label  # noqa: E402
from harness.perf.jobs import PAIRED_JOB  # noqa: E402

SLOWDOWNS = (0.05, 0.10, 0.20)


def _burn(stop: mp.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


def paired_pairs(pool: WorkerPool, case, pairs: int, seed: int, clock: str, inject: float,
                 block: int = perf.BLOCK) -> list[tuple[float, float]]:
    replies = pool.run(PAIRED_JOB, case, DEFAULT_TARGET, DEFAULT_TARGET, pairs, seed, clock,
                       inject, block, deadline_s=600)
    bad = [r for r in replies if not isinstance(r, list)]
    if bad:
        raise RuntimeError(f"paired_job failed: {bad[0]}")
    return perf.merge_ranks(replies)


def calibrate(pool: WorkerPool, case, pairs: int, clock: str) -> dict[float, float]:
    """slowdown -> injected fraction that gives it: the nominal one, less the excess it measured."""
    out = {}
    for k, p in enumerate(SLOWDOWNS):
        measured = perf.paired_ratio(paired_pairs(pool, case, pairs, 10_000 + k, clock, p)).median - 1
        out[p] = max(p - (measured - p), p / 2)
    return out


def instruction_repeatability(runs: int, say) -> None:
    """The clean routine counted `runs` times (separate callgrind processes) and the needless-pass
    mutant once: the spread of the counts against the change the gate must see."""
    from harness.perf import callgrind as instructions

    cases = [c for c in PERF_CASES if c.tp == 1]
    counts = []
    for i in range(runs):
        say(f"callgrind run {i + 1}/{runs} of {DEFAULT_TARGET}")
        counts.append(instructions.count(DEFAULT_TARGET, cases)["cases"])
    say("callgrind run of mutant:needless-exp-pass")
    slow = instructions.count("mutant:needless-exp-pass", cases)["cases"]
    print(f"\n| case | clean, {runs} runs | spread | needless-exp-pass | ratio |")
    print("|---|---|---:|---:|---:|")
    for case in cases:
        got = [c[case.spec()]["instructions"] for c in counts]
        spread = (max(got) - min(got)) / min(got)
        mutant = slow[case.spec()]["instructions"]
        print(f"| {label(case)} | {', '.join(f'{n:,}' for n in got)} | {spread:.1e} | {mutant:,} | "
              f"{mutant / got[0]:.3f} |")


def rates(ns: argparse.Namespace, say) -> list[dict]:
    """Per case: the verdicts of `--comparisons` comparisons at each setting."""
    cases = [c for c in PERF_CASES if c.tp in ns.tp]
    pools = {tp: WorkerPool(tp) for tp in sorted({c.tp for c in cases})}
    results = []
    try:
        for case in cases:
            fractions = calibrate(pools[case.tp], case, ns.calibration_pairs, ns.clock)
            say(f"{label(case)}: injected fractions " + ", ".join(f"{p:.0%} -> {f:.3f}" for p, f in fractions.items()))
            settings = [("same", 0.0)] + [(f"{p:.0%}", fractions[p]) for p in SLOWDOWNS]
            runs: dict[str, list[dict]] = {name: [] for name, _ in settings}
            for i in range(ns.comparisons):
                for name, inject in settings:
                    r, rounds = perf.sequential_ratio(
                        lambda seed, case=case, i=i, inject=inject: paired_pairs(
                            pools[case.tp], case, ns.pairs, 1000 * i + seed, ns.clock, inject, ns.block),
                        ns.threshold)
                    runs[name].append({"median": r.median, "low": r.low, "high": r.high, "rounds": rounds,
                                       "verdict": r.verdict(ns.threshold)})
            say(f"{label(case)}: " + ", ".join(
                f"{name} {sum(x['verdict'] == 'slower' for x in v)}/{len(v)}" for name, v in runs.items()))
            results.append({"case": case.spec(), "label": label(case), "fractions": fractions, "runs": runs})
    finally:
        for pool in pools.values():
            pool.close()
    return results


def rates_table(results: list[dict], pairs: int) -> str:
    lines = [f"Each cell: flagged / comparisons (median slowdown the comparisons measured; mean rounds of "
             f"{pairs} pairs used, at most {perf.ROUNDS}).", "",
             "| case | same vs same: alarms | injected 5%: detected | injected 10%: detected "
             "| injected 20%: detected | median CI width |", "|---|---:|---:|---:|---:|---:|"]
    totals = {name: [0, 0] for name in ("same", "5%", "10%", "20%")}
    for res in results:
        cells, widths = [], []
        for name, runs in res["runs"].items():
            hit = sum(r["verdict"] == "slower" for r in runs)
            totals[name][0] += hit
            totals[name][1] += len(runs)
            widths += [r["high"] - r["low"] for r in runs]
            measured = sorted(r["median"] for r in runs)[len(runs) // 2]
            rounds = sum(r["rounds"] for r in runs) / len(runs)
            cells.append(f"{hit}/{len(runs)} ({measured - 1:+.1%}; {rounds:.1f})")
        widths.sort()
        lines.append(f"| {res['label']} | " + " | ".join(cells) + f" | {widths[len(widths) // 2]:.3f} |")
    lines.append("| **all** | " + " | ".join(f"**{h}/{n}** ({h / n:.0%})" for h, n in totals.values()) + " | |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comparisons", type=int, default=25,
                    help="comparisons per case and setting (0: instruction counts only)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="TP sizes of the benchmark cases to use")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--pairs", type=int, default=perf.PAIRS, help="pairs per round (the gate: perf.PAIRS)")
    ap.add_argument("--block", type=int, default=perf.BLOCK, help="calls per side of a pair (the gate: perf.BLOCK)")
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    ap.add_argument("--calibration-pairs", type=int, default=150)
    ap.add_argument("--background", type=int, default=0, help="CPU-bound neighbour processes to run meanwhile")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--instruction-runs", type=int, default=0,
                    help="also count the clean routine's instructions this many times (about 30 s each)")
    ns = ap.parse_args()
    start = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f}s] {msg}", file=sys.stderr, flush=True)

    results = []
    if ns.comparisons:
        stop = mp.Event()
        burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(ns.background)]
        for b in burners:
            b.start()
        load_before = os.getloadavg()
        try:
            results = rates(ns, say)
        finally:
            stop.set()
            for b in burners:
                b.join(5)
        load_after = os.getloadavg()
        print(f"clock {ns.clock}, threshold {ns.threshold:.0%} (decision line {ns.threshold / 2:.0%}), "
              f"{ns.pairs} pairs of {ns.block} calls per round, {ns.comparisons} comparisons per case and setting, "
              f"{ns.background} background burners, load average {load_before[0]:.1f} -> {load_after[0]:.1f}, "
              f"{time.perf_counter() - start:.0f}s\n")
        print(rates_table(results, ns.pairs))
    if ns.instruction_runs:
        instruction_repeatability(ns.instruction_runs, say)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"clock": ns.clock, "threshold": ns.threshold, "pairs": ns.pairs,
                                             "block": ns.block, "background": ns.background, "results": results},
                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
