"""`python -m harness peers`: check every installed peer adapter (`harness.targets.peers`) and write
the conformance matrix (`harness.report.matrix`) as markdown, HTML and JSON.

Each peer runs as its own `python -m harness check ... --json` process: the peers import heavy,
unrelated libraries (verl pulls in ray and transformers), one peer's crash or hang stays its own,
and each row is exactly what `harness check --target harness.targets.peers.NAME` reports, with
the same repro lines. A peer that is not installed, or needs CUDA on a CPU run, is a `skipped`
row saying why. Each peer runs at its own profile (`HARNESS_PEER["profile"]`, `ci` unless it
says otherwise) unless `--profile` sets one for all; its wall and CPU time are printed as it
finishes, and are part of its row.

A peer runs here when its routine does: its required modules are installed and the functions it
adapts are found in them (`absent_here`), not when a folder of its package's name sits in the
current directory (a namespace package holding none of its modules). A peer whose adapter does not
import here (NeMo-RL's tree on PYTHONPATH without hydra installed) is listed, and skipped, with the
import's error: `--list` prints a line for every peer and exits 0.

Exit codes, as `check`'s, once the matrix is written: 0 when no peer has a new finding (one its known
file does not explain), 1 when one has, 2 when a peer's run failed to produce a result (usage,
import or infrastructure error: that row is marked).
"""
from __future__ import annotations

import argparse
import datetime
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.base import extras, options
from harness.report import matrix
from harness.targets.peers import Peer, absent_here, peers


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peers", help="check every installed peer adapter and write the conformance matrix")
    options.add_argparse(p, ("device", "tp", "profile", "seed"), profile=None)
    p.add_argument("--out", type=Path, default=Path("peers-matrix"), metavar="DIR",
                   help="where to write peers.md, peers.html, peers.json and each peer's check JSON "
                        "(default: ./peers-matrix)")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="these peers only (names as `harness peers --list` prints)")
    p.add_argument("--list", action="store_true", help="list the peer adapters and whether each can run here")
    p.add_argument("--peer-timeout", type=options.positive_int, default=1800, metavar="S",
                   help="seconds one peer's check may take before it is stopped (default 1800)")
    p.set_defaults(func=cmd_peers)


def _why_not(peer: Peer, device: str) -> str | None:
    if peer.unimportable:
        return f"its adapter does not import here ({peer.unimportable})"
    missing = peer.missing()
    if missing:
        return f"not installed (no {', '.join(missing)}): {peer.install}"
    if peer.cuda_only and device == "cpu":
        return "runs only on CUDA (Triton kernels): run `harness peers --device cuda` on a GPU runner"
    absent = absent_here(peer.spec)
    return f"its routine is not here: {absent}" if absent else None


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children (and theirs) so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _run_peer(peer: Peer, ns: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{peer.name}.json"
    profile = ns.profile or peer.profile
    cmd = [sys.executable, "-m", "harness", "check", "--target", peer.spec, "--profile", profile,
           "--tp", ",".join(map(str, ns.tp)), "--device", ns.device, "--json", str(out), "-q", "--no-shrink"]
    if ns.seed is not None:
        cmd += ["--seed", str(ns.seed)]
    if peer.known:
        cmd += ["--known", str(peer.known)]
    start, cpu = time.perf_counter(), _children_cpu_s()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=ns.peer_timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"did not finish within --peer-timeout {ns.peer_timeout} s"}
    times = {"profile": profile, "elapsed_s": round(time.perf_counter() - start, 1),
             "cpu_s": round(_children_cpu_s() - cpu, 1)}
    if proc.returncode not in (0, 1) or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": "error", "reason": f"`harness check` exited {proc.returncode}: {tail[0][:300]}", **times}
    result = json.loads(out.read_text())
    return {"status": "ran", "cases": result["cases_run"], **times, "cells": matrix.peer_cells(result),
            "findings": len(result["findings"]), "known_findings": len(result.get("known_findings", [])),
            "beyond_use": sum(f.get("use") == "beyond-use" for f in result["findings"]),
            "command": " ".join(cmd[1:])}


def _said(row: dict[str, Any]) -> str:
    """A finished peer's line: its result and its time."""
    spent = f"{row['elapsed_s']} s wall, {row['cpu_s']} s CPU (profile {row['profile']})" if "elapsed_s" in row else ""
    if row["status"] == "ran":
        return (f"{row['cases']} cases, {row['findings']} new ({row['findings'] - row['beyond_use']} in its use, "
                f"{row['beyond_use']} beyond it) and {row['known_findings']} known findings; {spent}")
    return f"{row['status']}: {row['reason']}" + (f"; {spent}" if spent else "")


def cmd_peers(ns: argparse.Namespace, cfg: options.RunConfig) -> int:
    found = peers()
    if ns.list:
        for peer in found:
            print(f"{peer.name:16} {_why_not(peer, ns.device) or 'runs here'}\n{'':16} {peer.summary}")
        return 0
    extras.require("jinja2", "report", "harness peers (its report)")  # said before the run, not after it
    unknown = set(ns.only or ()) - {p.name for p in found}
    if unknown:
        print(f"harness: error: unknown peer(s) {sorted(unknown)}; known: {[p.name for p in found]}", file=sys.stderr)
        return 2
    ns.out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], False
    start, cpu = time.perf_counter(), _children_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        for peer in found:
            if ns.only and peer.name not in ns.only:
                continue
            row = {"name": peer.name, "spec": peer.spec, "upstream": list(peer.upstream), "summary": peer.summary}
            reason = _why_not(peer, ns.device)
            print(f"[peers] {peer.name}: {reason or 'checking'}", file=sys.stderr, flush=True)
            if reason is None:
                row.update(_run_peer(peer, ns, Path(tmp)))
                print(f"[peers] {peer.name}: {_said(row)}", file=sys.stderr, flush=True)
            else:
                row.update({"status": "skipped", "reason": reason})
            failed |= row["status"] == "error"
            if row["status"] == "ran":
                (ns.out / f"{peer.name}.json").write_text((Path(tmp) / f"{peer.name}.json").read_text())
            rows.append(row)
    result = {"profile": ns.profile or "each peer's own", "tp": list(ns.tp), "seed": ns.seed, "device": ns.device,
              "date": datetime.date.today().isoformat(), "harness": _version(), "columns": matrix.columns(),
              "elapsed_s": round(time.perf_counter() - start, 1), "cpu_s": round(_children_cpu_s() - cpu, 1),
              "peers": rows}
    (ns.out / "peers.json").write_text(json.dumps(result, indent=1))
    text = matrix.render_markdown(result)
    (ns.out / "peers.md").write_text(text)
    (ns.out / "peers.html").write_text(matrix.render_html(result))
    print(text)
    print(f"[peers] the matrix: {result['elapsed_s']} s wall, {result['cpu_s']} s CPU (user + system, every "
          f"peer's processes)", file=sys.stderr)
    print(f"written: {ns.out / 'peers.md'}, {ns.out / 'peers.html'}, {ns.out / 'peers.json'}", file=sys.stderr)
    return 2 if failed else 1 if any(row.get("findings") for row in rows) else 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("logprob-harness")
    except PackageNotFoundError:
        return "unknown"
