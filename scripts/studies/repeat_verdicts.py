"""Are the verdicts repeatable? Runs the main job (`python -m harness check`, each run a fresh
process) N times and compares the check tables: per check and level, how many cases it applied
to, failed, matched a known entry, was not applied to (and why), and its largest margin.

    python scripts/studies/repeat_verdicts.py --runs 20 [--seeds same|different|both] [--load 2]
                                      [--profile ci] [--target SPEC] [--out DIR] [-- EXTRA CHECK ARGS]

`same`: every run with seed 0 must give one table, bit for bit (margins included). `different`:
run i with seed i; the tables differ (other cases are drawn), but a correct routine has no finding
in any. `--load K`: K CPU-bound neighbour processes per core run alongside every run (busy loops,
started before and ended after each run, by their process ids): a correct routine still gets no
finding, and with one seed the table is still the same. Exit 0 when both hold.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def table(result: dict[str, Any]) -> dict[str, Any]:
    """What must repeat: every check's counts per level, its worst margin (as its exact repr), the
    findings (check, case), the cases run and the skipped ones."""
    checks = {name: {level: (st["applied"], st["failed"], st["known"], sorted(st["not_applied"].items()),
                             repr(st["max_margin"]))
                     for level, st in sorted(levels.items())}
              for name, levels in sorted(result["checks"].items())}
    return {"checks": checks, "findings": sorted((f["check"], f["case"]) for f in result["findings"]),
            "cases_run": result["cases_run"], "skipped": sorted(result["skipped"].items())}


def _neighbours(per_core: int) -> list[subprocess.Popen]:
    """CPU-bound processes, `per_core` per core: each spins in pure Python until killed."""
    n = per_core * (os.cpu_count() or 1)
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_once(seed: int, profile: str, target: str | None, extra: list[str], out: Path, load: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "harness", "check", "--profile", profile, "--seed", str(seed), "-q",
           "--json", str(out), *(["--target", target] if target else []), *extra]
    neighbours = _neighbours(load) if load else []
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
    finally:
        for p in neighbours:
            p.kill()
        for p in neighbours:
            p.wait()
    if proc.returncode not in (0, 1) or not out.exists():
        raise SystemExit(f"run failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["_wall_s"] = time.monotonic() - start
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seeds", choices=("same", "different", "both"), default="both")
    p.add_argument("--load", type=int, default=0, help="CPU-bound neighbour processes per core during each run")
    p.add_argument("--profile", default="ci")
    p.add_argument("--target", default=None)
    p.add_argument("--out", type=Path, default=None, help="keep each run's JSON here")
    p.add_argument("extra", nargs="*", help="more `harness check` arguments (after --)")
    ns = p.parse_args(argv)
    out = ns.out or Path(tempfile.mkdtemp(prefix="repeat-verdicts-"))
    out.mkdir(parents=True, exist_ok=True)
    modes = ("same", "different") if ns.seeds == "both" else (ns.seeds,)
    ok = True
    print("| seeds | run | seed | cases | findings | table | s |\n|---|---|---|---|---|---|---|")
    for mode in modes:
        tables: list[dict[str, Any]] = []
        for i in range(ns.runs):
            seed = 0 if mode == "same" else i
            result = run_once(seed, ns.profile, ns.target, ns.extra, out / f"{mode}-{i:02d}.json", ns.load)
            t = table(result)
            same = "-" if mode != "same" else "first" if not tables else "same" if t == tables[0] else "DIFFERS"
            tables.append(t)
            n_findings = len(result["findings"])
            ok = ok and n_findings == 0 and same != "DIFFERS"  # other seeds draw other cases: only findings count
            print(f"| {mode} | {i + 1} | {seed} | {result['cases_run']} | {n_findings} | "
                  f"{same} | {result['_wall_s']:.0f} |", flush=True)
        if mode == "same":
            distinct = len({json.dumps(t, sort_keys=True) for t in tables})
            print(f"\n{mode} seed: {len(tables)} runs, {distinct} distinct check table(s)\n")
    print(f"{'repeatable' if ok else 'NOT repeatable'}; the runs' JSON: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
