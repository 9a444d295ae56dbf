"""pytest plugin (entry point `pytest11`): the `--harness-*` options and ini keys, and the session's
worker pools and runner as fixtures.

It loads into every pytest session wherever the package is installed, so it stays inert until a
session asks for it: its options are all prefixed, and it imports nothing heavy (no torch, no
target), prints no header and touches no Hypothesis settings unless the session collects a test
of the harness (one that uses `harness_runner` or `harness_pools`).

`pytest --pyargs harness.conformance --harness-target MODULE` runs the shipped suite against MODULE.
A session names its target (`--harness-target` or the ini key `harness_target`): there is no
default, so a session set up wrong is an error, never a green run of the built-in routine. The
suite is collected whatever the session's `python_files` and `python_functions` say, and imported
by its module name: collecting it puts nothing on `sys.path` (pytest's import modes would put the
directory above the installed package there, an editable checkout's `tests` and `scripts` with it).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.base import options, pytest_args
from harness.base.errors import HarnessError

# The CLI's options, flags and validators, as `--harness-NAME` and ini `harness_NAME`.
NAMES = ("target", "tp", "cp", "device", "collective_timeout", "case_timeout", "profile", "seed", "known",
         "strict_known", "bitwise", "fail_on")
FIXTURES = ("harness_runner", "harness_pools")
LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")  # as `torchrun.active` reads them (no torch import here)
SUITE = "harness.conformance.test_conformance"
SUITE_DIR = Path(__file__).resolve().parent / "conformance"
NO_TARGET = ("harness: error: no target: name the routine to check with --harness-target MODULE (or FILE.py, "
             "or mutant:NAME), or with the ini key `harness_target = MODULE` in your pytest configuration")

# The session's state, in pytest's stash on its Config.
LAUNCHED = pytest.StashKey[Any]()  # the torchrun world rank 0 drives
EXITSTATUS = pytest.StashKey[int]()
KNOWN_RUNNER = pytest.StashKey[Any]()  # the runner whose known findings the summary lists
RUNNER = pytest.StashKey[Any]()  # the session's runner, whose infrastructure events the summary lists
PARTIAL = pytest.StashKey[str]()  # why the session did not run every case of the suite (no entry is stale)


def launched(config: pytest.Config) -> Any:
    """The torchrun-launched world this session drives, or None (the harness's own pools)."""
    return config.stash.get(LAUNCHED, None)


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_pytest(parser, NAMES)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """The rootdir and ini file the user's command line means, before any conftest loads
    (`pytest_args`): a `--harness-known PATH` is not a path to test."""
    flags = {options.pytest_flag(n) for n in NAMES if options.OPTIONS[n].action is None}
    try:
        pytest_args.restore(early_config, parser, args, flags)
    except HarnessError as e:
        raise pytest.UsageError(f"harness: error: {e}") from None


def value(config: pytest.Config, name: str):
    """The session's value of a harness option (command line, else ini key, else default)."""
    try:
        return options.pytest_value(config, name)
    except HarnessError as e:
        raise pytest.UsageError(f"harness: error: {e}") from None


def target_spec(config: pytest.Config) -> str:
    """The session's target; a usage error saying how to name one when it names none."""
    spec = value(config, "target")
    if spec is None:
        raise pytest.UsageError(NO_TARGET)
    return spec


def run_config(config: pytest.Config, pools: dict | None = None) -> options.RunConfig:
    return options.RunConfig.from_options(lambda name: target_spec(config) if name == "target" else value(config, name),
                                          pools)


def uses_harness(item: pytest.Item) -> bool:
    return any(f in getattr(item, "fixturenames", ()) for f in FIXTURES)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """Under torchrun, when the session asks for the harness: rank 0 runs the session, its pools
    are the launched ranks; the other ranks only serve rank 0's jobs (no collection, no output)
    and exit with its exit code. A launched session of the user's own tests is left alone."""
    if not all(k in os.environ for k in LAUNCH_ENV) or not options.pytest_asked(config, NAMES):
        return None
    from harness.driver import torchrun

    try:
        world = torchrun.start(value(config, "tp"), value(config, "device"), value(config, "collective_timeout"))
    except HarnessError as e:
        if torchrun.rank() == 0:
            raise pytest.UsageError(str(e)) from None
        return pytest.ExitCode.USAGE_ERROR  # rank 0 says why
    if torchrun.rank() != 0:
        return world.serve()
    config.stash[LAUNCHED] = world
    return None


def pytest_configure(config: pytest.Config) -> None:
    for name in NAMES:  # a bad ini value is a usage error at once (cheap: nothing is imported)
        value(config, name)
    if value(config, "device") == "cuda":  # asked for by name: the check is the user's
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--harness-device cuda, but CUDA is not available (leave it out: CPU pools)")


@contextlib.contextmanager
def unrewritten_imports():
    """Imports past pytest's assertion rewriting hook. The hook sits first in `sys.meta_path` and
    looks up every module imported while it is there, thousands for torch, megatron-core and a
    trainer's stack: about 2.5 s of CPU before the suite's first test, a third more than `check`
    spends on the same imports. The suite's modules and its target have no assert of pytest's to
    rewrite (a test module of the user's is imported by pytest itself, with the hook)."""
    hooks = [finder for finder in sys.meta_path if type(finder).__name__ == "AssertionRewritingHook"]
    for finder in hooks:
        sys.meta_path.remove(finder)
    try:
        yield
    finally:
        sys.meta_path[:0] = hooks


class SuiteModule(pytest.Module):
    """The shipped suite's module, imported by its name and collected whatever the session's
    `python_files`, `python_classes` and `python_functions` say."""

    def _getobj(self):
        with unrewritten_imports():
            module = importlib.import_module(SUITE)
        self.config.pluginmanager.consider_module(module)
        return module

    def funcnamefilter(self, name: str) -> bool:
        return name.startswith("test_")

    def classnamefilter(self, name: str) -> bool:
        return False


def _is_suite_file(path: Path) -> bool:
    """Cheap for every other file of every session (the plugin loads into all of them)."""
    return path.name == "test_conformance.py" and path.resolve() == SUITE_DIR / path.name


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """The suite's package as a plain directory: pytest's `Package` would import its `__init__` by
    path, putting the directory above the installed package on `sys.path`."""
    if path.name == SUITE_DIR.name and path.resolve() == SUITE_DIR:
        return pytest.Dir.from_parent(parent, path=path)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if _is_suite_file(module_path):
        return SuiteModule.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    """The suite's module even where the session's `python_files` leaves it out."""
    collected = yield
    if _is_suite_file(file_path) and not any(isinstance(c, SuiteModule) for c in collected):
        collected.append(SuiteModule.from_parent(parent, path=file_path))
    return collected


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A CUDA-only target on a CPU runner: the harness's tests skip, saying why. A test that needs
    the target where the session names none: a usage error saying how to name one."""
    if not any(uses_harness(item) for item in items):
        return
    from harness.targets import load_target

    spec = value(config, "target")
    if spec is None:
        if any("harness_runner" in getattr(item, "fixturenames", ()) for item in items):
            raise pytest.UsageError(NO_TARGET)
        return
    try:
        unavailable = load_target(spec).unavailable(value(config, "device"))
    except HarnessError:
        unavailable = None  # the runner fixture reports it
    if unavailable:
        for item in items:
            if uses_harness(item):
                item.add_marker(pytest.mark.skip(reason=unavailable))


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str] | None:
    """What is checked, and what the target does not provide (its cases are not drawn): said only
    when the session collected a test of the harness."""
    if not any(uses_harness(item) for item in items):
        return None
    from harness.targets import load_target

    try:
        target = load_target(target_spec(config))
    except HarnessError:
        return None  # collection reports it, as an error (exit 2)
    lines = [f"harness: target {target.spec}, levels {', '.join(target.levels)}, TP {value(config, 'tp')}, "
             f"profile {value(config, 'profile')}, seed {value(config, 'seed')}"]
    lines += [f"harness: target provides no {feature}: cases needing it are not drawn"
              for feature, ok in sorted(target.capabilities.items()) if not ok]
    return lines


def pytest_deselected(items: list[pytest.Item]) -> None:
    if any(isinstance(item.parent, SuiteModule) for item in items):
        items[0].config.stash[PARTIAL] = "the session ran part of the suite (-k, -m)"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.shouldfail or session.shouldstop:
        session.config.stash[PARTIAL] = "the session stopped before its last test"
    runner = session.config.stash.get(KNOWN_RUNNER, None)
    if runner is not None and value(session.config, "strict_known") and _stale(session.config, runner) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # strict: a stale known entry fails the run
    session.config.stash[EXITSTATUS] = int(session.exitstatus)


def _stale(config: pytest.Config, runner: Any) -> list:
    """The known entries that matched nothing, in a session that ran every case of the suite: one that
    stopped early or ran part of it says nothing of the cases it did not reach."""
    return [] if PARTIAL in config.stash else runner.verdicts.known.stale


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    events = getattr(config.stash.get(RUNNER, None), "events", [])
    if events:
        terminalreporter.section("harness infrastructure events (not findings)")
        for event in events:
            terminalreporter.write_line(event)
    runner = config.stash.get(KNOWN_RUNNER, None)
    if runner is None:
        return
    terminalreporter.section("harness known findings")
    stale = _stale(config, runner)
    for e in runner.verdicts.known.entries:
        if not e.matched and e not in stale:
            continue
        state = f"{e.matched} finding(s)" if e.matched else "STALE: matched nothing in this run"
        terminalreporter.write_line(f"{e.describe()}: {state}" + (f" ({e.link})" if e.link else ""))
    unreached = len(runner.verdicts.known.stale) - len(stale)
    if unreached:
        terminalreporter.write_line(f"{unreached} known entr{'y' if unreached == 1 else 'ies'} matched nothing, not "
                                    f"reported as stale: {config.stash[PARTIAL]}")


def pytest_unconfigure(config: pytest.Config) -> None:
    world = launched(config)
    if world is not None:  # release the serving ranks with this session's exit code
        world.stop(config.stash.get(EXITSTATUS, pytest.ExitCode.INTERNAL_ERROR))


@pytest.fixture(scope="session")
def harness_pools(request: pytest.FixtureRequest):
    """One persistent pool per TP size for the whole session, shared by every runner."""
    from harness.driver.pool import WorkerPool
    from harness.meters import ledger_build

    # The memory ledger's first build, where it happens, says so on the terminal (not in a capture).
    capture = request.config.pluginmanager.getplugin("capturemanager")
    try:
        # getplugin() is typed as any plugin; this one is pytest's CaptureManager.
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():  # pyright: ignore[reportAttributeAccessIssue]
            ledger_build.compiled()
    except HarnessError as e:
        pytest.exit(f"harness: error: {e}", returncode=2)
    pools: dict[int, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def harness_runner(request: pytest.FixtureRequest, harness_pools):
    """The runner for the session's target on the session's pools."""
    from harness.driver.runner import Runner

    try:
        runner = Runner.for_run(run_config(request.config, harness_pools))
        request.config.stash[RUNNER] = runner
        if runner.verdicts.known.path:
            request.config.stash[KNOWN_RUNNER] = runner
    except HarnessError as e:
        pytest.exit(f"harness: error: {e}", returncode=2)
    yield runner
