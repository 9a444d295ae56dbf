"""The mutation catalog: defective variants of the built-in routine, one registry entry each.

A mutant is a subclass of `FusedLogProbEntropy` (or, at the fused-linear level, of
`FusedLinearLogProbEntropy`; at the distillation level, of `FusedDistill`) that overrides one step, registered with `@mutant(...)` in any module
of this package (modules are discovered, so a new family of mutants is a new file). `--target
mutant:NAME` checks it like any other target, at the contract levels it was registered for.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from harness.base import levels
from harness.base.errors import TargetError
from harness.targets import fused


@dataclass(frozen=True)
class Mutant:
    name: str
    defect: str  # the class of defect
    expected: tuple[str, ...]  # the checks meant to kill it
    history: str  # the docs/contract.md history it re-creates, or ""
    routine: type  # a subclass of a built-in routine (FusedLogProbEntropy, ..., FusedDistill)
    needs_baseline: bool  # only a comparison with the clean routine's baseline can see it
    tp: tuple[int, ...]  # the TP sizes at which it can be seen
    levels: tuple[str, ...] = ("kernel", "wrapper")  # the contract levels its target provides

    @property
    def spec(self) -> str:
        return f"mutant:{self.name}"


CATALOG: dict[str, Mutant] = {}


def mutant(name: str, defect: str, expected: tuple[str, ...] | str, history: str = "",
           needs_baseline: bool = False, tp: tuple[int, ...] = (1, 2, 4),
           levels: tuple[str, ...] = ("kernel", "wrapper")) -> Callable[[type], type]:
    """`levels`: the contract levels the mutant's target provides (a fused-linear mutant only
    "linear": its defect is in that level's steps, and the other levels would only re-run the clean
    routine)."""
    def register(cls: type) -> type:
        if name in CATALOG:
            raise ValueError(f"mutant {name!r} registered twice")
        exp = (expected,) if isinstance(expected, str) else tuple(expected)
        CATALOG[name] = Mutant(name, defect, exp, history, cls, needs_baseline, tuple(tp), tuple(levels))
        return cls
    return register


def catalog() -> dict[str, Mutant]:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    return CATALOG


def mutant_namespace(name: str) -> SimpleNamespace:
    """The mutant as a target module: the contract's functions of its levels bound to one instance."""
    entry = catalog().get(name)
    if entry is None:
        raise TargetError(f"unknown mutant {name!r}; `python -m harness mutate --list` lists them")
    routine = entry.routine()
    names = [c.name for lvl in entry.levels for c in levels.get(lvl).contracts.values()]
    functions = {n: getattr(routine, n) for n in names}
    # A mutant is held to the built-in routine's declared budget: exceeding it is a defect too.
    return SimpleNamespace(**functions, HARNESS=fused.HARNESS)
