"""The warnings a case's call raises, told apart by who raised them.

A user's configuration may turn warnings into errors (`python -W error`, pytest's
`filterwarnings = error`); the worker processes inherit those filters. Left to act, such a filter
would raise inside the call, and the harness would report the routine as crashing, even for a
warning raised by the harness's own adapter code. So during a case every warning is caught instead
of acted on, and sorted by the frame that raised it: the innermost frame outside torch and the
standard library is who called the warning's API. A warning whose caller is the harness itself (an
adapter, the executor) is dropped. One whose caller is the routine, and which the user's own
filters would have made an error, is kept as an observation (`RoutineWarning`), and the `warning`
check reports it as what it is, with its category. A routine warning that the user's filters leave
a warning is not a finding, and is not shown.
"""
from __future__ import annotations

import re
import sys
import sysconfig
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

_HARNESS = Path(__file__).resolve().parents[1]
# The routine files inside the harness: the built-in routines and the mutants of the catalog are
# routines under test; every other file of the harness is its own code.
_ROUTINES = tuple(_HARNESS / "targets" / name for name in ("fused.py", "fused_distill.py", "fused_linear.py",
                                                           "naive.py", "mutants"))
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
_TORCH = Path(torch.__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class RoutineWarning:
    """A warning the routine raised that the user's filters turn into an error."""
    category: str
    message: str
    where: str  # file:line of the routine's frame that raised it

    def __str__(self) -> str:
        return f"{self.category} at {self.where} ({self.message!r})"


def harness_file(path: str) -> bool:
    """Whether `path` is the harness's own code (not one of the routines it ships under test)."""
    p = Path(path).resolve()
    return p.is_relative_to(_HARNESS) and not any(p == r or p.is_relative_to(r) for r in _ROUTINES)


def _library(path: str) -> bool:
    p = Path(path).resolve()
    return p.is_relative_to(_TORCH) or (p.is_relative_to(_STDLIB) and "site-packages" not in p.parts)


def caller(frames: list[tuple[str, int]]) -> tuple[str, int] | None:
    """The innermost frame (file, line) that is neither torch nor the standard library: whose call
    raised the warning. `frames` runs from the innermost outwards."""
    return next(((f, n) for f, n in frames if not _library(f) and not f.startswith("<")), None)


def _matches(pattern: Any, text: str) -> bool:
    """As the warnings module matches a filter's message or module: None matches anything, a plain
    string only itself (a filter a library put into `warnings.filters` by hand), a regex by `match`."""
    if pattern is None:
        return True
    return pattern == text if isinstance(pattern, str) else bool(pattern.match(text))


def action(filters: list, category: type[Warning], message: str, module: str, lineno: int) -> str:
    """What `filters` (a snapshot of `warnings.filters`) do with this warning, as the warnings
    module decides it: the first filter that matches, else the default action."""
    for act, msg, cat, mod, line in filters:
        if _matches(msg, message) and issubclass(category, cat) and _matches(mod, module) and \
                (line == 0 or line == lineno):
            return act
    return getattr(warnings, "defaultaction", "default")  # not in typeshed's stubs, always set at runtime


def _shown(path: str) -> str:
    """`path` as the folder on sys.path that holds it would name it (`nemo_rl/distributed/model_utils.py`)."""
    p = Path(path).resolve()
    roots = [Path(e).resolve() for e in sys.path if e and Path(e).is_dir()]
    under = [r for r in roots if p.is_relative_to(r)]
    return str(p.relative_to(max(under, key=lambda r: len(r.parts)))) if under else p.name


def _module_of(filename: str) -> str:
    for name, mod in list(sys.modules.items()):
        if getattr(mod, "__file__", None) == filename:
            return name
    return re.sub(r"\.py$", "", filename)


@contextmanager
def sorted_warnings() -> Iterator[list[RoutineWarning]]:
    """Catch every warning raised inside the block; yield the list that receives the routine's
    warnings the caller's filters (as they were on entry) would have raised as errors. (A filter the
    routine itself sets during the call comes before this block's, and acts as it would anyway.)"""
    user_filters = list(warnings.filters)
    kept: list[RoutineWarning] = []
    seen: set[tuple[str, str, str]] = set()

    def tally(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 - showwarning's signature
        frame, frames = sys._getframe(1), []
        while frame is not None:
            frames.append((frame.f_code.co_filename, frame.f_lineno))
            frame = frame.f_back
        who = caller(frames)
        if who is None or harness_file(who[0]):
            return
        text = str(message)
        if action(user_filters, category, text, _module_of(filename), lineno) != "error":
            return
        key = (category.__name__, text, f"{_shown(who[0])}:{who[1]}")
        if key not in seen:
            seen.add(key)
            kept.append(RoutineWarning(*key))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = tally
        yield kept
