"""pytest plugin (entry point `pytest11`): target options, markers, and session-scoped worker pools.

`pytest --pyargs harness.conformance --target MODULE` runs the shipped suite against MODULE.
"""
from __future__ import annotations

import pytest

from cases.profiles import PROFILES, load_for_pytest
from harness.targets import DEFAULT_TARGET

MARKERS = {
    "gpu": "needs CUDA; skipped cleanly without it",
    "distributed": "runs on the TP worker pools",
    "perf": "performance measurement or gate",
    "slow": "long-running; deselect with -m 'not slow'",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("logprob-harness")
    group.addoption("--target", default=DEFAULT_TARGET, help="module (or mutant:NAME) under test")
    group.addoption("--tp", default="1,2,4", help="TP sizes of the conformance suite, e.g. 1,2")
    group.addoption("--profile", default=None, choices=sorted(PROFILES),
                    help="Hypothesis profile (default: ci when $CI is set, else dev)")
    group.addoption("--seed", type=int, default=None, help="Hypothesis seed (default: derandomized)")
    group.addoption("--device", default="cpu", choices=("cpu", "cuda"), help="pools on CPU/gloo or CUDA/NCCL")
    group.addoption("--collective-timeout", type=float, default=20.0, help="seconds per collective")


def _tp_sizes(config: pytest.Config) -> list[int]:
    try:
        sizes = sorted({int(p) for p in config.getoption("--tp").split(",") if p.strip()})
    except ValueError:
        raise pytest.UsageError(f"--tp takes comma-separated integers, got {config.getoption('--tp')!r}") from None
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError("--tp sizes must be positive")
    return sizes


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """Under torchrun: rank 0 runs the session, its pools are the launched ranks; the other ranks
    only serve rank 0's jobs (no collection, no output) and exit with its exit code."""
    from harness import launched

    if not launched.active():
        return None
    try:
        world = launched.start(_tp_sizes(config), config.getoption("--device"),
                               config.getoption("--collective-timeout"))
    except (pytest.UsageError, launched.LaunchError) as e:
        if launched.rank() == 0:
            raise pytest.UsageError(str(e)) from None
        return pytest.ExitCode.USAGE_ERROR  # rank 0 says why
    if launched.rank() != 0:
        return world.serve()
    config.harness_launched = world
    return None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.harness_exitstatus = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    world = getattr(config, "harness_launched", None)
    if world is not None:  # release the serving ranks with this session's exit code
        world.stop(getattr(config, "harness_exitstatus", pytest.ExitCode.INTERNAL_ERROR))


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    config.harness_profile = load_for_pytest(config.getoption("--profile"))
    config.harness_tp = _tp_sizes(config)
    if config.getoption("--device") == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda, but CUDA is not available (leave --device out: gpu tests skip)")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    """Say what is checked, and what the target does not provide (its cases are not drawn)."""
    from harness.targets import TargetError, load_target

    try:
        target = load_target(config.getoption("--target"))
    except TargetError:
        return None  # collection reports it, as an error (exit 2)
    lines = [f"harness: target {target.spec}, levels {', '.join(target.levels)}, TP {config.harness_tp}, "
             f"profile {config.harness_profile.name}"]
    lines += [f"harness: target provides no {feature}: cases needing it are not drawn"
              for feature, ok in sorted(target.capabilities.items()) if not ok]
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
    from harness.pool import WorkerPool

    pools: dict[int, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def harness_runner(request: pytest.FixtureRequest, harness_pools):
    """The runner for --target on the session's pools."""
    from harness.runner import Runner
    from harness.targets import TargetError

    opt = request.config.getoption
    try:
        runner = Runner(opt("--target"), opt("--device"), opt("--collective-timeout"), pools=harness_pools)
    except TargetError as e:
        pytest.exit(f"harness: error: {e}", returncode=2)
    yield runner
