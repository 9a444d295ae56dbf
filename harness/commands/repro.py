"""`python -m harness repro`: re-run exactly one case, as a finding prints it; exit 0 pass, 1 fail,
`UNTESTABLE` when the target cannot be tested (for `git bisect run`)."""
from __future__ import annotations

import argparse
import sys

from harness.base import options
from harness.base.errors import TargetError, UsageError
from harness.base.options import RunConfig
from harness.cases.case import parse_case
from harness.commands import history
from harness.driver.replay import repro_at_commit
from harness.driver.runner import Runner
from harness.report.console import finding_blocks

# `repro`'s exit status when the target cannot be tested (not importable, no routine of the case's
# level that the contract can call): `git bisect run` skips such a commit instead of blaming it.
UNTESTABLE = 125


def cmd_repro(ns: argparse.Namespace, cfg: RunConfig) -> int:
    try:
        case = parse_case(ns.case)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{e} (`python -m harness fields` lists every field and its values)") from None
    if ns.repo is not None:
        return repro_at_commit(ns)
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
    for block in finding_blocks(findings):
        print(block)
    print(f"{len(findings)} finding(s)")
    return 1 if findings else 0


def register(sub: argparse._SubParsersAction) -> None:
    repro = sub.add_parser("repro", help="re-run exactly one case (as printed in a finding); exit 0 pass, "
                                         f"1 fail, {UNTESTABLE} untestable target (for `git bisect run`)")
    options.add_argparse(repro, ("target", "device", "collective_timeout", "case_timeout", "bitwise"))
    repro.add_argument("case", help="case spec, e.g. 'kernel:tp=2,T=5,v_local=4,...'")
    history.add_repro_arguments(repro)
    repro.set_defaults(func=cmd_repro)
