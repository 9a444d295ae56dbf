"""Stand-alone scripts of findings, per level: what `harness.checks.script` needs from a level to write
one (`LevelScript`), and one module per level that provides it (`kernel.py`, `wrapper.py`,
`linear.py`, `distill.py`; the level's `Level.script` is that module's object).

A level writes, for one finding (`LevelScript.write(case, check, term, memory)` -> `Parts`), a few
lines of plain script code of its own: `inputs()`, the case's inputs drawn from its seed at its shapes
(a regime in a line or two, never the harness's drawing code); `run(fn, rank, group)`, one TP rank's
call as the level's caller makes it, with `CALL` where the routine is called (the writer renders
the call from `args` and what the routine takes); and `judge(results)`, the float64 reference of the
quantity in question only and one comparison, its problems each a sentence that says which rank,
which rows or shard, which term and what was expected. The shared code (`WRONG`: how a tensor misses
its reference; `TALLY`: torch's dispatch mode tallying allocations) is the writer's; a level's code
reads the case's shapes as the script's constants (`TP`, `T`, `V_LOCAL`, `V`, `SEED`) and writes
every other case field as a literal.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

ANY = object()  # an argument whose value is a script expression: always passed


@dataclass(frozen=True)
class Parts:
    """One finding's level code. `args`: the call's arguments by the contract's names, each (script
    expression, its value or ANY), in the contract's order; an argument the routine does not take,
    or a keyword at the routine's own default, is left out of the call. `about`: what the script
    shows, for its title. `constants`: the level's own script constants (name -> value)."""
    inputs: str
    run: str
    judge: str
    args: dict[str, tuple[str, Any]]
    about: str
    constants: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LevelScript:
    """How a level's findings are written as stand-alone scripts (`Level.script`). `checks`: those it
    writes. `write(case, check, term, memory)`: its code for one finding (`memory`: the forward and the
    backward run under `TALLY`'s tallies). `refuse(case)`: why a case cannot be written, or None.
    `alone`: the checks whose finding about one term runs that term alone in the loss. `raising`: the
    checks whose judge reads a rank's error (besides `crash` and `empty-input`). `parallel_state`: the
    routine takes its TP group from megatron-core's parallel_state. `exempt`: dimensions that mark a
    float32 tensor as an input's or its gradient's, not a copy of the logits (the memory check).
    `required(case)`: the arguments a peer's declared call must take to be handed this case (a top-k
    teacher's log-probs and ids): a call without one is refused, not called without it."""
    checks: tuple[str, ...]
    write: Callable[[Any, str, str, bool], Parts]
    refuse: Callable[[Any], str | None] = lambda case: None
    alone: tuple[str, ...] = ()
    raising: tuple[str, ...] = ()
    parallel_state: bool = False
    exempt: Callable[[Any], tuple[int, ...]] = lambda case: ()
    required: Callable[[Any], tuple[str, ...]] = lambda case: ()


def code(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def _under(name: str, body: str) -> str:
    indent = body[:len(body) - len(body.lstrip())]
    return f"{indent}with TALLY[{name!r}]:\n" + textwrap.indent(body, "    ")


def metered(body: str, after: str, out: str, memory: bool) -> tuple[str, str, str]:
    """A level's `run` pieces (its call's lines, its backward's lines, what it returns), as they are,
    or, when the script measures memory, the call and the backward each under its tally, and what the
    tallies keep: the forward's copies that did not outlive it (read right after it), and every
    buffer of the backward."""
    if not memory:
        return body, after, out
    return (_under("forward", body) + "\n    freed = " + FREED, "\n" + _under("backward", after.lstrip("\n")),
            '{"forward": freed, "backward": [(op, s) for op, s, _ in TALLY["backward"].whole]}')


def dtype(case: Any) -> str:
    return {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}[case.dtype]


def regime(case: Any, rows: str = "T") -> str:
    """The case's regime of `logits` (float64, [rows, V], drawn from `g`) in a line, as the harness
    draws it: a spike per row, huge values, ties, or -inf entries."""
    return {
        "peaked": f"logits[torch.arange({rows}), torch.randint(0, V, ({rows},), generator=g)] += 15  # one confident entry per row",
        "huge": "logits = (logits * 1e4).clamp(-3e4, 3e4)  # huge logits, finite in fp16",
        "ties": f"logits = torch.randint(0, 3, ({rows}, V), generator=g).double()  # ties",
        "neginf": f"logits[torch.rand({rows}, V, generator=g) < 0.3] = -math.inf  # entries masked to -inf",
    }.get(case.regime, "")


# How a tensor misses its float64 reference. The bound `tol`, a judge's: float32 rounding at the inputs'
# scale (64 units of 2**-24 times max|logit| + ln V; docs/tolerances.md derives the harness's own, per
# entry), plus the output dtype's own rounding of the answer.
WRONG = code('''
def off(got, want, tol):
    """The entries of `got` beyond `tol` of the float64 `want` (NaN included), and how they miss it."""
    got = got.detach().double().reshape(want.shape)
    bad = ~((got - want).abs() <= tol) & (got != want)
    m = lambda t: max(t[bad].abs().nan_to_num(math.inf).tolist(), default=0)  # noqa: E731
    return bad, f"max |value| {m(got):.3g} where {m(want):.3g} expected (max |error| {m(got - want):.3g}, bound {tol:.2g})"
''')

# Torch's own measure of a memory finding: every float32 tensor an op allocates (not a view of its
# inputs) with all of a rank's T x V_LOCAL logits entries, during the forward and the backward.
TALLY = code('''
class Tally(TorchDispatchMode):
    """The float32 tensors ops allocate (not views of their inputs) that hold all of a rank's T x V_LOCAL logits entries."""
    whole = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out, ins = func(*args, **(kwargs or {})), {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        self.whole += tuple((func.__name__, list(t.shape), weakref.ref(t.untyped_storage())) for t in tree_leaves(out) if torch.is_tensor(t)
                            and t.dtype == torch.float32 and {T, V_LOCAL} <= set(t.shape)EXEMPT and t.untyped_storage().data_ptr() not in ins)
        return out


TALLY = {"forward": Tally(), "backward": Tally()}


def judge(results):
    """NeMo-RL #2872: in chunks, no float32 copy of all the logits (forward) and no float32 gradient buffer (backward)."""
    for rank, r in enumerate(results):
        whole = f"all {T}x{V_LOCAL} {DTYPE} logits of rank {rank}, where chunk_size={CHUNK} asks for {CHUNK} rows at a time"
        if r["forward"]:
            yield f"rank {rank}'s forward makes a float32 copy of {whole}, and frees it: {r['forward']}"
        if r["backward"]:
            yield f"rank {rank}'s backward allocates a float32 buffer of {whole} (the gradient's dtype is {DTYPE}): {r['backward']}"
''')

FREED = '[(op, s) for op, s, ref in TALLY["forward"].whole if ref() is None]'
