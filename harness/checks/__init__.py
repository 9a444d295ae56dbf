"""The check registry: one entry per check, each a small function of the evidence of one case.

A check is added in one place: decorate a function in a module of this package with `@check(...)`
(a new module is found by `all_checks`; `ORDER` only places it among the others). A check names the
evidence it reads, never a level: it applies at every level whose observations give that evidence
(`Level.evidence`, `harness.base.levels`), so a new level gets every check it has evidence for. Its name is what
`-k` selects, what findings carry, and what the mutation catalog expects. `verdicts` turns a
check's evidence into findings and the run's statistics.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harness.base import levels as level_registry
from harness.cases.case import AUTOGRAD_OFF, Case
from harness.checks import oracle, problems, tolerance
from harness.engine.observations import Observation, RankResult
from harness.targets import Target


@dataclass
class Evidence:
    """What the ranks observed for one case (and for its twin, when the check asked for one)."""

    case: Case
    target: Target
    ranks: list[RankResult]
    twins: dict[str, "Evidence"] = field(default_factory=dict)
    margins: list[tuple[str, float]] = field(default_factory=list)  # (what, max error / allowed)

    @property
    def level(self) -> level_registry.Level:
        """The case's level: its judge, its evidence, its oracle."""
        return level_registry.of(self.case)

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

    def expected_for(self, r: RankResult, second: bool = False) -> oracle.Expected:
        """What rank `r` must hold: the oracle of its DP replica's data (`Case.replica`), at CP > 1
        sliced for its CP rank (`oracle.expected_on`); `second`: the second call's, in a two_inputs
        context (`Case.second`). Replica 0 at CP rank 0, first call, is `expected`."""
        case = self.case.replica(r.replica)
        if second:
            case = case.second()
        elif not r.replica and getattr(self.case, "cp", 1) == 1:
            return self.expected
        return oracle.expected_on(case, r.cp_rank)

    def groups(self) -> list[list[RankResult]]:
        """The TP groups of the world (one per DP replica and CP rank), each in TP-rank order."""
        out: dict[tuple[int, int], list[RankResult]] = {}
        for r in self.ranks:
            out.setdefault((r.replica, r.cp_rank), []).append(r)
        return [sorted(g, key=lambda r: r.rank) for _, g in sorted(out.items())]

    def full_grad(self, group: list[RankResult] | None = None, second: bool = False) -> torch.Tensor | None:
        """The gradient assembled from the shards of one TP group (default: the first, replica 0 at
        CP rank 0), in rank order, along the level's `grad_shard_dim`: the logits' [T, V] (shards along
        the vocab, the last dim; at CP > 1 that CP rank's local rows), or at the linear level the LM
        head's [V, H] (along the first).
        `second`: the second call's, in a two_inputs context."""
        shards = [r.obs.grad_2 if second else r.obs.grad for r in (group if group is not None else self.groups()[0])]
        present = [s for s in shards if s is not None]
        if len(present) != len(shards):
            return None
        return torch.cat(present, dim=self.level.grad_shard_dim)

    def compare(self, actual: Any, expected: torch.Tensor, bound: torch.Tensor, what: str,
                output: str = "", equal_nan: bool = False) -> list[str]:
        """`tolerance.compare` (its problems about `output`), also recording how much of the bound was
        used (for the margin plots)."""
        problems, worst = tolerance.compare(actual, expected, bound, what, output, equal_nan)
        if worst is not None:
            self.margins.append((what, worst))
        return problems


CheckFn = Callable[[Evidence], list[str]]
# `requires(target, cp) -> why or None`: what a check needs of the target, or of the CP size of a
# family of cases, to apply to any case at all ("no `HARNESS_MEMORY_BUDGET` declared"): the pytest
# route decides it before drawing a case and skips with the reason.
RequiresFn = Callable[[Target, int], "str | None"]


@dataclass(frozen=True)
class Explain:
    """What more a failing check can say from other cases, e.g. which loss term a wrong gradient comes
    from. `related(case, target)` names the cases it reads, by role; the driver runs them and hands
    their evidence to `say(evidence, related)`, which words it ("" for nothing to add). A check never
    runs a case itself. It costs runs, so the driver asks it only of the findings a run reports
    (`Runner.explain`), not of every failing case that exploring and shrinking meet."""
    related: Callable[[Any, Target], dict[str, Case]]
    say: Callable[[Evidence, dict[str, Evidence]], str]

