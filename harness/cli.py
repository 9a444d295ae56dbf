"""`python -m harness`: check a log-prob/entropy routine against its contract (`check`: the
regression corpus, then randomized cases at TP 1, 2, 4, each failure shrunk, with a repro line),
re-run one case (`repro`), list the checks (`checks`) and the case fields (`fields`), hunt the
mutation catalog (`mutate`), check the field's routines (`peers`) and compare saved baselines
(`trend`).

Exit codes: 0 no findings, 1 findings, 2 usage, target or infrastructure error.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cases.case import parse_case
from cases.profiles import PROFILES
from harness.base import options
from harness.base.errors import HarnessError, TargetError, UsageError
from harness.base.options import RunConfig
from harness.checks.findings import Finding
from harness.commands import checks as listing
from harness.commands import history, mutate, trend
from harness.commands import peers as peer_matrix
from harness.driver import pool, torchrun
from harness.driver.explorer import explore, plan, run_corpus
from harness.driver.limits import RunLimits
from harness.driver.runner import Runner
from harness.perf import gate as perf_gate
from harness.report import render


def _progress(quiet: bool):
    start = time.perf_counter()

    def say(msg: str) -> None:
        if not quiet:
            print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)
    return say


def summary_table(runner: Runner, findings: list[Finding]) -> str:
    levels = list(runner.target.levels)
    rows = [("check", *[f"{lvl} (checked/failed)" for lvl in levels], "max err/tol", "not applied")]
    notes: list[str] = []
    for name in runner.checks:
        cells, margin, skipped = [], 0.0, 0
        for lvl in levels:
            st = runner.stats.get((name, lvl))
            cells.append("-" if st is None else f"{st.applied}/{st.failed}" + (f" (+{st.known} known)" if st.known else ""))
            if st and st.margins:
                margin = max(margin, max(st.margins))
            for note, n in sorted((st.not_applied if st else {}).items()):
                skipped += n
                notes.append(f"  {name} ({lvl}), {n} case(s): {note}")
        if all(c == "-" for c in cells):
            continue
        rows.append((name, *cells, f"{margin:.3f}" if margin else "-", str(skipped) if skipped else "-"))
    lines = _table(rows)
    if notes:
        lines += ["", "checks not applied to some cases, and why:", *notes]
    return "\n".join(lines)


FOLDED_SHOWN = 8  # a check's other findings listed, one line each, under its shrunk one


def finding_blocks(findings: list[Finding], json_file: str | None = None) -> list[str]:
    """What the run prints of its findings, check by check in the order they first failed: the
    check's shrunk (minimal) findings first and in full, the first labelled as the one to start
    from; its other findings (the corpus's, larger cases) folded under them, one line each. The
    JSON keeps every finding in full."""
    by_check: dict[str, list[Finding]] = {}
    for f in findings:
        by_check.setdefault(f.check, []).append(f)
    blocks = []
    for check, group in by_check.items():
        lead = [f for f in group if f.shrunk] or group[:1]
        rest = [f for f in group if not any(f is g for g in lead)]
        for i, f in enumerate(lead):
            label = (" shrunk, start from this one:" if i == 0 else " shrunk:") if f.shrunk else ""
            message = f.message[:1500].replace("\n", "\n  ")
            blocks.append(f"\nFINDING [{f.check}] ({f.level}){label} {f.case}\n  {message}\n  repro: {f.repro}")
        if rest:
            where = f"in full in {json_file}" if json_file else "in full with --json FILE"
            lines = [f"    {f.case}" for f in rest[:FOLDED_SHOWN]]
            if len(rest) > FOLDED_SHOWN:
                lines.append(f"    ... and {len(rest) - FOLDED_SHOWN} more")
            blocks.append(f"  and {len(rest)} more [{check}] finding(s) on other cases ({where}):\n" + "\n".join(lines))
    return blocks


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def bitwise_table(runner: Runner) -> str:
    """The bitwise property sheet: per configuration, in how many cases each property held."""
    names = [n for n, c in runner.checks.items() if c.family == "bitwise"]
    rows = [("configuration", *names)]
    for config in sorted(runner.properties):
        got = runner.properties[config]
        rows.append((config, *[("-" if n not in got else f"{'holds' if got[n][0] == got[n][1] else 'FAILS'} "
                                f"{got[n][1]}/{got[n][0]}") for n in names]))
    return "\n".join(["bitwise properties (cases where it held / cases checked):", *_table(rows),
                      "TP invariance is not a bitwise property: another TP size changes the reduction tree "
                      "(docs/bitwise.md); tp-invariance holds it to the float32 tolerance."])


def result_json(runner: Runner, findings: list[Finding], elapsed: float, extra: dict[str, Any]) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for (name, lvl), st in runner.stats.items():
        checks.setdefault(name, {})[lvl] = {"applied": st.applied, "failed": st.failed, "known": st.known,
                                             "max_margin": max(st.margins, default=None), "margins": st.margins,
                                             "margins_by_group": st.margins_by_group, "not_applied": st.not_applied}
    return {
        "target": runner.target.spec, "levels": list(runner.target.levels),
        "capabilities": runner.target.capabilities, "inferred_capabilities": runner.target.inferred,
        "not_checked": runner.target.not_checked, "cases_run": runner.cases_run,
        "elapsed_s": round(elapsed, 3), "case_seconds": round(runner.run_seconds, 3),
        "cases_per_s": round(runner.cases_run / runner.run_seconds, 2) if runner.run_seconds else None,
        "findings": [f.to_json() for f in findings], "checks": checks,
        "bitwise": {config: {n: {"checked": c, "held": h} for n, (c, h) in got.items()}
                    for config, got in sorted(runner.properties.items())} if runner.properties else None,
        **extra,
    }


def known_json(runner: Runner) -> dict[str, Any]:
    """The known findings apart from the new ones, and each entry of the --known file with its count."""
    if not runner.known.path:
        return {"known_findings": [], "known": None}
    return {"known_findings": [f.to_json() for f in runner.known_findings],
            "known": {"file": runner.known.path, "entries": [e.to_json() for e in runner.known.entries],
                      "stale": [e.describe() for e in runner.known.stale]}}


def known_summary(runner: Runner) -> str:
    lines = []
    for e in runner.known.entries:
        if e.matched:
            lines.append(f"KNOWN {e.describe()}: {e.matched} finding(s)" + (f" ({e.link})" if e.link else ""))
    for e in runner.known.stale:
        lines.append(f"STALE known entry, matched nothing in this run: {e.describe()}")
    return "\n".join(lines)


# Features that extend `check`, in order: each module has `add_arguments(parser)` and
# `finish(ns, runner, result) -> list[Finding]`, called on the live runner after the checks, with
# the JSON-ready result (findings added by earlier features included).
CHECK_FEATURES = (perf_gate, render)  # the report renders the others' results: keep it last
# Modules that add a subcommand: each has `register(subparsers)`.
SUBCOMMANDS = (mutate, trend, listing, peer_matrix, history)


@torchrun.serving  # under torchrun: rank 0 runs the check on the launched ranks
def cmd_check(ns: argparse.Namespace, cfg: RunConfig) -> int:
    say = _progress(ns.quiet)
    profile = PROFILES[ns.profile]
    start = time.perf_counter()
    runner = Runner.for_run(cfg)
    limits = RunLimits(1 if ns.exitfirst else ns.max_findings)
    interrupted = 0
    try:
        try:
            say(f"target {runner.target.spec}: levels {', '.join(runner.target.levels)}; TP {cfg.tp}; profile {profile.name}")
            if runner.repro_env:
                say(f"the target came from this directory or $PYTHONPATH: repro lines set {runner.repro_env.strip()}")
            for feature, ok in sorted(runner.target.capabilities.items()):
                if not ok:
                    say(f"target provides no {feature}: cases needing it are not drawn")
            for note in runner.target.fit_notes():
                say(note)
            findings = run_corpus(runner, cfg.tp, say, limits=limits)
            cp_sizes = cfg.cp if runner.target.supports("context_parallel") else []
            for level, tps, n, dp, cp in plan(profile, runner.target.levels, cfg.tp, torchrun.active(), cp_sizes):
                if limits.reached():
                    break
                say(f"{level}: {n} randomized cases over TP {tps}" + (f" inside a world of DP {dp} replicas" if dp > 1 else "")
                    + (f" with CP {cp} (zigzag and all-gather)" if cp > 1 else ""))
                findings += explore(runner, level, tps, n, ns.seed, shrink=not ns.no_shrink, progress=say,
                                    limits=limits, dp=dp, cp=cp)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: report what was found so far
            interrupted, findings = pool.interrupted_by() or signal.SIGINT, list(limits.found)
        findings = limits.final(findings)  # a hang reported once
        result = result_json(runner, findings, time.perf_counter() - start,
                             {"profile": profile.name, "seed": ns.seed, "tp": cfg.tp,
                              "skipped": dict(limits.skipped), "stopped_at_max_findings": limits.reached(),
                              **({"interrupted": signal.Signals(interrupted).name} if interrupted else {})})
        for feature in CHECK_FEATURES:
            if interrupted and feature is not render:
                continue  # the report of what was found, not the gates that would run next
            result.update(known_json(runner))
            extra = runner.new_findings(feature.finish(ns, runner, result))
            findings += extra
            result["findings"] += [f.to_json() for f in extra]
    finally:
        runner.close()
    elapsed = time.perf_counter() - start
    result["elapsed_s"] = round(elapsed, 3)
    if interrupted:
        if ns.json:
            Path(ns.json).write_text(json.dumps(result, indent=1))
        written = f"; written to {ns.json}" if ns.json else ""
        print(f"harness: interrupted by {signal.Signals(interrupted).name} after {elapsed:.1f}s, "
              f"{len(findings)} finding(s) so far{written}", file=sys.stderr)
        return 128 + int(interrupted)
    print(summary_table(runner, findings))
    for note in runner.target.fit_notes():
        print(note)
    if cfg.bitwise:
        print("\n" + bitwise_table(runner))
    rate = runner.cases_run / runner.run_seconds if runner.run_seconds else 0.0
    print(f"\n{runner.cases_run} cases in {elapsed:.1f}s ({rate:.1f} cases/s excluding pool start-up), "
          f"{len(findings)} finding(s)")
    for line in limits.summary():
        print(line)
    if limits.reached():
        print(f"stopped after {len(limits.found)} finding(s) (--max-findings {limits.max_findings})")
    for block in finding_blocks(findings, ns.json):
        print(block)
    if runner.known.path:
        print("\n" + (known_summary(runner) or f"no known findings ({runner.known.path})"))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1))
    known_fail = ns.strict_known and (any(e.matched for e in runner.known.entries) or bool(runner.known.stale))
    return 1 if findings or known_fail else 0


# `repro`'s exit status when the target cannot be tested (not importable, no routine of the case's
# level that the contract can call): `git bisect run` skips such a commit instead of blaming it.
UNTESTABLE = 125


def cmd_repro(ns: argparse.Namespace, cfg: RunConfig) -> int:
    try:
        case = parse_case(ns.case)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{e} (`python -m harness fields` lists every field and its values)") from None
    try:
        runner = Runner.for_run(cfg)
    except TargetError as e:
        print(f"harness: untestable: {e}", file=sys.stderr)
        return UNTESTABLE
    if case.level not in runner.target.levels:
        runner.close()
        why = runner.target.not_checked.get(case.level, f"{cfg.target} has no {case.level} routine")
        print(f"harness: untestable: {why}", file=sys.stderr)
        return UNTESTABLE
    try:
        _, findings = runner.check(case)
        runner.explain(findings)
    finally:
        runner.close()
    print(case.spec())
    for f in findings:
        print(f"FINDING [{f.check}] {f.message}")
    print(f"{len(findings)} finding(s)")
    return 1 if findings else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run the randomized conformance checks against a target")
    options.add_argparse(check, ("target", "device", "collective_timeout", "case_timeout", "tp", "cp", "profile",
                                 "seed", "known", "strict_known", "bitwise"))
    check.add_argument("--json", metavar="FILE", help="write the results as JSON")
    check.add_argument("--no-shrink", action="store_true", help="report failures without shrinking them")
    check.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    check.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first finding (as --max-findings 1)")
    check.add_argument("--max-findings", type=options.positive_int, metavar="N", help="stop after N findings")
    for feature in CHECK_FEATURES:
        feature.add_arguments(check)
    check.set_defaults(func=cmd_check)
    repro = sub.add_parser("repro", help="re-run exactly one case (as printed in a finding); exit 0 pass, "
                                         f"1 fail, {UNTESTABLE} untestable target (for `git bisect run`)")
    options.add_argparse(repro, ("target", "device", "collective_timeout", "case_timeout", "bitwise"))
    repro.add_argument("case", help="case spec, e.g. 'kernel:tp=2,T=5,v_local=4,...'")
    repro.set_defaults(func=cmd_repro)
    for command in SUBCOMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None, pools: dict | None = None) -> int:
    """`pools`: worker pools to reuse (the test suite passes its session pools); default: own ones."""
    parser = build_parser()
    ns = parser.parse_args(argv)  # exits 2 on usage errors, with argparse's message
    cfg = RunConfig.from_options(vars(ns).get, pools)
    if threading.current_thread() is threading.main_thread():
        pool.install_signal_handlers()  # Ctrl-C and SIGTERM stop the run and its pools
    try:
        return ns.func(ns, cfg)
    except HarnessError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted()
    except Exception:
        # An error raised once interrupted is the interrupt's: Hypothesis, interrupted while it
        # starts its engine, fails its own assertion instead of passing the KeyboardInterrupt on.
        if pool.interrupted_by():
            return _interrupted()
        raise


def _interrupted() -> int:
    signum = pool.interrupted_by() or signal.SIGINT
    print(f"harness: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
    return 128 + int(signum)


if __name__ == "__main__":
    sys.exit(main())
