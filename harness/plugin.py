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


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    config.harness_profile = load_for_pytest(config.getoption("--profile"))
    try:
        config.harness_tp = sorted({int(p) for p in config.getoption("--tp").split(",") if p.strip()})
    except ValueError:
        raise pytest.UsageError(f"--tp takes comma-separated integers, got {config.getoption('--tp')!r}") from None
    if not config.harness_tp or min(config.harness_tp) < 1:
        raise pytest.UsageError("--tp sizes must be positive")


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
