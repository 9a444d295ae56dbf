"""Optional parts: what only reports, plots and benchmarks need is an extra of the package, not the
core (`pyproject.toml`). A command that needs a missing one stops with the line that installs it
(a `UsageError`: exit 2)."""
from __future__ import annotations

import importlib
from types import ModuleType

from harness.base.errors import UsageError

# extra -> the distributions it installs (as pyproject.toml lists them)
EXTRAS = {"report": ("matplotlib", "jinja2"), "bench": ("pytest-benchmark",)}


class MissingExtra(UsageError):
    """A command needs an extra that is not installed."""


def install_line(extra: str) -> str:
    return f"pip install 'logprob-harness[{extra}]'"


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import `module`, or say which extra `what` needs and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{what} needs {module.split('.')[0]} (the `{extra}` extra): {install_line(extra)}") from None