# What a check may read that a call context does not have: (contexts, why). A check that would apply
# to a case in the training context but reads one of these says "not applied: why" instead.
CONTEXT_LIMITS: dict[str, tuple[tuple[str, ...], str]] = {
    "autograd": (AUTOGRAD_OFF, "autograd is off, so there is no graph, gradient or retained memory to check"),
    "call-memory": (("two_calls", "two_inputs"), "one backward serves both calls, so one call's backward "
                                                  "memory cannot be told apart"),
}
# What a check may read that a target may not let the harness measure: (capability, which cases,
# why). A check that would apply but reads one of these says "not applied: why" instead. "Which
# cases" reads only a case's TP and CP sizes, so a whole family of cases is decided before drawing.
TARGET_LIMITS: dict[str, tuple[tuple[str, Callable[[Any], bool], str], ...]] = {  # cases or a family (`_Sizes`)
    "memory": (
        ("eager", lambda c: True,
         "the routine runs under torch.compile, which the memory meter's Python dispatch mode would turn "
         "off (or, with fullgraph=True, make raise), so its memory is not metered "
         "(HARNESS_CAPABILITIES['eager'] is False)"),
        ("tensor_parallel", lambda c: c.tp > 1,
         "the routine is not tensor-parallel: at TP > 1 its adapter all-gathers the vocab shards, and what "
         "that costs is the adapter's, not the routine's (HARNESS_CAPABILITIES['tensor_parallel'] is False)"),
    ),
    "work": (
        ("eager", lambda c: True,
         "the routine runs under torch.compile, whose compiled code runs past the FLOP counter's Python "
         "dispatch mode, so its matmul work is not counted (HARNESS_CAPABILITIES['eager'] is False)"),
    ),
}
# What a check may read that a case's shape does not give it: (which cases, why). A check that would
# apply but reads one of these says "not applied: why" instead. "Which cases", as above, reads only
# the TP and CP sizes.
# A limit reads a case's sizes only, so a whole family (`_Sizes`) can be judged before any case is drawn.
CASE_LIMITS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "kernel-pass-memory": (lambda c: getattr(c, "cp", 1) > 1,
                           "CP > 1: a rank's wrapper memory is not its kernel's plus O(T) (no kernel backward "
                           "on a rank without response rows; the redistribution's own buffers)"),
}
FAMILIES = ("default", "bitwise")  # bitwise: opt-in (`--bitwise`)
CALL = ("call",)  # the evidence of any call: it runs, returns, issues matched collectives


@dataclass(frozen=True)
class Check:
    name: str
    evidence: frozenset[str]  # what of a case's observations it reads (`Level.evidence`)
    fn: CheckFn
    applies: Callable[[Case, Target], bool]
    twin: Callable[[Case], Case | None] | None
    needs: str | None
    min_ranks: int
    doc: str
    reads: tuple[str, ...] = ()  # CONTEXT_LIMITS and TARGET_LIMITS keys
    family: str = "default"
    explain: Explain | None = None
    twin_in_same_process: bool = False
    requires: RequiresFn | None = None
    terms: bool = False  # its problems name the output they are about: a finding per term (`checks.terms`)

    @property
    def levels(self) -> tuple[str, ...]:
        """The levels whose evidence covers this check's, in the registry's order."""
        return level_registry.with_evidence(self.evidence)

    def at(self, level: str) -> bool:
        return self.evidence <= level_registry.get(level).evidence

    def excluded(self, target: Target, tp: int, cp: int = 1) -> str | None:
        """Why no case of a family (this TP and CP size) can be checked on this target, decided
        before drawing any: what the check `requires`, and the limits it reads that hold for the
        whole family; None when some case may apply."""
        why = self.requires(target, cp) if self.requires is not None else None
        if why:
            return why
        family = _Sizes(tp, cp)
        for what in self.reads:
            if what in CASE_LIMITS and CASE_LIMITS[what][0](family):
                return CASE_LIMITS[what][1]
            for capability, cases, reason in TARGET_LIMITS.get(what, ()):
                if not target.supports(capability) and cases(family):
                    return reason
        return None

    def limit_note(self, case: Case, target: Target) -> str | None:
        """Why the case's call context, or the target, leaves this check nothing to read, or None."""
        context = getattr(case, "context", "train")
        for what in self.reads:
            if what in CONTEXT_LIMITS and context in CONTEXT_LIMITS[what][0]:
                return f"{context}: {CONTEXT_LIMITS[what][1]}"
            if what in CASE_LIMITS and CASE_LIMITS[what][0](case):
                return CASE_LIMITS[what][1]
            for capability, cases, why in TARGET_LIMITS.get(what, ()):
                if not target.supports(capability) and cases(case):
                    return why
        return None

    def applicable(self, case: Case, target: Target) -> bool:
        return self.at(case.level) and ranks(case) >= self.min_ranks and self.applies(case, target) \
            and self.limit_note(case, target) is None

    def not_applied(self, case: Case, target: Target) -> str | None:
        """"not applied: why", for a case the check would apply to on the training path of a target
        that allows it to be measured, but cannot here; None when it applies, or would not apply anyway."""
        note = self.limit_note(case, target)
        if note is None or not self.at(case.level) or ranks(case) < self.min_ranks:
            return None
        train = case.replace(context="train") if getattr(case, "context", "train") != "train" else case
        return f"not applied: {note}" if self.applies(train, target) else None


@dataclass(frozen=True)
class _Sizes:
    """A family of cases as the limits' "which cases" read it: its TP and CP sizes."""
    tp: int
    cp: int


def ranks(case: Case) -> int:
    """The ranks that share one case's sequence: its TP group, times its CP ranks. What `min_ranks`
    bounds (a check that compares ranks can fail at TP 1 once CP ranks share the work)."""
    return case.tp * getattr(case, "cp", 1)


