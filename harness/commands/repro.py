"""`python -m harness repro`: re-run exactly one case, as a finding prints it; exit 0 pass, 1 fail,
`UNTESTABLE` when the target cannot be tested (for `git bisect run`). `--script FILE.py` also writes
the finding as a stand-alone script for the routine's maintainers (`harness.checks.script`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.base import levels, options
from harness.base.errors import TargetError, UsageError
from harness.base.options import RunConfig
from harness.checks import all_checks
from harness.checks import script as scripts
from harness.checks.findings import BEYOND_USE, Finding
from harness.checks.terms import TERMS
from harness.commands import history
from harness.driver.replay import repro_at_commit
from harness.driver.runner import Runner
from harness.report.console import finding_blocks

# `repro`'s exit status when the target cannot be tested (not importable, no routine of the case's
# level that the contract can call): `git bisect run` skips such a commit instead of blaming it.
UNTESTABLE = 125


def cmd_repro(ns: argparse.Namespace, cfg: RunConfig) -> int:
    try:
        case = levels.parse(ns.case)
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
    if ns.script is not None:
        write_script(ns, runner, case, findings)
    return 1 if findings else 0


def write_script(ns: argparse.Namespace, runner: Runner, case, findings: list[Finding]) -> None:
    """`--script`: the script of `--check` (and `--term`), or of the first finding a script can be
    written for, those in the target's use first."""
    check, term = ns.check, ns.term or ""
    if check is None:
        ordered = sorted(findings, key=lambda f: f.use == BEYOND_USE)
        lead = next((f for f in ordered if scripts.refusal(runner.target, scripts.script_case(case, f.check, f.term),
                                                            f.check) is None), None)
        if lead is None:
            raise UsageError("--script: name the check to write it for with --check "
                             + ("(no finding of this case can be written as a script)" if findings else
                                "(the case has no finding to take it from)"))
        check, term = lead.check, ns.term or lead.term
    try:
        written = scripts.write(runner.target, case, check, term, ns.script)
    except ValueError as e:
        raise UsageError(f"--script: {e}") from None
    print(f"script: {written[0]}" + (f" (its bounds in {written[1]})" if len(written) > 1 else "")
          + f"; run it with the routine's folder on PYTHONPATH (or its file as the argument): python {written[0]}")


def register(sub: argparse._SubParsersAction) -> None:
    repro = sub.add_parser("repro", help="re-run exactly one case (as printed in a finding); exit 0 pass, "
                                         f"1 fail, {UNTESTABLE} untestable target (for `git bisect run`)")
    options.add_argparse(repro, ("target", "device", "collective_timeout", "case_timeout", "bitwise"))
    repro.add_argument("case", help="case spec, e.g. 'kernel:tp=2,T=5,v_local=4,...'")
    history.add_repro_arguments(repro)
    repro.add_argument("--script", type=lambda p: Path(p).resolve(), metavar="FILE.py",
                       help="also write the case as one stand-alone script (torch and the routine's own code, no "
                            "harness): exit 1 when the defect is there, 0 when not")
    repro.add_argument("--check", choices=sorted(all_checks()), metavar="CHECK",
                       help="the check the script is for (default: the case's first finding a script can show)")
    repro.add_argument("--term", choices=TERMS, help="the output term the script is about (default: the finding's)")
    repro.set_defaults(func=cmd_repro)
