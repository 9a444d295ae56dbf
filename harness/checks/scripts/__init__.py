"""Stand-alone scripts of findings, per level: what `harness.checks.script` needs from a level to write
one (`LevelScript`), and one module per level that provides it (`kernel.py`, `wrapper.py`,
`linear.py`, `distill.py`; the level's `Level.script` is that module's object), with `embed.py`, the
closure that turns script code and the harness's own functions into one file.

A level's script code defines, in plain Python that the script runs as written:

- `run(routine, rank, group)`: one TP rank's call, as the level's caller makes it: the rank's part
  of the case's inputs (drawn by `inputs(CASE)`, the case class's own drawing code), the routine
  called with the contract's arguments, the upstream loss's backward; what the rank saw, as a dict.
  The forward and the backward each run inside `with phase("forward")` / `phase("backward")`,
  where a memory check tallies what they allocate. The dict's gradients are under keys that start
  with `grad`, its outputs under the others;
- `judge(results)`, one per check (`judges`): the problems, from every rank's dict, against the
  float64 reference of the same inputs (the reference module's own functions, read by name through
  `uses`) and the finding's bounds (`bounds`: the oracle's allowed error of each entry, as data).

A level that writes `memory-logits-dtype` also defines `EXEMPT`: the dimensions that mark a float32
tensor as its inputs' or their gradients', not a copy of the logits (the fused-linear level's H).

The code reads the case as `CASE` (its fields), and `CHECK`, `TERM` and `TP`; an `if` on those is
decided when the script is written, so each script keeps only its own case's path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class LevelScript:
    """How a level's findings are written as stand-alone scripts (`Level.script`).

    `checks`: the checks it writes. `code`: script code defining `run` and its helpers. `judges`:
    per check, script code defining `judge(results)` (a shared check, `crash`, `empty-input`,
    `memory-logits-dtype`, takes the writer's own unless given here); its docstring says what the
    script shows. `uses`: the harness objects the code reads by name (the case class's `inputs`
    method, reference functions, the comparison), brought along with what they read. `bounds`: the
    names the code reads a bound by, each an attribute of the level's oracle (`Expected`), written
    as data. `refuse(case)`: why a case of the level cannot be written (a layout the code does not
    hand over), or None. `alone`: the checks whose finding about one term runs that term alone in
    the loss. `raising`: the checks whose judge reads a rank's error as its finding (besides `crash`
    and `empty-input`; any other check's script cannot judge a call that raised, and exits 2).
    `parallel_state`: the routine takes its TP group from megatron-core's parallel_state, which the
    script then initialises on every rank. A judge's code may define its own `run` (a check that
    calls the routine otherwise, `frozen-input-work`'s two calls): it replaces the level's."""
    checks: tuple[str, ...]
    code: str
    judges: Mapping[str, str]
    uses: Mapping[str, Any]
    bounds: Mapping[str, str] = field(default_factory=dict)
    refuse: Callable[[Any], str | None] = lambda case: None
    alone: tuple[str, ...] = ()
    raising: tuple[str, ...] = ()
    parallel_state: bool = False
