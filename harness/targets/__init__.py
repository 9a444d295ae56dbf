"""Targets: the implementations under test, resolved from a spec string.

A spec is an importable module path (`harness.targets.fused`, `mypkg.logprobs`), a Python file
(`mylp.py`, `./pkg/mylp.py`: imported by its module name, then known by its absolute path) or
`PREFIX:NAME` for a target namespace: a package that registers itself under the entry-point group
`harness.target_namespaces` (the mutation catalog is `mutant:NAME`). The resolver knows no
namespace by name. A module provides the kernel, the wrapper, the fused-linear routine
(docs/fused-linear.md), any of the distillation level's four functions (docs/distill.md), or any of
them, under the contract's names. Optional module attributes describe it further:

- `HARNESS_CAPABILITIES`: dict overriding `{"entropy": True, "keep_mask": True,
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
- `HARNESS_MEMORY_BUDGET`: dict of retained/peak budgets as multiples of `T * V_local * 4` bytes;
- `HARNESS_USE`: the inputs the trainer's own callers never make, each entry citing the trainer's
  file and line (`harness.checks.use`): findings on them are `beyond-use`, the others `in-use`.

A routine older than the contract's newest parameters (no `with_entropy_grad`, no top-p arguments)
is called without them, and the capability that this means is inferred false (`CONTRACTS`,
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

from harness.base.errors import TargetError
from harness.cases.capabilities import OPT_IN

KERNEL = "calculate_log_probs_and_entropy"
WRAPPER = "get_log_probs_and_entropy"
LINEAR = "calculate_linear_log_probs_and_entropy"
# The distillation level (docs/distill.md): any subset of four functions, keyed by what a case calls.
DISTILL = {"log_softmax": "distill_log_softmax", "topk": "distill_topk", "gather": "distill_gather",
           "divergence": "distill_divergence"}


@dataclass
class Target:
    spec: str
    kernel: Callable | None
    wrapper: Callable | None
    capabilities: dict[str, Any] = field(default_factory=dict)  # bool, or {device: bool} (`on`)
    memory_budget: dict[str, float] = field(default_factory=dict)
    linear: Callable | None = None  # the fused-linear level (docs/fused-linear.md)
    inferred: dict[str, bool] = field(default_factory=dict)  # capabilities read off the signatures
    not_checked: dict[str, str] = field(default_factory=dict)  # level -> why its routine cannot be called
    omitted: dict[str, frozenset[str]] = field(default_factory=dict)  # level -> contract parameters it lacks
    distill: dict[str, Callable] = field(default_factory=dict)  # the distillation level: function -> routine
    use: list[dict[str, Any]] = field(default_factory=list)  # HARNESS_USE (`harness.checks.use`)

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(lvl for lvl, fn in (("kernel", self.kernel), ("wrapper", self.wrapper), ("linear", self.linear),
                                         ("distill", self.distill or None)) if fn is not None)

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
                 f"{', '.join(sorted({CONTRACTS[lvl].optional[p] for p in params}))} inferred False"
                 for lvl, params in self.omitted.items() if params]
        return notes + [f"{lvl}: not checked: {why}" for lvl, why in self.not_checked.items()]

    def unavailable(self, device: str) -> str | None:
        """Why this target cannot run on `device`, or None."""
        if device == "cpu" and not self.supports("cpu"):
            return f"{self.spec} runs only on CUDA (HARNESS_CAPABILITIES['cpu'] is False): use --device cuda on a GPU"
        return None


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
CONTRACTS = {
    "kernel": Contract(KERNEL, ("logits", "tokens", "tp_group"),
                       dict(with_entropy=False, chunk_size=-1, log_prob_keep_mask=None, with_entropy_grad=True),
                       optional={"with_entropy_grad": "metric_only_entropy", "log_prob_keep_mask": "keep_mask"}),
    "wrapper": Contract(WRAPPER, ("logits",),
                        dict(args=REQUIRED, unconcat_tokens=REQUIRED, total_lengths=REQUIRED, response_lengths=REQUIRED,
                             with_entropy=False, non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None),
                        keyword_only=True, optional={"top_p_token_ids": "top_p", "top_p_token_offsets": "top_p"}),
    "linear": Contract(LINEAR, ("hidden", "weight", "tokens", "tp_group"),
                       dict(with_entropy=False, chunk_size=-1, with_entropy_grad=True),
                       optional={"with_entropy_grad": "metric_only_entropy"}),
}
DISTILL_CONTRACTS = {
    "log_softmax": Contract(DISTILL["log_softmax"], ("logits", "tp_group"), dict(temperature=1.0, chunk_size=-1)),
    "topk": Contract(DISTILL["topk"], ("logits", "k", "tp_group"), dict(temperature=1.0, chunk_size=-1)),
    "gather": Contract(DISTILL["gather"], ("logits", "indices", "tp_group"),
                       dict(temperature=1.0, chunk_size=-1, renormalize=False)),
    "divergence": Contract(DISTILL["divergence"], ("student_logits", "tp_group"),
                           dict(teacher_logits=None, teacher_topk_log_probs=None, teacher_topk_indices=None, k=0,
                                kind="forward_kl", beta=0.5, temperature=1.0, renormalize=True, chunk_size=-1),
                           keyword_only=True),
}


@dataclass(frozen=True)
class Fitted:
    """How a routine's signature meets its level's contract: the optional parameters it lacks and the
    capabilities that this makes false, or why it cannot be called at all (`refused`)."""
    omitted: frozenset[str] = frozenset()
    inferred: dict[str, bool] = field(default_factory=dict)
    refused: str | None = None


def fit_signature(spec: str, level: str, fn: Any, contract: Contract | None = None) -> Fitted:
    """Bind the contract's call to `fn`, leaving out the optional parameters that it does not take."""
    contract = contract or CONTRACTS[level]
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