REGISTRY: dict[str, Check] = {}


def check(name: str, *, evidence: tuple[str, ...],
          applies: Callable[[Any, Target], bool] = lambda c, t: True,  # Any: `evidence` decides the case's class
          twin: Callable[[Any], Case | None] | None = None,
          needs: str | None = "backward", min_ranks: int = 1, reads: tuple[str, ...] = (),
          family: str = "default", explain: Explain | None = None,
          twin_in_same_process: bool = False, requires: RequiresFn | None = None,
          terms: bool = False) -> Callable[[CheckFn], CheckFn]:
    """Register a check. `evidence`: what it reads of a case's observations; it applies at the levels
    that give all of it (`Level.evidence`). `needs`: the stage ("forward" or "backward") every rank must have completed
    for the check to have evidence (a rank that raised earlier is `crash`'s finding); None: always.
    `twin`: a second case the check compares against, or None to skip; it runs alongside the case, on
    another pool, unless `twin_in_same_process`: after it, in the same worker processes (a check that
    compares what a process keeps between calls: memory figures, a repeated call's bits).
    `min_ranks`: the fewest ranks sharing one sequence (TP x CP: `ranks`) at which the check can fail at all. `reads`: what of a call the
    check reads that some call contexts lack (CONTEXT_LIMITS). `family`: "bitwise" checks run only
    when asked for (`--bitwise`). `explain`: see Explain. `requires`: see RequiresFn.
    `terms`: each problem the check reports names the output it is about (the log-prob, the entropy,
    a gradient), so its findings are split by loss term (`checks.terms`): one defect per family."""
    unknown = set(reads) - set(CONTEXT_LIMITS) - set(TARGET_LIMITS) - set(CASE_LIMITS)
    if unknown or family not in FAMILIES:
        raise ValueError(f"check {name!r}: unknown reads {sorted(unknown)} or family {family!r}")

    def register(fn: CheckFn) -> CheckFn:
        if name in REGISTRY:
            raise ValueError(f"check {name!r} registered twice")
        REGISTRY[name] = Check(name, frozenset(evidence), fn, applies, twin, needs, min_ranks,
                               (fn.__doc__ or "").strip(), tuple(reads), family, explain, twin_in_same_process,
                               requires, terms)
        return fn
    return register


# The performance gate's checks (`harness.perf.gate`): they compare a run with a saved baseline,
# not one case with the oracle, so they are not in the registry; findings and known entries name them.
BASELINE_CHECKS = ("perf-time", "perf-instructions", "perf-collectives", "perf-memory")
# The order checks are listed and read in (summaries, JSON, test ids, the first finding to read): the
# checks of these modules first, in this order (a call that crashed or hung explains the other checks'
# failures), then those of any other module of this package, by module name.
ORDER = ("common", "outputs", "memory", "work", "wrapper", "side_effects", "bitwise")


def check_modules() -> list[str]:
    """Every module of this package, imported (which registers its checks), in `ORDER`."""
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    ordered = [m for m in ORDER if m in found] + [m for m in found if m not in ORDER]
    return [importlib.import_module(f"{__name__}.{m}").__name__ for m in ordered]


def all_checks(bitwise: bool = False) -> dict[str, Check]:
    """Every registered check, module by module (`check_modules`), whatever imported them first; the
    opt-in bitwise family only when `bitwise`."""
    names = check_modules()
    return dict(sorted(((k, c) for k, c in REGISTRY.items() if bitwise or c.family != "bitwise"),
                       key=lambda kv: names.index(kv[1].fn.__module__)))


def bitwise_diff(a: Any, b: Any, what: str, output: str = "") -> list[str]:
    """Where two results differ in their bits (not merely in value: -0.0 differs from 0.0, and
    one NaN from another), as failure messages about `output`; [] when identical."""
    return problems.about(output, _bitwise_diff(a, b, what)) if output else _bitwise_diff(a, b, what)


def _bitwise_diff(a: Any, b: Any, what: str) -> list[str]:
    if a is None and b is None:
        return []
    if isinstance(a, list) or isinstance(b, list):
        if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
            return [f"{what}: {_kind(a)} vs {_kind(b)}"]
        return [p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in _bitwise_diff(x, y, f"{what}[{i}]")]
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return [f"{what}: {_kind(a)} vs {_kind(b)}"]
    if a.dtype != b.dtype or a.numel() != b.numel():
        return [f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    if x.is_floating_point():
        ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()]
        x, y = x.contiguous().view(ints), y.contiguous().view(ints)
    differ = x != y
    if not differ.any():
        return []
    i = int(differ.nonzero()[0])
    return [f"{what}: {int(differ.sum())} of {x.numel()} elements differ in their bits, first at flat index {i}: "
            f"{a.detach().reshape(-1)[i].item()!r} vs {b.detach().reshape(-1)[i].item()!r}"]


def _kind(x: Any) -> str:
    return f"a list of {len(x)}" if isinstance(x, list) else type(x).__name__
