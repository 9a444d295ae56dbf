"""Targets: the implementations under test, resolved from a spec string.

A spec is an importable module path (`harness.targets.fused`, `mypkg.logprobs`), a Python file
(`mylp.py`, `./pkg/mylp.py`: imported by its module name, then known by its absolute path) or
`PREFIX:NAME` for a target namespace: a package that registers itself under the entry-point group
`harness.target_namespaces` (the mutation catalog is `mutant:NAME`). The resolver knows no
namespace by name. A module provides the functions of any level's contract (`Level.contracts`,
`harness.base.levels`: the kernel, the wrapper, the fused-linear routine, docs/fused-linear.md, any
of the distillation level's four functions, docs/distill.md), under the contract's names. Its typed
declaration, `HARNESS = Declaration(...)` (`harness.targets.declaration`; the older loose
`HARNESS_*` globals still load), describes it further:

- `capabilities`: dict overriding `{"entropy": True, "keep_mask": True,
  "metric_only_entropy": True, "top_p": True, "cpu": True, "eager": True, "tensor_parallel": True,
  "context_parallel": True, "allgather_cp": True, "cp_gradient": True}` for a routine
  that computes no entropy, takes no keep mask, ignores `with_entropy_grad=False`, or whose wrapper
  takes no top-p replay, no context parallelism or no all-gather CP layout (cases needing
  it are fitted to what it does, and the summary says so: `cases.capabilities`); that runs only on
  CUDA (`"cpu": False`: a CPU run refuses it with that reason, a pytest session skips it); that is
  compiled with torch.compile (`"eager": False`: the memory meter runs a metered routine's compiled
  parts eagerly, and compiled code allocates past the dispatcher where no ledger sees it, so the
  meter stays off and the memory checks say "not applied"); or that is not tensor-parallel, so its adapter gathers the shards at TP > 1
  (`"tensor_parallel": False`: the memory checks say "not applied" there: the gather's cost is the
  adapter's); or whose wrapper's CP backward cannot run (`"cp_gradient": False`: its CP cases run
  without autograd). One is False unless declared: `"wrapper_half_precision"`, a wrapper that takes
  bf16 and fp16 logits besides the contract's float32 ones. A value may be given per device,
  `{"cpu": False}`: a run on that device fits its cases to False, any other to True;
- `memory_budget`: dict of retained/peak budgets as multiples of `T * V_local * 4` bytes;
- `use`: the inputs the trainer's own callers never make, each entry citing the trainer's
  file and line (`harness.checks.use`): findings on them are `beyond-use`, the others `in-use`.

A routine older than the contract's newest parameters (no `with_entropy_grad`, no top-p arguments)
is called without them, and the capability that this means is inferred false (`Contract.optional`,
docs/history.md); a level that the contract cannot call at all is left out (`not_checked`).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from harness.base import levels
from harness.base.errors import TargetError
from harness.cases.capabilities import OPT_IN
from harness.targets.declaration import declaration_of

KERNEL = "calculate_log_probs_and_entropy"
WRAPPER = "get_log_probs_and_entropy"
LINEAR = "calculate_linear_log_probs_and_entropy"
# The distillation level (docs/distill.md): any subset of four functions, keyed by what a case calls.
DISTILL = {"log_softmax": "distill_log_softmax", "topk": "distill_topk", "gather": "distill_gather",
           "divergence": "distill_divergence"}


@dataclass
class Target:
    spec: str
    # level -> {contract function key -> routine}: what the target provides, by its level's contracts
    # (`harness.base.levels`); a level it does not provide is absent.
    routines: dict[str, dict[str, Callable]] = field(default_factory=dict)
    capabilities: dict[str, Any] = field(default_factory=dict)  # bool, or {device: bool} (`on`)
    memory_budget: dict[str, float] = field(default_factory=dict)
    inferred: dict[str, bool] = field(default_factory=dict)  # capabilities read off the signatures
    not_checked: dict[str, str] = field(default_factory=dict)  # level -> why its routine cannot be called
    omitted: dict[str, frozenset[str]] = field(default_factory=dict)  # level -> contract parameters it lacks
    use: list[dict[str, Any]] = field(default_factory=list)  # HARNESS_USE (`harness.checks.use`)

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(lvl for lvl in levels.all_levels() if self.routines.get(lvl))

    def routine(self, level: str, key: str | None = None) -> Callable | None:
        """The routine of `level`'s contract function `key` (default: the level's only one)."""
        found = self.routines.get(level, {})
        return found.get(key) if key is not None else next(iter(found.values()), None)

    # The routines by the names the contract's levels have always had here (peers and the engine's
    # rank-side calls read them).
    kernel = property(lambda self: self.routine("kernel"))
    wrapper = property(lambda self: self.routine("wrapper"))
    linear = property(lambda self: self.routine("linear"))
    distill = property(lambda self: self.routines.get("distill", {}))

    def supports(self, feature: str) -> bool:
        """Whether it has `feature`; one declared per device counts only where every device has it
        (`on` resolves it for the device of a run)."""
        value = self.capabilities.get(feature, feature not in OPT_IN)
        return all(value.values()) if isinstance(value, dict) else value

    def on(self, device: str) -> "Target":
        """This target with its per-device capabilities (`{"cpu": False}`) resolved for `device`."""
        resolved = {k: v.get(device, True) if isinstance(v, dict) else v for k, v in self.capabilities.items()}
        return dataclasses.replace(self, capabilities=resolved)

    def kwargs(self, level: str, **kw: Any) -> dict[str, Any]:
        """The contract's keyword arguments for a call at `level`, less those the routine does not take."""
        left_out = self.omitted.get(level, frozenset())
        return {k: v for k, v in kw.items() if k not in left_out}

    def fit_notes(self) -> list[str]:
        """What the signatures told: capabilities inferred from parameters a routine lacks, and levels
        that cannot be called at all (left unchecked)."""
        notes = [f"{lvl}: called without {', '.join(sorted(params))} (not in its signature): "
                 f"{', '.join(sorted({_optional(lvl)[p] for p in params}))} inferred False"
                 for lvl, params in self.omitted.items() if params]
        return notes + [f"{lvl}: not checked: {why}" for lvl, why in self.not_checked.items()]

    def unavailable(self, device: str) -> str | None:
        """Why this target cannot run on `device`, or None."""
        if device == "cpu" and not self.supports("cpu"):
            return f"{self.spec} runs only on CUDA (HARNESS_CAPABILITIES['cpu'] is False): use --device cuda on a GPU"
        return None


