"""Both routes report the same findings: for each target, `python -m harness check --json` and the
pytest route (`pytest --pyargs harness.conformance`) with the same profile, seed, TP and CP sizes,
each from a scratch directory; per check, the findings' cases of each route (the pytest route's
recorded by `parity_probe`), and the wall and CPU time of each, in all and to the first failure
(measured here, from the start of the process, off its output as it comes: the CLI's progress line
of its first failing check, the pytest route's line of its first failed test). CPU time (user +
system, the process and every process it started) is the figure a shared machine's load does not
move much.

As a command, from the checkout's root, it prints one row per target (checks failing in each route,
findings equal or not, times and their ratios) and exits 1 when a target's findings differ. A
target needing a tree on the path takes it after `@`: `slime.backends.megatron_utils.loss@path/to/slime`.
As a slow test, it compares the routes on `TARGETS` at the smoke profile. Heavy: run it under `nice`.

    python -m tests.test_route_parity --profile ci TARGET[@PYTHONPATH] ... [--json parity.json]
    pytest -m slow tests/test_route_parity.py
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The CLI's progress line of a failure: a corpus entry naming its failing checks, or a shrunk one;
# pytest's (-v) line of a failed test.
CLI_FAILURE = re.compile(r"\] corpus [\w.-]+(?: \(ran at TP \d+: [^)]*\))?: (?!ok$|skipped)|: \S+ fails; shrunk to ")
PYTEST_FAILURE = re.compile(r"::test_\w+\[.*\] FAILED")
# What the slow test compares: the built-in routine (no finding on either route) and the catalog's
# CP mutants, whose findings come from the pytest route's CP steps.
TARGETS = ("harness.targets.fused", "mutant:cp-absent-piece-requires-grad", "mutant:zigzag-offset-off-by-one",
           "mutant:cp-reduce-over-tp-group", "mutant:cp-reduce-over-world", "mutant:top-p-mask-wrong-cp-layout",
           "mutant:cp-gathered-logits")


def _tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of `root` and every live descendant, each with its waited-for children."""
    parents, used = {}, {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
            used[int(entry.name)] = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(used.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def _run(cmd: list[str], cwd: Path, pythonpath: str, timeout: float, first: re.Pattern) -> dict:
    """Run `cmd`; its wall and CPU time, exit code, output tail, and the wall and CPU time at which its
    output first matched `first`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (pythonpath, str(REPO))))}
    env.pop("CI", None)
    start = time.perf_counter()
    first_s = first_cpu = None
    tail: list[str] = []
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if first_s is None and first.search(line.rstrip("\n")):
                first_s, first_cpu = time.perf_counter() - start, _tree_cpu_s(proc.pid)
            tail = (tail + [line])[-60:]
            if time.perf_counter() - start > timeout:
                proc.kill()
                break
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    return {"rc": rc, "wall_s": time.perf_counter() - start, "cpu_s": cpu, "first_s": first_s,
            "first_cpu_s": first_cpu, "tail": "".join(tail)[-3000:]}


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
    pyt = _run([sys.executable, "-u", "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.parity_probe", "-v",
                "--pyargs", "harness.conformance", "--harness-target", target, "--harness-profile", ns.profile,
                "--harness-seed", str(ns.seed), *(f"--harness-{a.lstrip('-')}" if a.startswith("-") else a for a in sizes)],
               scratch, path, ns.timeout, PYTEST_FAILURE)
    cli_findings = json.loads(cli_json.read_text())["findings"] if cli_json.exists() else None
    probe = json.loads(probe_json.read_text()) if probe_json.exists() else None
    row = {"target": spec, "cli_rc": cli["rc"], "pytest_rc": pyt["rc"]}
    for key in ("wall_s", "cpu_s", "first_s", "first_cpu_s"):
        row[f"cli_{key}"], row[f"pytest_{key}"] = (r[key] and round(r[key], 1) for r in (cli, pyt))
    if cli_findings is None or probe is None:
        row.update(same=False, error=(cli["tail"] if cli_findings is None else pyt["tail"])[-2000:])
        return row
    a, b = _by_check(cli_findings), _by_check(probe["findings"])
    row.update(cli=a, pytest=b, same=a == b)
    return row


def _ratios(row: dict):
    def ratio(key: str) -> str:
        a, b = row[f"cli_{key}"], row[f"pytest_{key}"]
        return f"{a}s vs {b}s ({b / a:.2f}x)" if a and b else f"{a}s vs {b}s"
    return ratio


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="+", metavar="TARGET[@PYTHONPATH]")
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--cp", help="CP sizes (default: the profile's)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per route and target")
    parser.add_argument("--json", metavar="FILE")
    return parser.parse_args(argv)


def _differ(row: dict) -> str:
    return json.dumps({k: row.get(k) for k in ("cli", "pytest", "error")}, indent=1)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_both_routes_report_the_same_findings(target: str, tmp_path: Path) -> None:
    row = compare(target, options(["--profile", "smoke", target]), tmp_path)
    assert row["same"], _differ(row)


def main() -> int:
    ns = options()
    rows = []
    for spec in ns.targets:
        with tempfile.TemporaryDirectory(prefix="parity-") as scratch:
            row = compare(spec, ns, Path(scratch))
        rows.append(row)
        ratio = _ratios(row)
        print(f"{spec.partition('@')[0]:40} {'same' if row['same'] else 'DIFFER':6} checks failing "
              f"{len(row.get('cli', {}))} | wall {ratio('wall_s')}, CPU {ratio('cpu_s')} | first failure: wall "
              f"{ratio('first_s')}, CPU {ratio('first_cpu_s')} | rc {row['cli_rc']}/{row['pytest_rc']}", flush=True)
        if not row["same"]:
            print(_differ(row), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"profile": ns.profile, "seed": ns.seed, "rows": rows}, indent=1))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
