"""The level registry: one `Level` object per routine family (kernel, wrapper, fused-linear,
distillation), and the only place shared code learns what a level is.

A level bundles what is its own: its case class, its contract functions, how a rank calls its
routine, its float64 oracle, its judging of the shared checks, its strategy and profile counts, the
evidence its observations give the generic checks, and how its findings become stand-alone scripts.
Shared code (the executor, the checks, the explorer, the reports, `history`) asks the case's level
(`of(case)`) or iterates `all_levels()`; it never compares level names.

The objects live in `harness.levels` (one module per level, above the checks they bundle); this
registry sits below every layer that asks for them and imports those modules by name when first
asked. A new level is its modules plus one entry of `BUILTIN` (or `register` from a user's code).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from harness.cases.case import CASE_TYPES, parse_case

if TYPE_CHECKING:
    from harness.targets import Contract

# The registration line: the modules of `harness.levels` that define the built-in levels, in the
# order they are run, listed and reported.
BUILTIN = ("kernel", "wrapper", "linear", "distill", "kl", "linear_distill")


@dataclass(frozen=True)
class Counts:
    """Randomized cases per TP size, per profile name (a profile it does not name: none)."""
    cases: Mapping[str, int]
    dp: Mapping[str, int] = field(default_factory=dict)  # TP groups inside a world of DP replicas
    cp: Mapping[str, int] = field(default_factory=dict)  # TP x CP worlds (a level that takes CP)


@dataclass(frozen=True)
class Level:
    """What one routine family is to the harness.

    `contracts`: the functions of the level, keyed by what a case calls (`routine_key`); a target
    holds them under those keys. `run(case, target, rank, group, device, obs, meter_memory, cp_rank)`:
    the rank side of one case. `expected(case)`: the float64 oracle with its bounds;
    `expected_on(case, cp_rank)`: what one CP rank must hold (default: the oracle). `judge`: the
    level's judging of the oracle checks (values, gradients, flags, shapes, finite, twins).
    `terms`: how a problem splits into the loss's terms (None: the level has no log-prob/entropy
    terms). `evidence`: what its observations give; a check applies where its needs are a subset.
    `fit(case, supports)`: the nearest case that a target with these capabilities takes
    (`cases.capabilities`). `grad_shard_dim`: the dimension the gradient shards of a TP group concatenate along. `cp_rank`
    is 0 at a level without context parallelism.
    """
    name: str
    case_class: type
    contracts: Mapping[str, "Contract"]
    strategy: Callable[..., Any]
    run: Callable[..., None]
    expected: Callable[[Any], Any]
    evidence: frozenset[str]
    counts: Counts
    judge: Any = None
    terms: Any = None
    expected_on: Callable[[Any, int], Any] | None = None
    grad_shard_dim: int = -1
    script: Any = None
    fit: Callable[[Any, Callable[[str], bool]], Any] = lambda case, supports: case  # a case fitted to a target
    memory: Any = None  # its memory rules: what a correct routine may spend (`harness.checks.memory`)
    routine_key: Callable[[Any], str] | None = None  # which contract function a case calls (default: the one)
    missing_capability: Callable[[str], str] | None = None  # the capability a target lacking a function lacks
    # The performance gate's cases of this level (`harness.perf.gate`), and `benchmark(target, case, rank,
    # device, group)`: one forward+backward of such a case on this rank, inputs built once (a callable).
    benchmarks: tuple[Any, ...] = ()
    benchmark: Callable[..., Callable[[], None]] | None = None
    # A covering draw: `cover(tps, seed, budget, dp)`, the cases the explorer runs first, in the budget, so
    # that every combination they stand for is reached whatever the seed and TP sizes (None: none).
    cover: Callable[..., list[Any]] | None = None

    def key(self, case: Any) -> str:
        """The contract function `case` calls."""
        return self.routine_key(case) if self.routine_key is not None else next(iter(self.contracts))

    def oracle_on(self, case: Any, cp_rank: int = 0) -> Any:
        return self.expected_on(case, cp_rank) if self.expected_on is not None else self.expected(case)


_registered: dict[str, Level] = {}
_loaded = False


def register(level: Level) -> Level:
    """Add a level (a built-in module does it when imported; a user's or a test's code may too)."""
    if level.name in _registered and _registered[level.name] is not level:
        raise ValueError(f"level {level.name!r} registered twice")
    if getattr(level.case_class, "level", None) != level.name:
        raise ValueError(f"level {level.name!r}: its case class {level.case_class.__name__} has level "
                         f"{getattr(level.case_class, 'level', None)!r}")
    _registered[level.name] = level
    CASE_TYPES[level.name] = level.case_class  # what `parse_case` reads (again, after an `unregister`)
    return level


def unregister(name: str) -> None:
    """Take a level added with `register` out again, and its case class from `parse_case`'s (a test's probe level)."""
    _registered.pop(name, None)
    CASE_TYPES.pop(name, None)


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for name in BUILTIN:
            importlib.import_module(f"harness.levels.{name}")


def all_levels() -> dict[str, Level]:
    """Every level, the built-in ones first in `BUILTIN`'s order."""
    _load()
    builtin = {n: _registered[n] for n in BUILTIN if n in _registered}
    return {**builtin, **{n: lv for n, lv in _registered.items() if n not in builtin}}


def get(name: str) -> Level:
    levels = all_levels()
    if name not in levels:
        raise KeyError(f"unknown level {name!r}; known: {', '.join(levels)}")
    return levels[name]


def of(case: Any) -> Level:
    """The level of a case (its class's `level`)."""
    return get(case.level)


def with_evidence(needs: frozenset[str]) -> tuple[str, ...]:
    """The levels whose evidence covers `needs`, in order."""
    return tuple(n for n, lv in all_levels().items() if needs <= lv.evidence)


def parse(spec: str) -> Any:
    """The case a spec names (`cases.case.parse_case`), with every level's case class known."""
    _load()
    return parse_case(spec)


def case_types() -> dict[str, type]:
    """Each level's case class, by the level's name."""
    return {name: lv.case_class for name, lv in all_levels().items()}


def benchmark_call(target: Any, case: Any, rank: int, device: Any, group: Any) -> Callable[[], None]:
    """One forward+backward of a benchmark case on this rank, inputs built once (its level's `benchmark`)."""
    level = of(case)
    if level.benchmark is None:
        raise ValueError(f"the {level.name} level has no benchmark call")
    return level.benchmark(target, case, rank, device, group)


def fit(case: Any, supports: Callable[[str], bool]) -> Any:
    """The nearest case to `case` that a target with these capabilities takes (its level's `fit`)."""
    return of(case).fit(case, supports)