def _optional(level: str) -> dict[str, str]:
    """A level's optional parameters, over all its contract functions: parameter -> capability."""
    return {p: cap for c in levels.get(level).contracts.values() for p, cap in c.optional.items()}


@dataclass(frozen=True)
class Contract:
    """A level's signature as the contract writes it: `positional` are passed by position, `keywords`
    by name (a default of `REQUIRED`: no default). `optional` maps a parameter that older routines
    lack to the capability that lacking it means: such a routine is called without it, and cases
    that need it are fitted away (`cases.capabilities`)."""
    name: str
    positional: tuple[str, ...]
    keywords: dict[str, Any]
    keyword_only: bool = False
    optional: dict[str, str] = field(default_factory=dict)

    def signature(self) -> inspect.Signature:
        kind = inspect.Parameter.KEYWORD_ONLY if self.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        return inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in self.positional]
            + [inspect.Parameter(k, kind, **({} if d is REQUIRED else {"default": d})) for k, d in self.keywords.items()])

    def bind(self, fn: Any, omitted: frozenset[str] = frozenset()) -> None:
        inspect.signature(fn).bind(*self.positional, **{k: k for k in self.keywords if k not in omitted})


REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Fitted:
    """How a routine's signature meets its level's contract: the optional parameters it lacks and the
    capabilities that this makes false, or why it cannot be called at all (`refused`)."""
    omitted: frozenset[str] = frozenset()
    inferred: dict[str, bool] = field(default_factory=dict)
    refused: str | None = None


def fit_signature(spec: str, fn: Any, contract: Contract) -> Fitted:
    """Bind the contract's call to `fn`, leaving out the optional parameters that it does not take."""
    if not callable(fn):
        return Fitted(refused=f"{spec}.{contract.name} is not callable")
    try:
        params = inspect.signature(fn).parameters
    except ValueError:  # builtins without a signature: nothing to check
        return Fitted()
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    omitted = frozenset(p for p in contract.optional if p not in params and not takes_any)
    try:
        contract.bind(fn, omitted)
    except TypeError as e:
        return Fitted(refused=mismatch(spec, contract, fn, e))
    return Fitted(omitted, {contract.optional[p]: False for p in sorted(omitted)})


