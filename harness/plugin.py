"""pytest plugin (entry point `pytest11`): target options, markers, and session-scoped worker pools.

`pytest --pyargs harness.conformance --target MODULE` runs the shipped suite against MODULE.
"""
from __future__ import annotations

from typing import Any

import pytest

from cases.profiles import Profile, load_for_pytest
from harness import options
from harness.errors import HarnessError
from harness.options import RunConfig

MARKERS = {
    "gpu": "needs CUDA; skipped cleanly without it",
    "distributed": "runs on the TP worker pools",
    "perf": "performance measurement or gate",
    "slow": "long-running; deselect with -m 'not slow'",
}

# The session's state, kept in pytest's stash on its Config.
PROFILE = pytest.StashKey[Profile]()
TP = pytest.StashKey[list[int]]()
CP = pytest.StashKey[list[int]]()  # the CP sizes > 1
LAUNCHED = pytest.StashKey[Any]()  # the torchrun world rank 0 drives
EXITSTATUS = pytest.StashKey[int]()
KNOWN_RUNNER = pytest.StashKey[Any]()  # the runner whose known findings the summary lists


def pytest_addoption(parser: pytest.Parser) -> None:
    # The CLI's options, flags and validators; the profile defaults to the environment's (ci under
    # $CI, else dev) and the seed to Hypothesis's derandomized one.
    options.add_pytest(parser.getgroup("logprob-harness"),
                       ("target", "tp", "cp", "device", "collective_timeout", "case_timeout", "profile", "seed", "known",
                        "strict_known", "bitwise"),
                       profile=None, seed=None)


def option(config: pytest.Config, name: str) -> Any:
    """An option's value as parsed (pytest's getoption is unannotated, and a type checker reads a
    None into it; every option of the harness has a default)."""
    return config.getoption(name)


def run_config(config: pytest.Config, pools: dict | None = None) -> RunConfig:
    return RunConfig.from_options(lambda name: config.getoption(name), pools)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """Under torchrun: rank 0 runs the session, its pools are the launched ranks; the other ranks
    only serve rank 0's jobs (no collection, no output) and exit with its exit code."""
    from harness.engine import torchrun

    if not torchrun.active():
        return None
    cfg = run_config(config)
    try:
        world = torchrun.start(cfg.tp, cfg.device, cfg.collective_timeout_s)
    except HarnessError as e:
        if torchrun.rank() == 0:
            raise pytest.UsageError(str(e)) from None
        return pytest.ExitCode.USAGE_ERROR  # rank 0 says why
    if torchrun.rank() != 0:
        return world.serve()
    config.stash[LAUNCHED] = world
    return None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    runner = session.config.stash.get(KNOWN_RUNNER, None)
    if runner is not None and session.config.getoption("strict_known") and runner.known.stale and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # --strict: a stale known entry fails the run
    session.config.stash[EXITSTATUS] = int(session.exitstatus)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    runner = config.stash.get(KNOWN_RUNNER, None)
    if runner is None:
        return
    terminalreporter.section("harness known findings")
    for e in runner.known.entries:
        state = f"{e.matched} finding(s)" if e.matched else "STALE: matched nothing in this run"
        terminalreporter.write_line(f"{e.describe()}: {state}" + (f" ({e.link})" if e.link else ""))


def pytest_unconfigure(config: pytest.Config) -> None:
    world = config.stash.get(LAUNCHED, None)
    if world is not None:  # release the serving ranks with this session's exit code
        world.stop(config.stash.get(EXITSTATUS, pytest.ExitCode.INTERNAL_ERROR))


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    config.stash[PROFILE] = load_for_pytest(config.getoption("--profile"))
    config.stash[TP] = list(option(config, "tp"))
    config.stash[CP] = [cp for cp in (config.getoption("cp") or []) if cp > 1]
    if config.getoption("--device") == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda, but CUDA is not available (leave --device out: gpu tests skip)")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    """Say what is checked, and what the target does not provide (its cases are not drawn)."""
    from harness.targets import load_target

    try:
        target = load_target(option(config, "--target"))
    except HarnessError:
        return None  # collection reports it, as an error (exit 2)
    lines = [f"harness: target {target.spec}, levels {', '.join(target.levels)}, TP {config.stash[TP]}, "
             f"profile {config.stash[PROFILE].name}"]
    lines += [f"harness: target provides no {feature}: cases needing it are not drawn"
              for feature, ok in sorted(target.capabilities.items()) if not ok]
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from harness.targets import load_target

    try:
        unavailable = load_target(option(config, "--target")).unavailable(option(config, "--device"))
    except HarnessError:
        unavailable = None  # the runner fixture reports it
    if unavailable:  # a CUDA-only target on a CPU runner: its tests skip, saying why
        for item in items:
            if "harness_runner" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.skip(reason=unavailable))
    if config.getoption("--device") == "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="CUDA is not available")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def harness_pools(request: pytest.FixtureRequest):
    """One persistent pool per TP size for the whole session, shared by every runner."""
    from harness.engine.pool import WorkerPool

    pools: dict[int, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def harness_runner(request: pytest.FixtureRequest, harness_pools):
    """The runner for --target on the session's pools."""
    from harness.engine.runner import Runner

    try:
        runner = Runner.for_run(run_config(request.config, harness_pools))
        if runner.known.path:
            request.config.stash[KNOWN_RUNNER] = runner
    except HarnessError as e:
        pytest.exit(f"harness: error: {e}", returncode=2)
    yield runner
