"""Both routes report the same findings: for each target, `python -m harness check --json` and the
pytest route (`pytest --pyargs harness.conformance`) with the same profile, seed, TP and CP sizes,
each from a scratch directory; per check, the findings' cases of each route, and the wall time and
the time to the first failure of each (both measured here, from the start of the process, off its
output as it comes: the CLI's progress line of its first failing check, the pytest route's first
failing test, recorded by `parity_probe`, on the same clock).

Prints one row per target (checks failing in each route, findings equal or not, times and their
ratios) and exits 1 when a target's findings differ. A target needing a tree on the path takes it
after `@`: `slime.backends.megatron_utils.loss@path/to/slime`. Heavy: run it under `nice`.

    python scripts/route_parity.py --profile ci TARGET[@PYTHONPATH] ... [--json parity.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The CLI's progress line of a failure: a corpus entry naming its failing checks, or a shrunk one.
CLI_FAILURE = re.compile(r"\] corpus [\w.-]+(?: \(ran at TP \d+: [^)]*\))?: (?!ok$|skipped)|: \S+ fails; shrunk to ")


def _run(cmd: list[str], cwd: Path, pythonpath: str, timeout: float, first: re.Pattern | None) -> dict:
    """Run `cmd`; its wall time, exit code, output tail and the time its output first matched `first`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (pythonpath, str(REPO / "scripts"))))}
    env.pop("CI", None)
    start, started_at = time.perf_counter(), time.time()
    first_s, tail = None, []
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if first is not None and first_s is None and first.search(line.rstrip("\n")):
                first_s = time.perf_counter() - start
            tail = (tail + [line])[-60:]
            if time.perf_counter() - start > timeout:
                proc.kill()
                break
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"rc": rc, "wall_s": time.perf_counter() - start, "first_s": first_s, "started_at": started_at,
            "tail": "".join(tail)[-3000:]}


def _by_check(findings: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in findings:
        out.setdefault(f["check"], []).append(f["case"])
    return {check: sorted(cases) for check, cases in sorted(out.items())}


def compare(spec: str, ns: argparse.Namespace, scratch: Path) -> dict:
    target, _, path = spec.partition("@")
    path = str(Path(path).resolve()) if path else ""
    sizes = ["--tp", ns.tp] + (["--cp", ns.cp] if ns.cp else [])
    cli_json, probe_json = scratch / "cli.json", scratch / "pytest.json"
    cli = _run([sys.executable, "-u", "-m", "harness", "check", "--target", target, "--profile", ns.profile,
                "--seed", str(ns.seed), *sizes, "--json", str(cli_json)], scratch, path, ns.timeout, CLI_FAILURE)
    pyt = _run([sys.executable, "-u", "-m", "pytest", "-p", "no:cacheprovider", "-p", "parity_probe", "-q",
                "--no-header", "--pyargs", "harness.conformance", "--harness-target", target, "--harness-profile",
                ns.profile, "--harness-seed", str(ns.seed), *(f"--harness-{a.lstrip('-')}" if a.startswith("-") else a
                                                                for a in sizes)],
               scratch, path, ns.timeout, None)
    cli_findings = json.loads(cli_json.read_text())["findings"] if cli_json.exists() else None
    probe = json.loads(probe_json.read_text()) if probe_json.exists() else None
    row = {"target": spec, "cli_rc": cli["rc"], "pytest_rc": pyt["rc"], "cli_s": round(cli["wall_s"], 1),
           "pytest_s": round(pyt["wall_s"], 1), "cli_first_s": cli["first_s"] and round(cli["first_s"], 1)}
    if cli_findings is None or probe is None:
        row.update(same=False, error=(cli["tail"] if cli_findings is None else pyt["tail"])[-2000:])
        return row
    at = probe["first_failure_at"]
    row["pytest_first_s"] = round(at - pyt["started_at"], 1) if at else None
    a, b = _by_check(cli_findings), _by_check(probe["findings"])
    row.update(cli=a, pytest=b, same=a == b)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="+", metavar="TARGET[@PYTHONPATH]")
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--cp", help="CP sizes (default: the profile's)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per route and target")
    parser.add_argument("--json", metavar="FILE")
    ns = parser.parse_args()
    rows = []
    for spec in ns.targets:
        with tempfile.TemporaryDirectory(prefix="parity-") as scratch:
            row = compare(spec, ns, Path(scratch))
        rows.append(row)
        ratio = f"{row['pytest_s'] / row['cli_s']:.2f}x" if row["cli_s"] else "-"
        first = (f"{row['cli_first_s']}s vs {row.get('pytest_first_s')}s"
                 + (f" ({row['pytest_first_s'] / row['cli_first_s']:.2f}x)"
                    if row.get("pytest_first_s") and row["cli_first_s"] else ""))
        print(f"{spec.partition('@')[0]:45} {'same' if row['same'] else 'DIFFER':6} checks failing "
              f"{sorted(row.get('cli', {}))} | wall {row['cli_s']}s vs {row['pytest_s']}s ({ratio}) | "
              f"first failure {first} | rc {row['cli_rc']}/{row['pytest_rc']}", flush=True)
        if not row["same"]:
            print(json.dumps({k: row.get(k) for k in ("cli", "pytest", "error")}, indent=1), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"profile": ns.profile, "seed": ns.seed, "rows": rows}, indent=1))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
