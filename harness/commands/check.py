"""`python -m harness check`: the regression corpus, then randomized cases at each TP size, each
failure shrunk, with a repro line; then the features that extend it (the performance gate, the
report). Exit codes: 0 no findings, 1 findings (those `--fail-on` names: new ones by default, any
including known ones, or new ones in the target's use only), 2 usage, target or infrastructure error."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from harness.base import options
from harness.base.options import RunConfig
from harness.cases.profiles import PROFILES
from harness.checks.findings import gated
from harness.driver import lifecycle, torchrun
from harness.driver.explorer import explore, plan, run_corpus
from harness.driver.limits import RunLimits
from harness.driver.runner import Runner
from harness.perf import gate as perf_gate
from harness.report import render
from harness.report.console import bitwise_table, finding_blocks, known_summary, summary_table
from harness.report.result import known_json, result_json


def _progress(quiet: bool):
    start = time.perf_counter()

    def say(msg: str) -> None:
        if not quiet:
            print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)
    return say


# Features that extend `check`, in order: each module has `add_arguments(parser)` and
# `finish(ns, runner, result) -> list[Finding]`, called on the live runner after the checks, with
# the JSON-ready result (findings added by earlier features included).
CHECK_FEATURES = (perf_gate, render)  # the report renders the others' results: keep it last


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
            interrupted, findings = lifecycle.interrupted_by() or signal.SIGINT, list(limits.found)
        findings = limits.final(findings)  # a hang reported once
        stopped = bool(interrupted) or limits.reached()  # before its last case: no known entry is stale
        result = result_json(runner, findings, time.perf_counter() - start,
                             {"profile": profile.name, "seed": ns.seed, "tp": cfg.tp,
                              "skipped": dict(limits.skipped), "stopped_at_max_findings": limits.reached(),
                              **({"interrupted": signal.Signals(interrupted).name} if interrupted else {})})
        for feature in CHECK_FEATURES:
            if interrupted and feature is not render:
                continue  # the report of what was found, not the gates that would run next
            result.update(known_json(runner, stopped))
            extra = runner.verdicts.new_findings(feature.finish(ns, runner, result))
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
    for event in runner.events:
        print(f"infrastructure event, not a finding: {event}")
    if limits.reached():
        print(f"stopped after {len(limits.found)} finding(s) (--max-findings {limits.max_findings})")
    for block in finding_blocks(findings, ns.json):
        print(block)
    if runner.verdicts.known.path:
        print("\n" + (known_summary(runner, stopped) or f"no known findings ({runner.verdicts.known.path})"))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1))
    failing = gated(findings, ns.fail_on)
    if len(failing) < len(findings):
        print(f"{len(findings) - len(failing)} new finding(s) beyond the target's use: printed, not failing the run "
              f"(--fail-on {ns.fail_on})")
    matched = any(e.matched for e in runner.verdicts.known.entries)
    known_fail = (matched and (ns.strict_known or ns.fail_on == "any")) \
        or (ns.strict_known and bool(runner.verdicts.known.stale) and not stopped)
    return 1 if failing or known_fail else 0


def register(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser("check", help="run the randomized conformance checks against a target")
    options.add_argparse(check, ("target", "device", "collective_timeout", "case_timeout", "tp", "cp", "profile",
                                 "seed", "known", "strict_known", "bitwise", "fail_on"))
    check.add_argument("--json", metavar="FILE", help="write the results as JSON")
    check.add_argument("--no-shrink", action="store_true", help="report failures without shrinking them")
    check.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    check.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first finding (as --max-findings 1)")
    check.add_argument("--max-findings", type=options.positive_int, metavar="N", help="stop after N findings")
    for feature in CHECK_FEATURES:
        feature.add_arguments(check)
    check.set_defaults(func=cmd_check)
