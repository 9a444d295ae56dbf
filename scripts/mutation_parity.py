"""Both routes kill the same mutants: every mutant of the catalog that `harness check` kills fails
some test of the pytest route (`pytest --pyargs harness.conformance`), at the same profile.

For each mutant: `python -m harness check --target mutant:NAME -x` and `python -m pytest --pyargs
harness.conformance --harness-target mutant:NAME -x`, both stopping at their first finding, from a
scratch directory; prints one row per mutant (killed by each route, wall seconds of each) and the
totals, and exits 1 when a mutant the CLI kills survives the pytest route. Mutants that only a
saved baseline can see are left out (neither route runs a baseline by default); the opt-in bitwise
checks are turned on for the mutants they are meant to kill. Heavy: run it under `nice`.

    python scripts/mutation_parity.py --profile ci [--only NAME ...] [--json parity.json]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.checks import all_checks  # noqa: E402
from harness.targets.mutants import catalog  # noqa: E402


def _run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    env.pop("CI", None)
    start = time.perf_counter()
    try:
        run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        return run.returncode, time.perf_counter() - start, run.stdout[-2000:] + run.stderr[-1000:]
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - start, "timeout"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutants (default: the whole catalog)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per route and mutant")
    parser.add_argument("--json", metavar="FILE")
    ns = parser.parse_args()
    bitwise = {n for n, c in all_checks(bitwise=True).items() if c.family == "bitwise"}
    mutants = [m for m in catalog().values() if not m.needs_baseline and (not ns.only or m.name in ns.only)]
    rows, missed = [], []
    with tempfile.TemporaryDirectory(prefix="parity-") as scratch:
        for m in mutants:
            extra = bool(bitwise & set(m.expected))
            cli = [sys.executable, "-m", "harness", "check", "--target", m.spec, "--profile", ns.profile, "-x", "-q"]
            pyt = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "harness.conformance",
                   "--harness-target", m.spec, "--harness-profile", ns.profile, "-x", "-q", "--no-header"]
            if extra:
                cli.append("--bitwise")
                pyt.append("--harness-bitwise")
            c_rc, c_s, c_out = _run(cli, Path(scratch), ns.timeout)
            p_rc, p_s, p_out = _run(pyt, Path(scratch), ns.timeout)
            row = {"mutant": m.name, "cli_rc": c_rc, "cli_s": round(c_s, 1), "pytest_rc": p_rc, "pytest_s": round(p_s, 1)}
            if c_rc == 1 and p_rc != 1:
                missed.append(m.name)
                row["pytest_tail"] = p_out[-1500:]
            rows.append(row)
            print(f"{m.name:40} cli {'killed' if c_rc == 1 else f'rc={c_rc}':8} {c_s:7.1f}s   "
                  f"pytest {'killed' if p_rc == 1 else f'rc={p_rc}':8} {p_s:7.1f}s", flush=True)
    killed = [r for r in rows if r["cli_rc"] == 1]
    cli_s, pyt_s = sum(r["cli_s"] for r in rows), sum(r["pytest_s"] for r in rows)
    print(f"\n{len(rows)} mutants; the CLI kills {len(killed)}, the pytest route {sum(r['pytest_rc'] == 1 for r in rows)}; "
          f"killed by the CLI and not by pytest: {missed or 'none'}; wall {cli_s:.0f}s (CLI) vs {pyt_s:.0f}s (pytest)")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"profile": ns.profile, "rows": rows, "missed": missed}, indent=1))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
