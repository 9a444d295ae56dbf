"""Per-rank record of the collectives a target issues.

Targets call `torch.distributed.<op>` at call time, so wrapping the module attributes sees every
call, whichever way the target reaches the group. Installed once per worker, before any target is
imported, so `from torch.distributed import all_reduce` in a target binds the wrapper too.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist

# torch 2.13 names the single-tensor forms `*_single` and keeps the older names as deprecated
# wrappers that call them: a call is recorded once, under the name the routine used (`_inside`).
TRACED_OPS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all", "all_to_all_single",
    "barrier", "gather", "scatter",
)

Event = tuple[str, int, tuple[int, ...], str]  # op, group size, shape, dtype

_events: list[Event] | None = None
_installed = False
# Told of every traced call, before it and after it returns or raises: (event, in the outermost
# recording) then (). The worker pools publish progress through it, so the driver can see which
# collective a rank is blocked in while that rank cannot answer.
_observer: tuple[Callable[[Event, bool], None], Callable[[], None]] | None = None
_depth = 0
# Set while the C++ memory ledger meters a call: what a collective is handed instead of each tensor
# (`memory_meter.Meter._attached`), so that its work object holds aliases the ledger can tell apart.
_alias: Callable[[torch.Tensor], torch.Tensor] | None = None
_inside = threading.local()  # within a traced call: a traced op it calls is part of it


def _describe(op: str, args: tuple, kwargs: dict) -> Event:
    tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if tensor is None:  # list-of-tensors forms (all_gather's output list first)
        lst = next((a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)), None)
        tensor = lst[0] if lst else None
    group = next((a for a in (*args, *kwargs.values()) if isinstance(a, dist.ProcessGroup)), None)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    shape = tuple(tensor.shape) if tensor is not None else ()
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "-"
    return (op, size, shape, dtype)


def _wrap(op: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any):
        observer = _observer
        if (_events is None and observer is None and _alias is None) or getattr(_inside, "op", None):
            return fn(*args, **kwargs)
        if _alias is not None:
            args, kwargs = aliased(args, _alias), {k: aliased(v, _alias) for k, v in kwargs.items()}
        # Recorded before the call: a rank that hangs inside still shows what it issued.
        event = _describe(op, args, kwargs)
        if _events is not None:
            _events.append(event)
        _inside.op = op
        try:
            if observer is None:
                return fn(*args, **kwargs)
            observer[0](event, _depth == 1)
            try:
                return fn(*args, **kwargs)
            finally:
                observer[1]()
        finally:
            _inside.op = None

    traced.__harness_traced__ = True  # pyright: ignore[reportAttributeAccessIssue] -- a function takes any attribute
    return traced


def aliased(obj: Any, alias: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` with `alias(t)` for each tensor `t` in it, through nested lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return alias(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(aliased(o, alias) for o in obj)
    return obj


@contextlib.contextmanager
def alias_collectives(alias: Callable[[torch.Tensor], torch.Tensor] | None) -> Iterator[None]:
    global _alias
    outer, _alias = _alias, alias
    try:
        yield
    finally:
        _alias = outer


def install() -> None:
    global _installed
    if _installed:
        return
    from torch.distributed import distributed_c10d as c10d

    for op in TRACED_OPS:
        fn = getattr(dist, op, None)
        if fn is None or getattr(fn, "__harness_traced__", False):
            continue
        wrapped = _wrap(op, fn)
        setattr(dist, op, wrapped)
        if getattr(c10d, op, None) is fn:
            setattr(c10d, op, wrapped)
        # torch.compile swaps a collective for its traceable form by the function's identity: the wrapper
        # gets the same form, or Dynamo traces into it and refuses its recording as a side effect. A
        # collective inside compiled code is then not recorded (`collectives` sees the eager ones).
        remaps = getattr(_functional_collectives(), "traceable_collective_remaps", {})
        if fn in remaps:
            remaps[wrapped] = remaps[fn]
    _installed = True


def _functional_collectives() -> Any:
    from torch.distributed import _functional_collectives

    return _functional_collectives


def observe(before: Callable[[Event, bool], None] | None, after: Callable[[], None] | None = None) -> None:
    """Install (or, with None, remove) the observer of every traced call."""
    global _observer
    _observer = None if before is None else (before, after or (lambda: None))


@contextlib.contextmanager
def recording() -> Iterator[list[Event]]:
    global _events, _depth
    outer, events = _events, []
    _events = events
    _depth += 1
    try:
        yield events
    finally:
        _events = outer  # nested recordings keep their calls out of the outer trace
        _depth -= 1


def count() -> int:
    """How many collectives the innermost recording holds so far."""
    return len(_events) if _events is not None else 0


def fmt_event(e: Event) -> str:
    op, size, shape, dtype = e
    return f"{op}(group={size}, shape={list(shape)}, {dtype})"
