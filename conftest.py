"""What this repository's own pytest sessions share, `tests/` and `benchmarks/` alike: the checkout
importable and the harness's plugin loaded without the install (the benchmarks take the plugin's
`harness_runner` fixture as the tests do), and the `gpu` marker pyproject.toml declares for both,
skipped without CUDA. What only `tests/` needs, its Hypothesis profile, is in `tests/conftest.py`.

pytest loads this file in other sessions too: collecting the shipped suite of an editable install
(`pytest --pyargs harness.conformance` in a project of a user's) loads every conftest.py in the
folders above the suite, this one included, and imports it as any conftest outside a package, with
this folder put first on `sys.path`, where the checkout's `tests`, `cases` and `reference` would
stand before the user's own. So its hooks act only in sessions rooted here, and in any other it
takes that entry off `sys.path` again: such a session runs as it would without this file.
"""
import importlib.metadata
import sys
from pathlib import Path

import pytest

# As pytest imported this file: the entry its default import mode put first on sys.path.
HERE = Path(__file__).parent

if not any(ep.value == "harness.plugin" for ep in importlib.metadata.entry_points(group="pytest11")):
    pytest_plugins = ["harness.plugin"]


def _ours(config: pytest.Config) -> bool:
    return config.rootpath.resolve() == HERE.resolve()


def pytest_configure(config: pytest.Config) -> None:
    # Called as soon as pytest registers this file, before any test module of the session is imported.
    if not _ours(config) and config.getoption("importmode") == "prepend" and str(HERE) in sys.path:
        sys.path.remove(str(HERE))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _ours(config):
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="CUDA is not available")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
