"""`python -m harness`: check a log-prob/entropy routine against its contract (`check`: the
regression corpus, then randomized cases at TP 1, 2, 4, each failure shrunk, with a repro line),
re-run one case (`repro`), list the checks (`checks`) and the case fields (`fields`), hunt the
mutation catalog (`mutate`), check the field's routines (`peers`) and compare saved baselines
(`trend`).

Exit codes: 0 no findings, 1 findings, 2 usage, target or infrastructure error.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from harness.base.errors import HarnessError
from harness.base.options import RunConfig
from harness.commands import check, checks, fields, history, mutate, peers, repro, trend
from harness.driver import lifecycle

# The subcommands, in the order `--help` lists them: each module has `register(subparsers)`.
COMMANDS = (check, repro, mutate, trend, checks, fields, peers, history)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None, pools: dict | None = None) -> int:
    """`pools`: worker pools to reuse (the test suite passes its session pools); default: own ones."""
    parser = build_parser()
    ns = parser.parse_args(argv)  # exits 2 on usage errors, with argparse's message
    cfg = RunConfig.from_options(vars(ns).get, pools)
    if threading.current_thread() is threading.main_thread():
        lifecycle.install_signal_handlers()  # Ctrl-C and SIGTERM stop the run and its pools
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
        if lifecycle.interrupted_by():
            return _interrupted()
        raise


def _interrupted() -> int:
    signum = lifecycle.interrupted_by() or signal.SIGINT
    print(f"harness: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
    return 128 + int(signum)


if __name__ == "__main__":
    sys.exit(main())
