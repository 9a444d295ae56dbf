"""Both routes kill the same mutants: every mutant of the catalog that `harness check` kills fails
some test of the pytest route (`pytest --pyargs harness.conformance`), at the same profile.

For each mutant: `python -m harness check --target mutant:NAME -x` and `python -m pytest --pyargs
harness.conformance --harness-target mutant:NAME -x`, both stopping at their first finding, from a
scratch directory. Mutants that only a saved baseline can see are left out (neither route runs a
baseline by default); the opt-in bitwise checks are turned on for the mutants they are meant to
kill. As a command, from the checkout's root, it prints one row per mutant (killed by each route,
wall seconds of each) and the totals, and exits 1 when a mutant the CLI kills survives the pytest
route; as a slow test, one test per mutant at the `ci` profile fails in that case (`-k NAME`
picks mutants). Heavy: run it under `nice`.

    python -m tests.test_mutation_parity --profile ci [--only NAME ...] [--json parity.json]
    pytest -m slow tests/test_mutation_parity.py
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

import pytest

from harness.checks import all_checks
from harness.targets.mutants import Mutant, catalog

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    env.pop("CI", None)
    start = time.perf_counter()
    try:
        run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        return run.returncode, time.perf_counter() - start, run.stdout[-2000:] + run.stderr[-1000:]
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - start, "timeout"


def both_routes(m: Mutant, profile: str, scratch: Path, timeout: float) -> dict:
    """One mutant through each route: their exit codes and wall seconds, and the pytest route's
    output where it missed what the CLI killed."""
    bitwise = {n for n, c in all_checks(bitwise=True).items() if c.family == "bitwise"}
    extra = bool(bitwise & set(m.expected))
    cli = [sys.executable, "-m", "harness", "check", "--target", m.spec, "--profile", profile, "-x", "-q"]
    pyt = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "harness.conformance",
           "--harness-target", m.spec, "--harness-profile", profile, "-x", "-q", "--no-header"]
    if extra:
        cli.append("--bitwise")
        pyt.append("--harness-bitwise")
    c_rc, c_s, _ = _run(cli, scratch, timeout)
    p_rc, p_s, p_out = _run(pyt, scratch, timeout)
    row = {"mutant": m.name, "cli_rc": c_rc, "cli_s": round(c_s, 1), "pytest_rc": p_rc, "pytest_s": round(p_s, 1)}
    if survives_pytest(row):
        row["pytest_tail"] = p_out[-1500:]
    return row


def survives_pytest(row: dict) -> bool:
    """Killed by the CLI, not by the pytest route."""
    return row["cli_rc"] == 1 and row["pytest_rc"] != 1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(m.name for m in catalog().values() if not m.needs_baseline))
def test_a_mutant_the_cli_kills_fails_the_pytest_route(name: str, tmp_path: Path) -> None:
    row = both_routes(catalog()[name], "ci", tmp_path, timeout=900)
    assert not survives_pytest(row), row["pytest_tail"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutants (default: the whole catalog)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per route and mutant")
    parser.add_argument("--json", metavar="FILE")
    ns = parser.parse_args()
    mutants = [m for m in catalog().values() if not m.needs_baseline and (not ns.only or m.name in ns.only)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="parity-") as scratch:
        for m in mutants:
            row = both_routes(m, ns.profile, Path(scratch), ns.timeout)
            rows.append(row)
            c_rc, p_rc = row["cli_rc"], row["pytest_rc"]
            print(f"{m.name:40} cli {'killed' if c_rc == 1 else f'rc={c_rc}':8} {row['cli_s']:7.1f}s   "
                  f"pytest {'killed' if p_rc == 1 else f'rc={p_rc}':8} {row['pytest_s']:7.1f}s", flush=True)
    missed = [r["mutant"] for r in rows if survives_pytest(r)]
    killed = [r for r in rows if r["cli_rc"] == 1]
    cli_s, pyt_s = sum(r["cli_s"] for r in rows), sum(r["pytest_s"] for r in rows)
    print(f"\n{len(rows)} mutants; the CLI kills {len(killed)}, the pytest route {sum(r['pytest_rc'] == 1 for r in rows)}; "
          f"killed by the CLI and not by pytest: {missed or 'none'}; wall {cli_s:.0f}s (CLI) vs {pyt_s:.0f}s (pytest)")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"profile": ns.profile, "rows": rows, "missed": missed}, indent=1))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
