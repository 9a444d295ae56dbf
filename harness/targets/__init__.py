"""Targets: the implementations under test, resolved from a spec string.

A spec is an importable module path (`harness.targets.fused`, `mypkg.logprobs`) or `mutant:NAME`
for an entry of the mutation catalog. A module provides the kernel, the wrapper, or both, under the
contract's names. Optional module attributes describe it further:

- `HARNESS_CAPABILITIES`: dict overriding `{"entropy": True, "keep_mask": True}` for a routine that
  computes no entropy or takes no keep mask (cases needing it are skipped and the summary says so);
- `HARNESS_MEMORY_BUDGET`: dict of retained/peak budgets as multiples of `T * V_local * 4` bytes.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

KERNEL = "calculate_log_probs_and_entropy"
WRAPPER = "get_log_probs_and_entropy"
DEFAULT_TARGET = "harness.targets.fused"

_KERNEL_CALL = ((None, None, None), dict(with_entropy=False, chunk_size=-1, log_prob_keep_mask=None, with_entropy_grad=True))
_WRAPPER_CALL = ((None,), dict(args=None, unconcat_tokens=None, total_lengths=None, response_lengths=None,
                               with_entropy=False, non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None))


class TargetError(Exception):
    """The target cannot be checked at all (import failure, missing functions, wrong signature)."""


@dataclass
class Target:
    spec: str
    kernel: Callable | None
    wrapper: Callable | None
    capabilities: dict[str, bool] = field(default_factory=dict)
    memory_budget: dict[str, float] = field(default_factory=dict)

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(lvl for lvl, fn in (("kernel", self.kernel), ("wrapper", self.wrapper)) if fn is not None)

    def supports(self, feature: str) -> bool:
        return self.capabilities.get(feature, True)


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
    kernel, wrapper = getattr(ns, KERNEL, None), getattr(ns, WRAPPER, None)
    if kernel is None and wrapper is None:
        raise TargetError(f"{spec} defines neither {KERNEL} nor {WRAPPER}")
    if kernel is not None:
        _check_signature(spec, KERNEL, kernel, _KERNEL_CALL)
    if wrapper is not None:
        _check_signature(spec, WRAPPER, wrapper, _WRAPPER_CALL)
    return Target(spec, kernel, wrapper, dict(getattr(ns, "HARNESS_CAPABILITIES", {})),
                  dict(getattr(ns, "HARNESS_MEMORY_BUDGET", {})))


_cache: dict[str, Target] = {}


def load_target(spec: str) -> Target:
    """Resolve a spec once per process; raises TargetError with a one-line reason."""
    if spec in _cache:
        return _cache[spec]
    if spec.startswith("mutant:"):
        from harness.mutants import mutant_namespace

        ns = mutant_namespace(spec.removeprefix("mutant:"))
    else:
        try:
            ns = importlib.import_module(spec)
        except Exception as e:  # any import-time failure is the target's, not ours
            raise TargetError(f"cannot import target {spec!r}: {type(e).__name__}: {e}") from None
    _cache[spec] = target = from_namespace(spec, ns)
    return target
