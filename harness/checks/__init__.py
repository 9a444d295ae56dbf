"""The check registry: one entry per check, each a small function of the evidence of one case.

A check is added in one place: decorate a function in a module of this package with `@check(...)`.
Its name is what `-k` selects, what findings carry, and what the mutation catalog expects.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cases.case import Case
from harness.checks import oracle, tolerance
from harness.observations import Observation, RankResult
from harness.targets import Target


@dataclass
class Evidence:
    """What the ranks observed for one case (and for its twin, when the check asked for one)."""

    case: Case
    target: Target
    ranks: list[RankResult]
    twins: dict[str, "Evidence"] = field(default_factory=dict)
    margins: list[tuple[str, float]] = field(default_factory=list)  # (what, max error / allowed)

    @functools.cached_property
    def expected(self) -> oracle.Expected:
        return oracle.expected(self.case)

    @property
    def failed_ranks(self) -> list[RankResult]:
        return [r for r in self.ranks if r.error]

    def completed(self, stage: str) -> bool:
        """Every rank got through `stage` ("forward", or "backward" = the whole case)."""
        order = ("forward", "backward")
        return all(r.obs.stage in order[order.index(stage):] for r in self.ranks)

    def obs(self, rank: int = 0) -> Observation:
        return self.ranks[rank].obs

    def full_grad(self) -> torch.Tensor | None:
        """The gradient assembled from every rank's shard, in rank order."""
        shards = [r.obs.grad for r in self.ranks]
        if any(s is None for s in shards):
            return None
        return torch.cat(shards, dim=-1)

    def compare(self, actual: Any, expected: torch.Tensor, bound: torch.Tensor, what: str) -> list[str]:
        """`tolerance.compare`, also recording how much of the bound was used (for the margin plots)."""
        problems, worst = tolerance.compare(actual, expected, bound, what)
        if worst is not None:
            self.margins.append((what, worst))
        return problems


CheckFn = Callable[[Evidence], list[str]]


@dataclass(frozen=True)
class Check:
    name: str
    levels: tuple[str, ...]
    fn: CheckFn
    applies: Callable[[Case, Target], bool]
    twin: Callable[[Case], Case | None] | None
    needs: str | None
    min_tp: int
    doc: str

    def applicable(self, case: Case, target: Target) -> bool:
        return case.level in self.levels and case.tp >= self.min_tp and self.applies(case, target)


REGISTRY: dict[str, Check] = {}


def check(name: str, *, levels: tuple[str, ...] = ("kernel", "wrapper"),
          applies: Callable[[Case, Target], bool] = lambda c, t: True,
          twin: Callable[[Case], Case | None] | None = None,
          needs: str | None = "backward", min_tp: int = 1) -> Callable[[CheckFn], CheckFn]:
    """Register a check. `needs`: the stage ("forward" or "backward") every rank must have completed
    for the check to have evidence (a rank that raised earlier is `crash`'s finding); None: always.
    `twin`: a second case the check compares against (run on its own pool), or None to skip.
    `min_tp`: the smallest TP size at which the check can fail at all."""
    def register(fn: CheckFn) -> CheckFn:
        if name in REGISTRY:
            raise ValueError(f"check {name!r} registered twice")
        REGISTRY[name] = Check(name, levels, fn, applies, twin, needs, min_tp,
                               (fn.__doc__ or "").strip())
        return fn
    return register


# The performance gate's checks (`harness.perf_gate`): they compare a run with a saved baseline,
# not one case with the oracle, so they are not in the registry; findings and known entries name them.
BASELINE_CHECKS = ("perf-time", "perf-instructions", "perf-collectives", "perf-memory")
CHECK_MODULES = ("common", "kernel", "memory", "wrapper")  # the order of summaries, JSON and test ids


def all_checks() -> dict[str, Check]:
    """Every registered check, module by module in CHECK_MODULES order, whatever imported them first."""
    modules = [importlib.import_module(f"{__name__}.{m}") for m in CHECK_MODULES]
    names = [m.__name__ for m in modules]
    return dict(sorted(REGISTRY.items(), key=lambda kv: names.index(kv[1].fn.__module__)))
