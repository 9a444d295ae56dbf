"""Bitwise properties (opt-in: `--bitwise`): determinism and batch invariance.

Not part of the contract's float32 tolerance: a correct routine may fail them (a reduction order
that follows the batch shape, atomics), so they run only when asked for, and the report shows, per
configuration, which hold (a property sheet as much as a gate). Each compares bit patterns: -0.0
differs from 0.0, and one NaN from another.

TP invariance is not among them: another TP size changes the reduction tree over the vocab (each
rank sums its shard, then the all-reduce sums the shards), so bitwise equality across TP sizes is
not expected of any routine. `tp-invariance` holds it to the float32 tolerance instead.
"""
from __future__ import annotations

from harness.cases.case import Case, KernelCase, WrapperCase
from harness.checks import Evidence, bitwise_diff, check

BITWISE = "bitwise"


def _rows(t, start: int, count: int):
    """Rows [start, start + count) of a kernel output ([T] or [T, 1]) or gradient ([T, V_local])."""
    return None if t is None else t[start:start + count]


def _compare(ev: Evidence, other: Evidence, what: str, start: int = 0, count: int | None = None) -> list[str]:
    """`other`'s outputs and gradient against rows [start, start + count) of `ev`'s (all rows:
    count None), rank by rank, bit for bit."""
    problems = []
    for mine, theirs in zip(ev.ranks, other.ranks, strict=True):
        a, b = mine.obs, theirs.obs
        pick = (lambda t: t) if count is None else (lambda t: _rows(t, start, count))  # noqa: E731
        for key in ("log_prob", "entropy", "grad"):
            problems += bitwise_diff(pick(getattr(a, key)), getattr(b, key), f"rank {mine.rank} {key} vs {what}")
    return problems


def _repeat(c: KernelCase | WrapperCase) -> Case | None:  # the levels of `determinism`
    return c.replace(repeat=c.repeat + 1) if c.T > 0 else None


@check("determinism", evidence=("repeatable",), family=BITWISE, twin=_repeat, twin_in_same_process=True)
def determinism(ev: Evidence) -> list[str]:
    """The same call on the same inputs, run again in the same process, returns the same bits:
    log-probs, entropy and gradient."""
    return _compare(ev, ev.twins["determinism"], "the same call run again")


def _unchunked(c: KernelCase) -> KernelCase | None:
    return c.replace(chunk_size=-1) if c.chunk_size > 0 and c.T > 0 else None


def _prefix(c: KernelCase) -> KernelCase | None:
    return c.rows_of_batch(0, (c.T + 1) // 2) if c.T >= 2 else None


def _last_row(c: KernelCase) -> KernelCase | None:
    return c.rows_of_batch(c.T - 1, 1) if c.T >= 2 else None


@check("batch-invariance-chunk", evidence=("batch-rows",), family=BITWISE, twin=_unchunked)
def batch_invariance_chunk(ev: Evidence) -> list[str]:
    """Every row's log-prob, entropy and gradient row are bitwise the same at this chunk size as
    unchunked."""
    return _compare(ev, ev.twins["batch-invariance-chunk"], "chunk_size=-1")


@check("batch-invariance-rows", evidence=("batch-rows",), family=BITWISE, twin=_prefix)
def batch_invariance_rows(ev: Evidence) -> list[str]:
    """The first half of the rows, run alone (fewer rows T, same chunk size), give bitwise the same
    log-probs, entropy and gradient rows as inside the whole batch."""
    twin = ev.twins["batch-invariance-rows"]
    return _compare(ev, twin, f"the first {twin.case.T} of {ev.case.T} rows run alone", 0, twin.case.T)


@check("batch-invariance-packing", evidence=("batch-rows",), family=BITWISE, twin=_last_row)
def batch_invariance_packing(ev: Evidence) -> list[str]:
    """The last row, run alone, gives bitwise the same log-prob, entropy and gradient row as when
    packed with the other rows."""
    T = ev.case.T
    return _compare(ev, ev.twins["batch-invariance-packing"], f"row {T - 1} of {T} run alone", T - 1, 1)
