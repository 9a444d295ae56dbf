"""Targets: the implementations under test, resolved from a spec string.

A spec is an importable module path (`harness.targets.fused`, `mypkg.logprobs`) or `PREFIX:NAME`
for a target namespace: a package that registers itself under the entry-point group
`harness.target_namespaces` (the mutation catalog is `mutant:NAME`). The resolver knows no
namespace by name. A module provides the kernel, the wrapper, the fused-linear routine
(docs/fused-linear.md), or any of them, under the contract's names. Optional module attributes describe it further:

- `HARNESS_CAPABILITIES`: dict overriding `{"entropy": True, "keep_mask": True,
  "metric_only_entropy": True, "cpu": True, "eager": True, "tensor_parallel": True,
  "context_parallel": True}` for a routine
  that computes no entropy, takes no keep mask, ignores `with_entropy_grad=False` or whose wrapper
  takes no context parallelism (cases needing
  it are fitted to what it does, and the summary says so: `cases.capabilities`); that runs only on
  CUDA (`"cpu": False`: a CPU run refuses it with that reason, a pytest session skips it); that is
  compiled with torch.compile (`"eager": False`: the memory meter's Python dispatch mode would turn
  the compilation off or make it raise, so the meter stays off and the memory checks say "not
  applied"); or that is not tensor-parallel, so its adapter gathers the shards at TP > 1
  (`"tensor_parallel": False`: the memory checks say "not applied" there: the gather's cost is the
  adapter's);
- `HARNESS_MEMORY_BUDGET`: dict of retained/peak budgets as multiples of `T * V_local * 4` bytes.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from harness.errors import TargetError

KERNEL = "calculate_log_probs_and_entropy"
WRAPPER = "get_log_probs_and_entropy"
LINEAR = "calculate_linear_log_probs_and_entropy"
DEFAULT_TARGET = "harness.targets.fused"

_KERNEL_CALL = ((None, None, None), dict(with_entropy=False, chunk_size=-1, log_prob_keep_mask=None, with_entropy_grad=True))
_WRAPPER_CALL = ((None,), dict(args=None, unconcat_tokens=None, total_lengths=None, response_lengths=None,
                               with_entropy=False, non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None))
_LINEAR_CALL = ((None, None, None, None), dict(with_entropy=False, chunk_size=-1, with_entropy_grad=True))


@dataclass
class Target:
    spec: str
    kernel: Callable | None
    wrapper: Callable | None
    capabilities: dict[str, bool] = field(default_factory=dict)
    memory_budget: dict[str, float] = field(default_factory=dict)
    linear: Callable | None = None  # the fused-linear level (docs/fused-linear.md)

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(lvl for lvl, fn in (("kernel", self.kernel), ("wrapper", self.wrapper), ("linear", self.linear))
                     if fn is not None)

    def supports(self, feature: str) -> bool:
        return self.capabilities.get(feature, True)

    def unavailable(self, device: str) -> str | None:
        """Why this target cannot run on `device`, or None."""
        if device == "cpu" and not self.supports("cpu"):
            return f"{self.spec} runs only on CUDA (HARNESS_CAPABILITIES['cpu'] is False): use --device cuda on a GPU"
        return None


def _check_signature(spec: str, name: str, fn: Any, call: tuple) -> None:
    if not callable(fn):
        raise TargetError(f"{spec}.{name} is not callable")
    try:
        inspect.signature(fn).bind(*call[0], **call[1])
    except TypeError as e:
        raise TargetError(f"{spec}.{name}{inspect.signature(fn)} does not match the contract: {e}") from None
    except ValueError:  # builtins without a signature: nothing to check
        pass


def from_namespace(spec: str, ns: ModuleType | Any) -> Target:
    kernel, wrapper, linear = getattr(ns, KERNEL, None), getattr(ns, WRAPPER, None), getattr(ns, LINEAR, None)
    if kernel is None and wrapper is None and linear is None:
        raise TargetError(f"{spec} defines neither {KERNEL} nor {WRAPPER} (nor {LINEAR})")
    for name, fn, call in ((KERNEL, kernel, _KERNEL_CALL), (WRAPPER, wrapper, _WRAPPER_CALL),
                           (LINEAR, linear, _LINEAR_CALL)):
        if fn is not None:
            _check_signature(spec, name, fn, call)
    return Target(spec, kernel, wrapper, dict(getattr(ns, "HARNESS_CAPABILITIES", {})),
                  dict(getattr(ns, "HARNESS_MEMORY_BUDGET", {})), linear)


_cache: dict[str, Target] = {}
NAMESPACE_GROUP = "harness.target_namespaces"


def _namespace(prefix: str) -> Callable[[str], Any]:
    """The resolver registered for `prefix:` specs (entry point `prefix = "module:function"`)."""
    found = [ep for ep in importlib.metadata.entry_points(group=NAMESPACE_GROUP) if ep.name == prefix]
    if not found:
        known = sorted(ep.name for ep in importlib.metadata.entry_points(group=NAMESPACE_GROUP))
        raise TargetError(f"unknown target namespace {prefix!r} in {prefix}:...; known: {known}")
    return found[0].load()


def load_target(spec: str) -> Target:
    """Resolve a spec once per process; raises TargetError with a one-line reason."""
    if spec in _cache:
        return _cache[spec]
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