def mismatch(spec: str, contract: Contract, fn: Any, error: TypeError) -> str:
    """One line: the given signature next to the expected one, and which parameter is missing or extra."""
    params = inspect.signature(fn).parameters
    expected = (*contract.positional, *contract.keywords)
    named = {p.name for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    missing = [p for p in expected if p not in named and p not in contract.optional]
    extra = [p.name for p in params.values() if p.name not in expected and p.default is p.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    why = "; ".join([*([f"missing {', '.join(missing)}"] if missing else []),
                     *([f"extra required {', '.join(extra)}"] if extra else [])]) or str(error)
    return (f"{spec}.{contract.name}{inspect.signature(fn)} does not match the contract "
            f"{contract.name}{contract.signature()}: {why}")


def contract_names() -> dict[str, str]:
    """Every contract function's name, over all levels: name -> the level it belongs to."""
    return {c.name: lvl.name for lvl in levels.all_levels().values() for c in lvl.contracts.values()}


def from_namespace(spec: str, ns: ModuleType | Any) -> Target:
    """The target of a module or namespace: for each level, the contract functions it defines. A
    routine that lacks an optional parameter runs without it (the capability it means is inferred
    false); one that cannot be called at all is left out and listed in `not_checked`, unless nothing
    is left. A level with several functions (the distillation level) may provide any of them: cases
    of a missing one are fitted away (its level's `missing_capability`)."""
    found = {lvl.name: {key: fn for key, c in lvl.contracts.items() if (fn := getattr(ns, c.name, None)) is not None}
             for lvl in levels.all_levels().values()}
    if not any(found.values()):
        raise TargetError(f"{spec} defines none of the contract's functions ({', '.join(contract_names())})")
    inferred: dict[str, bool] = {}
    omitted: dict[str, frozenset[str]] = {}
    not_checked: dict[str, str] = {}
    absent: dict[str, bool] = {}
    for name, fns in found.items():
        level = levels.get(name)
        single = len(level.contracts) == 1
        for key, fn in list(fns.items()):
            fitted = fit_signature(spec, fn, level.contracts[key])
            if fitted.refused:
                not_checked[name if single else f"{name} {key}"] = fitted.refused
                del fns[key]
                continue
            omitted[name] = omitted.get(name, frozenset()) | fitted.omitted
            inferred.update(fitted.inferred)
        if fns and level.missing_capability is not None:
            absent.update({level.missing_capability(key): False for key in level.contracts if key not in fns})
    routines = {name: fns for name, fns in found.items() if fns}
    if not routines:
        raise TargetError("; ".join(not_checked.values()))
    decl = declaration_of(ns)
    return Target(spec, routines, {**decl.capabilities, **inferred, **absent}, dict(decl.memory_budget),
                  inferred, not_checked, omitted, list(decl.use))


_cache: dict[str, Target] = {}
NAMESPACE_GROUP = "harness.target_namespaces"


def _namespace(prefix: str) -> Callable[[str], Any]:
    """The resolver registered for `prefix:` specs (entry point `prefix = "module:function"`)."""
    found = [ep for ep in importlib.metadata.entry_points(group=NAMESPACE_GROUP) if ep.name == prefix]
    if not found:
        known = sorted(ep.name for ep in importlib.metadata.entry_points(group=NAMESPACE_GROUP))
        raise TargetError(f"unknown target namespace {prefix!r} in {prefix}:...; known: {known}")
    return found[0].load()


def is_file_spec(spec: str) -> bool:
    """A target given as a file (`mylp.py`, `./pkg/mylp.py`): a module path has no `/` and no `.py`."""
    return spec.endswith(".py") or "/" in spec or os.sep in spec


def _import_file(spec: str) -> tuple[str, ModuleType]:
    """(absolute path, module) of a target given as a file. It is imported under its module name:
    its stem, prefixed by the packages it sits in (folders with an `__init__.py`), from the folder
    above them, which goes on sys.path (at the end: the file's siblings import, nothing is
    shadowed). The absolute path is the spec from then on, so pool workers and repro lines
    resolve the same file from any directory."""
    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise TargetError(f"no such file: {spec} (a target is a module path, PREFIX:NAME, or a .py file)")
    parts = [] if path.name == "__init__.py" else [path.stem]
    root = path.parent
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    name = ".".join(parts)
    if not parts or not all(p.isidentifier() for p in parts):
        raise TargetError(f"{spec}: {name!r} is not an importable module name; rename the file")
    if str(root) not in sys.path:
        sys.path.append(str(root))
    try:
        module = importlib.import_module(name)
    except Exception as e:  # any import-time failure is the target's, not ours
        raise TargetError(f"cannot import target {spec!r} (module {name} from {root}): {type(e).__name__}: {e}") from None
    found = Path(getattr(module, "__file__", None) or "").resolve()
    if found != path:
        raise TargetError(f"{spec}: its module name {name!r} is taken by {found}; rename the file or pass a module path")
    return str(path), module


def repro_env(target: Target) -> str:
    """The environment a repro line needs to import the target from another directory: for a module
    target found only through the current directory or $PYTHONPATH (and not the harness's own), the
    `PYTHONPATH=...` the run used, absolute and led by the target's folder; otherwise ""."""
    parts = target.spec.split(".")
    module = sys.modules.get(target.spec)
    file = getattr(module, "__file__", None)
    if file is None or is_file_spec(target.spec):
        return ""
    path = Path(file).resolve()
    root = path.parents[len(parts) - 1 + (path.name == "__init__.py")]
    entries = [Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root == Path(__file__).resolve().parents[2] or root not in (Path.cwd().resolve(), *entries):
        return ""
    paths = list(dict.fromkeys(str(p) for p in (root, *entries)))
    return f"PYTHONPATH={shlex.quote(os.pathsep.join(paths))} "


def load_target(spec: str) -> Target:
    """Resolve a spec once per process; raises TargetError with a one-line reason. A file path
    resolves to the absolute path, which is then the target's spec."""
    if spec in _cache:
        return _cache[spec]
    if is_file_spec(spec):
        path, ns = _import_file(spec)
        _cache[spec] = _cache[path] = target = _cache.get(path) or from_namespace(path, ns)
        return target
    prefix, sep, name = spec.partition(":")
    if sep:
        ns = _namespace(prefix)(name)
    else:
        try:
            ns = importlib.import_module(spec)
        except Exception as e:  # any import-time failure is the target's, not ours
            raise TargetError(f"cannot import target {spec!r}: {type(e).__name__}: {e}") from None
    _cache[spec] = target = from_namespace(spec, ns)
    return target
