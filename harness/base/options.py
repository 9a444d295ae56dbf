"""The options shared by the CLI and the pytest plugin, defined once, with one set of validators.

`add_argparse(parser, names)` and `add_pytest(parser, names)` add the same flags, help and parsing
to either front end (pytest's `addoption` is argparse underneath, so `type=` validators serve
both). Under pytest every flag is prefixed `--harness-` and has an ini key `harness_<name>`: the
plugin loads into every pytest session where the package is installed, and a user's own options
(`--device`, `--target`, ...) must keep their names. What a run needs besides the flags, such as
the session's worker pools, travels in a `RunConfig`, never in the argparse Namespace.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.base.errors import UsageError
from harness.cases.profiles import DEFAULT_PROFILE, PROFILES

DEFAULT_TARGET = "harness.targets.fused"  # the built-in routine (a module path, as --target takes)

COLLECTIVE_TIMEOUT_S = 20.0  # the gloo/NCCL timeout's default, for every front end and pool

# `--fail-on`: what fails a run, or a test of the pytest route (`checks.findings.gated`).
FAIL_ON = ("any", "new", "in-use")


def tp_list(text: str) -> list[int]:
    try:
        sizes = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--tp takes comma-separated positive integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise UsageError(f"--tp sizes must be positive integers, got {text!r}")
    return sorted(set(sizes))


def cp_list(text: str) -> list[int]:
    try:
        sizes = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--cp takes comma-separated positive integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise UsageError(f"--cp sizes must be positive integers, got {text!r}")
    return sorted(set(sizes))


def seed_value(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"--seed takes a non-negative integer, got {text!r}") from None
    if value < 0:
        raise UsageError(f"--seed must be non-negative, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"expected a positive number, got {text!r}") from None
    if value <= 0:
        raise UsageError(f"expected a positive number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise UsageError(f"expected a positive integer, got {text!r}")
    return value


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A validator as argparse wants it: its UsageError becomes argparse's own error (exit 2)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__  # argparse names the type in "invalid <name> value"
    return convert


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    default: Any = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    cli_aliases: tuple[str, ...] = ()  # more flags on the CLI only (pytest owns some names, e.g. --strict)
    action: str | None = None  # "store_true" for a flag
    path: bool = False  # a file: relative in an ini key, it is read from pytest's rootdir, not the working directory

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def kwargs(self, default: Any) -> dict[str, Any]:
        kw: dict[str, Any] = {"default": default, "help": self.help, "dest": self.dest}
        if self.action is not None:
            kw["action"] = self.action
        if self.parse is not None:
            kw["type"] = _argparse_type(self.parse)
        if self.choices is not None:
            kw["choices"] = self.choices
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        return kw


OPTIONS: dict[str, Option] = {o.dest: o for o in (
    Option("--target", "the routine under test: a module path, a .py file, or mutant:NAME", DEFAULT_TARGET),
    Option("--tp", "TP sizes, e.g. 1,2,4", [1, 2, 4], tp_list),
    Option("--cp", "context-parallel sizes of the wrapper cases, e.g. 2,4 (default: the profile's; 1: none)",
           None, cp_list),
    Option("--device", "cpu: gloo pools, fork; cuda: NCCL pools, spawn", "cpu", choices=("cpu", "cuda")),
    Option("--collective-timeout", "gloo/NCCL timeout of every collective, seconds: the backstop of a "
           "stuck collective (stuck ranks are found sooner, by evidence)", COLLECTIVE_TIMEOUT_S, positive_float, metavar="S"),
    Option("--case-timeout", "deadline of one case, seconds (default: 100 x the pool's median case time, "
           "at least 10 s, at most twice the collective timeout plus 10 s)", None, positive_float, metavar="S"),
    Option("--profile", "how many randomized cases: smoke (seconds), ci (the default: under a minute on an idle 2-core "
           "machine, minutes on a loaded one), thorough (about 10x ci)", DEFAULT_PROFILE,
           choices=tuple(sorted(PROFILES))),
    Option("--seed", "seed of the randomized cases", 0, seed_value),
    Option("--known", "TOML file of known findings (docs/known-findings.md): reported apart, they do not "
           "fail the run; entries that match nothing are reported as stale", None, metavar="FILE", path=True),
    Option("--strict-known", "with the known-findings file: known findings and stale entries fail the run "
           "too (`--strict` on the CLI)", False, cli_aliases=("--strict",), action="store_true"),
    Option("--bitwise", "also run the opt-in bitwise checks (determinism, batch invariance) and "
           "print which hold per configuration", False, action="store_true"),
    Option("--fail-on", "what fails the run: new findings (the default), any finding (known ones included), or "
           "in-use: new findings in the target's use only (beyond-use ones are still printed)", "new",
           choices=FAIL_ON),
)}


def add_argparse(parser: argparse.ArgumentParser | Any, names: tuple[str, ...], **defaults: Any) -> None:
    """Add the named shared options to an argparse parser (or argument group); `defaults`
    overrides a default for this command."""
    for name in names:
        opt = OPTIONS[name]
        parser.add_argument(*opt.cli_aliases, opt.flag, **opt.kwargs(defaults.get(name, opt.default)))


PYTEST_PREFIX = "harness"


def pytest_flag(name: str) -> str:
    """The pytest route's flag of a shared option: `--harness-tp` for the CLI's `--tp`."""
    return f"--{PYTEST_PREFIX}-{OPTIONS[name].flag.lstrip('-')}"


def pytest_dest(name: str) -> str:
    """Its dest and ini key: `harness_tp`."""
    return f"{PYTEST_PREFIX}_{name}"


def add_pytest(parser: Any, names: tuple[str, ...]) -> None:
    """The same options for pytest (`parser` is pytest's): each as `--harness-NAME` in a group of
    its own and as the ini key `harness_NAME`. Their defaults are None here: `pytest_value` falls
    back on the ini key, then on the option's default."""
    group = parser.getgroup(PYTEST_PREFIX, "logprob-harness (the shipped suite: pytest --pyargs harness.conformance)")
    for name in names:
        opt = OPTIONS[name]
        kw = opt.kwargs(None)
        kw["dest"] = pytest_dest(name)
        group.addoption(pytest_flag(name), **kw)
        parser.addini(pytest_dest(name), f"{opt.help} (as {pytest_flag(name)})",
                      type="bool" if opt.action == "store_true" else "string", default=None)


# Options the pytest route has no default for: a session names the routine it checks (a session
# that fell back on the built-in routine would pass, green, on the wrong target).
NO_PYTEST_DEFAULT = ("target",)


def pytest_value(config: Any, name: str) -> Any:
    """An option of the pytest route: the command line's, else the ini key's (parsed by the same
    validator), else the option's default (None for NO_PYTEST_DEFAULT). A bad ini value is a usage
    error naming the key. An ini key's relative path is from pytest's rootdir, where the ini file
    sits, so a session reads the same file from any directory; a flag's is from the working directory."""
    opt = OPTIONS[name]
    got = config.getoption(pytest_dest(name))
    if got is not None:
        return got
    ini = config.getini(pytest_dest(name))
    if ini in (None, ""):
        return None if name in NO_PYTEST_DEFAULT else opt.default
    if opt.action == "store_true":
        return bool(ini)
    if opt.choices is not None and ini not in opt.choices:
        raise UsageError(f"ini {pytest_dest(name)} = {ini!r}: one of {', '.join(opt.choices)}")
    if opt.path:
        return str(Path(config.rootpath, ini))
    try:
        return opt.parse(ini) if opt.parse is not None else ini
    except UsageError as e:
        raise UsageError(f"ini {pytest_dest(name)}: {e}") from None


def pytest_asked(config: Any, names: tuple[str, ...]) -> bool:
    """Whether the session asks for the harness by option or ini key (a launched world, which
    every rank would otherwise serve, is taken over only then)."""
    return any(config.getoption(pytest_dest(n)) not in (None, False) or config.getini(pytest_dest(n)) not in (None, "")
               for n in names)


@dataclass
class RunConfig:
    """What a run needs: the target, where it runs, and the pools to reuse (the test suite's
    session pools; None: the run starts and closes its own)."""
    target: str = DEFAULT_TARGET
    tp: list[int] = field(default_factory=lambda: [1, 2, 4])
    device: str = "cpu"
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    pools: dict | None = None
    known: str | None = None  # the --known file
    case_timeout_s: float | None = None
    bitwise: bool = False
    cp: list[int] | None = None  # the --cp sizes; None: the profile's

    @classmethod
    def from_options(cls, get: Callable[[str], Any], pools: dict | None = None) -> "RunConfig":
        """From parsed options: `get(name)` is `vars(ns).get` or pytest's `config.getoption`; an
        option the command does not have (None) takes its default."""
        def value(name: str) -> Any:
            try:
                got = get(name)
            except ValueError:  # pytest's getoption, for an option this front end does not add
                got = None
            return OPTIONS[name].default if got is None else got
        cp = value("cp")
        return cls(value("target"), list(value("tp")), value("device"), value("collective_timeout"), pools,
                   value("known"), value("case_timeout"), bool(value("bitwise")), None if cp is None else list(cp))
