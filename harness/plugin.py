"""pytest plugin (entry point `pytest11`): target options, markers, and session-scoped worker pools.

`pytest --pyargs harness.conformance --target MODULE` runs the shipped suite against MODULE.
"""
from __future__ import annotations

import pytest

from cases.profiles import load_for_pytest
from harness.base import options
from harness.base.errors import HarnessError
from harness.base.options import RunConfig

MARKERS = {
    "gpu": "needs CUDA; skipped cleanly without it",
    "distributed": "runs on the TP worker pools",
    "perf": "performance measurement or gate",
    "slow": "long-running; deselect with -m 'not slow'",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    # The CLI's options, flags and validators; the profile defaults to the environment's (ci under
    # $CI, else dev) and the seed to Hypothesis's derandomized one.
    options.add_pytest(parser.getgroup("logprob-harness"),
                       ("target", "tp", "cp", "device", "collective_timeout", "case_timeout", "profile", "seed", "known",
                        "strict_known", "bitwise"),
                       profile=None, seed=None)


def run_config(config: pytest.Config, pools: dict | None = None) -> RunConfig:
    return RunConfig.from_options(lambda name: config.getoption(name), pools)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """Under torchrun: rank 0 runs the session, its pools are the launched ranks; the other ranks
    only serve rank 0's jobs (no collection, no output) and exit with its exit code."""
    from harness.driver import torchrun

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
    config.harness_launched = world
    return None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    runner = getattr(session.config, "harness_known_runner", None)
    if runner is not None and session.config.getoption("strict_known") and runner.known.stale and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # --strict: a stale known entry fails the run
    session.config.harness_exitstatus = int(session.exitstatus)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    runner = getattr(config, "harness_known_runner", None)
    if runner is None:
        return
    terminalreporter.section("harness known findings")
    for e in runner.known.entries:
        state = f"{e.matched} finding(s)" if e.matched else "STALE: matched nothing in this run"
        terminalreporter.write_line(f"{e.describe()}: {state}" + (f" ({e.link})" if e.link else ""))


def pytest_unconfigure(config: pytest.Config) -> None:
    world = getattr(config, "harness_launched", None)
    if world is not None:  # release the serving ranks with this session's exit code
        world.stop(getattr(config, "harness_exitstatus", pytest.ExitCode.INTERNAL_ERROR))


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    config.harness_profile = load_for_pytest(config.getoption("--profile"))
    config.harness_tp = list(config.getoption("tp"))
    config.harness_cp = [cp for cp in (config.getoption("cp") or []) if cp > 1]
    if config.getoption("--device") == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda, but CUDA is not available (leave --device out: gpu tests skip)")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    """Say what is checked, and what the target does not provide (its cases are not drawn)."""
    from harness.targets import load_target

    try:
        target = load_target(config.getoption("--target"))
    except HarnessError:
        return None  # collection reports it, as an error (exit 2)
    lines = [f"harness: target {target.spec}, levels {', '.join(target.levels)}, TP {config.harness_tp}, "
             f"profile {config.harness_profile.name}"]
    lines += [f"harness: target provides no {feature}: cases needing it are not drawn"
              for feature, ok in sorted(target.capabilities.items()) if not ok]
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from harness.targets import load_target

    try:
        unavailable = load_target(config.getoption("--target")).unavailable(config.getoption("--device"))
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
    from harness.driver.pool import WorkerPool

    pools: dict[int, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def harness_runner(request: pytest.FixtureRequest, harness_pools):
    """The runner for --target on the session's pools."""
    from harness.driver.runner import Runner

    try:
        runner = Runner.for_run(run_config(request.config, harness_pools))
        if runner.known.path:
            request.config.harness_known_runner = runner
    except HarnessError as e:
        pytest.exit(f"harness: error: {e}", returncode=2)
    yield runner
