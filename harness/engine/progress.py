"""Where each rank of a pool is, collective by collective, readable while the rank cannot answer.

A rank blocked in a collective its peers never joined cannot send its trace. So every worker
publishes its progress to shared memory before and after each traced collective: how many it has
entered in the current job, whether it is inside one now, the one it entered last, and the job's
(outermost) trace so far. The driver reads the board to decide, by evidence, that a rank is stuck
and in which collective (`WorkerPool._gather`). Writes are single-writer per rank and read only
after the rank has stopped moving, so no lock is needed.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from harness.meters import trace
from harness.meters.trace import Event

TRACE_BYTES = 1 << 15  # per rank: the job's trace as text lines, enough for several hundred collectives
LAST_BYTES = 512


@dataclass(frozen=True)
class RankProgress:
    entered: int  # collectives entered in the current job (nested recordings included)
    inside: bool  # blocked (or running) in a collective right now
    last: Event | None  # the collective entered last
    trace: list[Event] | None  # the job's outermost trace so far; None if it overflowed the board


def _encode(event: Event) -> bytes:
    return (repr(tuple(event)) + "\n").encode()


def _decode(line: bytes) -> Event | None:
    try:
        value = ast.literal_eval(line.decode())
    except (ValueError, SyntaxError, UnicodeDecodeError):
        return None
    return tuple(value) if isinstance(value, tuple) else None  # type: ignore[return-value]


class ProgressBoard:
    """Shared memory for `world` ranks; created by the driver before the workers start."""

    def __init__(self, mp_context: Any, world: int):
        self.world = world
        self.entered = mp_context.RawArray("q", world)
        self.inside = mp_context.RawArray("b", world)
        self.trace_len = mp_context.RawArray("q", world)  # bytes used; -1 once overflowed
        self.trace_text = mp_context.RawArray("c", world * TRACE_BYTES)
        self.last_text = mp_context.RawArray("c", world * LAST_BYTES)

    # ---------------------------------------------------------------- driver side
    def reset(self) -> None:
        """Before each job is sent: every rank starts at zero."""
        for r in range(self.world):
            self.entered[r] = 0
            self.inside[r] = 0
            self.trace_len[r] = 0
            self.last_text[r * LAST_BYTES] = b"\0"

    def signature(self, r: int) -> tuple[int, int]:
        return int(self.entered[r]), int(self.inside[r])

    def read(self, r: int) -> RankProgress:
        raw = bytes(self.last_text[r * LAST_BYTES:(r + 1) * LAST_BYTES]).split(b"\0", 1)[0]
        last = _decode(raw) if raw else None
        used = int(self.trace_len[r])
        events: list[Event] | None = None
        if used >= 0:
            text = bytes(self.trace_text[r * TRACE_BYTES:r * TRACE_BYTES + used])
            events = [e for e in map(_decode, text.splitlines()) if e is not None]
        return RankProgress(int(self.entered[r]), bool(self.inside[r]), last, events)

    # ---------------------------------------------------------------- rank side
    def attach(self, rank: int) -> None:
        """In the worker: publish every traced collective of this rank from now on."""
        base_trace, base_last = rank * TRACE_BYTES, rank * LAST_BYTES

        def before(event: Event, outermost: bool) -> None:
            line = _encode(event)
            last = line[:LAST_BYTES - 1] + b"\0"
            self.last_text[base_last:base_last + len(last)] = last
            if outermost:
                used = self.trace_len[rank]
                if used >= 0:
                    if used + len(line) <= TRACE_BYTES:
                        self.trace_text[base_trace + used:base_trace + used + len(line)] = line
                        self.trace_len[rank] = used + len(line)
                    else:
                        self.trace_len[rank] = -1
            self.entered[rank] += 1
            self.inside[rank] = 1

        def after() -> None:
            self.inside[rank] = 0

        trace.observe(before, after)