def from_namespace(spec: str, ns: ModuleType | Any) -> Target:
    """The target of a module or namespace. A level whose routine lacks an optional parameter runs
    without it (the capability it means is inferred false); a level that cannot be called at all is
    left out and listed in `not_checked`, unless no level is left."""
    fns = {lvl: getattr(ns, c.name, None) for lvl, c in CONTRACTS.items()}
    distill = {f: fn for f, c in DISTILL_CONTRACTS.items() if (fn := getattr(ns, c.name, None)) is not None}
    if all(fn is None for fn in fns.values()) and not distill:
        raise TargetError(f"{spec} defines neither {KERNEL} nor {WRAPPER} (nor {LINEAR}, nor a distillation "
                          f"function: {', '.join(DISTILL.values())})")
    inferred: dict[str, bool] = {}
    omitted: dict[str, frozenset[str]] = {}
    not_checked: dict[str, str] = {}
    for lvl, fn in fns.items():
        if fn is None:
            continue
        fitted = fit_signature(spec, lvl, fn)
        if fitted.refused:
            not_checked[lvl], fns[lvl] = fitted.refused, None
            continue
        omitted[lvl] = fitted.omitted
        inferred.update(fitted.inferred)
    for f, fn in list(distill.items()):
        refused = fit_signature(spec, "distill", fn, DISTILL_CONTRACTS[f]).refused
        if refused:
            not_checked[f"distill {f}"] = refused
            del distill[f]
    if all(fn is None for fn in fns.values()) and not distill:
        raise TargetError("; ".join(not_checked.values()))
    declared = dict(getattr(ns, "HARNESS_CAPABILITIES", {}))
    # A distillation target without one of the four functions: cases of it are fitted to the others.
    absent = {f"distill_{f}": False for f in DISTILL if distill and f not in distill}
    return Target(spec, fns["kernel"], fns["wrapper"], {**declared, **inferred, **absent},
                  dict(getattr(ns, "HARNESS_MEMORY_BUDGET", {})), fns["linear"], inferred, not_checked, omitted,
                  distill, list(getattr(ns, "HARNESS_USE", [])))


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
