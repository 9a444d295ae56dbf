"""How the distillation level (docs/distill.md) is judged. The level has the oracle checks
(`values`, `gradients`, `grad-flags`, `shapes-dtypes`, `finite`, `chunk-invariance`, `tp-invariance`:
`harness.checks.outputs` asks this level's `DISTILL_JUDGE`) and two of its own:
`divergence-self-zero` (KL(p, p) = 0, no oracle needed) and `memory-no-vocab-gather`.

Named for its level, as `reference/distill.py` is its oracle, `targets/mutants/distill.py` breaks
it and `levels/distill.py` declares it: a level keeps one module name across the layers."""
from __future__ import annotations

import math
from typing import Any, cast

import torch

from harness.cases.case import DistillCase
from harness.checks import Evidence, check
from harness.checks.oracle import DistillExpected, OneOutputJudge
from harness.engine.calls import laid_out
from harness.engine.observations import RankResult

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _case(ev: Evidence) -> DistillCase:
    return cast(DistillCase, ev.case)  # the checks here apply to this level's cases only


def _expected(ev: Evidence, r: RankResult) -> DistillExpected:
    exp = ev.expected_for(r)
    assert isinstance(exp, DistillExpected)
    return exp


def _shard(c: DistillCase, t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[..., rank * c.v_local:(rank + 1) * c.v_local]


def _out_shape(c: DistillCase) -> tuple[int, ...]:
    return {"log_softmax": (c.T, c.v_local), "topk": (c.T, c.width), "gather": (c.T, c.width)}.get(c.function, (c.T,))


# ------------------------------------------------------------------ values
def values(ev: Evidence) -> list[str]:
    """The function's output against the float64 oracle of the same inputs, at float32 scale: each
    rank's log-softmax shard; the top-k as any valid top-k (distinct ids in range, the same on every
    rank, every selected entry at least every unselected one and in descending order, each within
    the bound, and its log-probs those of its ids); the gathered log-probs and the divergence."""
    c = _case(ev)
    problems = []
    for group in ev.groups():
        for r in group:
            exp = _expected(ev, r)
            assert isinstance(exp.log_prob, torch.Tensor) and isinstance(exp.log_prob_tol, torch.Tensor)
            if c.function == "log_softmax":
                problems += ev.compare(r.obs.log_prob, _shard(c, exp.log_prob, r.rank), _shard(c, exp.log_prob_tol, r.rank),
                                       f"{r.name} log_softmax shard")
            elif c.function == "topk":
                problems += _topk(ev, r, group[0], exp)
            else:
                problems += ev.compare(r.obs.log_prob, exp.log_prob, exp.log_prob_tol, f"{r.name} {c.function}")
    return problems


def _topk(ev: Evidence, r: RankResult, first: RankResult, exp: DistillExpected) -> list[str]:
    c = _case(ev)
    ids, got = r.obs.indices, r.obs.log_prob
    what = f"{r.name} topk"
    if not isinstance(ids, torch.Tensor) or not isinstance(got, torch.Tensor):
        return [f"{what}: expected (log_probs, indices) tensors, got {type(got).__name__}, {type(ids).__name__}"]
    if tuple(ids.shape) != (c.T, c.width) or ids.dtype != torch.int64:
        return [f"{what}: indices {ids.dtype}{list(ids.shape)}, expected int64[{c.T}, {c.width}]"]
    if ids.numel() and (ids.min() < 0 or ids.max() >= c.vocab):
        return [f"{what}: a global id outside [0, {c.vocab}): {ids.min().item()}..{ids.max().item()}"]
    if ids.numel() and (ids.sort(-1).values.diff(dim=-1) == 0).any():
        row = int((ids.sort(-1).values.diff(dim=-1) == 0).any(-1).nonzero()[0])
        return [f"{what}: row {row} repeats an id: {ids[row].tolist()}"]
    problems = []
    if r is not first and isinstance(first.obs.indices, torch.Tensor) and not torch.equal(ids, first.obs.indices):
        row = int((ids != first.obs.indices).any(-1).nonzero()[0])
        problems.append(f"{what}: ids differ from {first.name}'s, first in row {row}: {ids[row].tolist()} vs "
                        f"{first.obs.indices[row].tolist()} (a replicated output must be the same on every rank)")
    full, tol = exp.full_log_probs, exp.full_log_probs_tol
    assert full is not None and tol is not None
    hi, lo = full + tol, full - tol  # each entry's interval
    chosen = torch.zeros_like(full, dtype=torch.bool).scatter_(-1, ids, True)
    weakest = hi.gather(-1, ids).amin(-1) if c.width else hi.new_zeros(c.T)
    strongest = lo.masked_fill(chosen, -math.inf).amax(-1)
    bad = weakest < strongest
    if bad.any():
        row = int(bad.nonzero()[0])
        u = int(lo[row].masked_fill(chosen[row], -math.inf).argmax())
        problems.append(f"{what}: not a top-{c.width} in row {row}: ids {ids[row].tolist()} leave out id {u} "
                        f"(log-prob {full[row, u].item():.9g}) above a selected one "
                        f"({full[row].gather(-1, ids[row]).min().item():.9g}); {int(bad.sum())} row(s)")
    order = hi.gather(-1, ids)[:, :-1] < lo.gather(-1, ids)[:, 1:]
    if order.any():
        row = int(order.any(-1).nonzero()[0])
        problems.append(f"{what}: row {row} not in descending order: ids {ids[row].tolist()}, log-probs "
                        f"{[round(v, 6) for v in full[row].gather(-1, ids[row]).tolist()]}")
    return problems + ev.compare(got, full.gather(-1, ids), tol.gather(-1, ids), f"{what} log_probs at its ids")


# ------------------------------------------------------------------ gradients
def _teacher_grad(group: list[RankResult]) -> torch.Tensor | None:
    shards = [r.obs.grad_teacher for r in group]
    return None if any(s is None for s in shards) else torch.cat([s for s in shards if s is not None], dim=-1)


def gradients(ev: Evidence) -> list[str]:
    """The gradient w.r.t. each rank's student shard (and a differentiable teacher's) is its slice of
    the oracle's gradient of the loss: the same Σ w·out on every rank for a replicated output, the
    sum of the ranks' weighed shards for the log-softmax. In every TP group of the world."""
    problems = []
    for group in ev.groups():
        exp, where = _expected(ev, group[0]), group[0].group_name
        suffix = f" ({where})" if where else ""
        for who, want, bound, got in (
                ("student", exp.grad, exp.grad_tol, ev.full_grad(group)),
                ("teacher", exp.grad_teacher, exp.grad_teacher_tol, _teacher_grad(group))):
            if want is None or bound is None:
                continue
            if got is None:
                problems.append(f"no gradient reached the {who}'s logits{suffix}")
            else:
                problems += ev.compare(got, want, bound, f"{who} grad (all shards){suffix}")
    return problems


# ------------------------------------------------------------------ flags, shapes, finiteness
def grad_flags(ev: Evidence) -> list[str]:
    """The output's requires_grad follows the differentiable inputs (the student's logits, a
    differentiable teacher's) and autograd's mode; the top-k (the teacher's pass) carries none."""
    c = _case(ev)
    want = (c.grad_on or c.teacher_grad_on) and c.function != "topk"
    problems = []
    for r in ev.ranks:
        meta = r.obs.log_prob_meta
        if meta is not None and not isinstance(meta, list) and meta.requires_grad != want:
            problems.append(f"{r.name}: output requires_grad={meta.requires_grad}, expected {want} (student "
                            f"requires_grad={c.requires_grad}, teacher_grad={c.teacher_grad}, context {c.context})")
    return problems


def shapes_dtypes(ev: Evidence) -> list[str]:
    """The output's shape (the log-softmax `[T, V_local]`, the top-k's and the gather's `[T, min(k, V)]`,
    the divergence `[T]`), float32 out, int64 ids, gradients in the logits' dtype and shape."""
    c = _case(ev)
    problems = []
    for r in ev.ranks:
        meta = r.obs.log_prob_meta
        if meta is not None and not isinstance(meta, list):
            if meta.shape != _out_shape(c):
                problems.append(f"{r.name}: {c.function} output shape {list(meta.shape)}, expected {list(_out_shape(c))}")
            if meta.dtype != "float32":
                problems.append(f"{r.name}: {c.function} output dtype {meta.dtype}, expected float32")
        ids = r.obs.indices_meta
        if c.function == "topk" and ids is not None and ids.dtype != "int64":
            problems.append(f"{r.name}: topk indices dtype {ids.dtype}, expected int64")
        g = r.obs.grad_meta
        if g is not None:
            if g.dtype != _DTYPE_NAMES[c.dtype]:
                problems.append(f"{r.name}: grad dtype {g.dtype}, expected {_DTYPE_NAMES[c.dtype]} (the logits')")
            if g.shape != (c.T, c.v_local):
                problems.append(f"{r.name}: grad shape {list(g.shape)}, expected {[c.T, c.v_local]}")
    return problems


def finite(ev: Evidence) -> list[str]:
    """No NaN or inf where the oracle is finite (output and gradients)."""
    c = _case(ev)
    problems = []
    for group in ev.groups():
        exp = _expected(ev, group[0])
        pairs: list[tuple[str, Any, Any]] = [("student grad", ev.full_grad(group), exp.grad),
                                             ("teacher grad", _teacher_grad(group), exp.grad_teacher)]
        for r in group:
            want = exp.log_prob
            if c.function == "log_softmax" and isinstance(want, torch.Tensor):
                want = _shard(c, want, r.rank)
            if c.function != "topk":
                pairs.append((f"{r.name} {c.function}", r.obs.log_prob, want))
        for name, got, want in pairs:
            if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or got.numel() != want.numel():
                continue
            bad = torch.isfinite(want) & ~torch.isfinite(got.reshape(want.shape).to(torch.float64))
            if bad.any():
                problems.append(f"{name}: {int(bad.sum())} non-finite entries where the oracle is finite, "
                                f"first at {bad.nonzero()[0].tolist()}")
    return problems


# ------------------------------------------------------------------ invariances
def _whole(ev: Evidence, group: list[RankResult]) -> Any:
    """The output as one tensor: the log-softmax's shards side by side, the top-k's log-probs (its
    ids may differ under ties), any other output as every rank returned it."""
    c = _case(ev)
    if c.function == "log_softmax":
        shards = [r.obs.log_prob for r in group]
        return torch.cat(shards, dim=-1) if all(isinstance(s, torch.Tensor) for s in shards) else None  # type: ignore[arg-type]
    return group[0].obs.log_prob


def outputs_match(ev: Evidence, other: Evidence, what: str) -> list[str]:
    """The same case another way (unchunked, TP 1) within twice the bound: both carry their error; a
    NaN both ways agrees here (whether it should be there is `finite`'s)."""
    exp = ev.expected
    assert isinstance(exp, DistillExpected) and isinstance(exp.log_prob_tol, torch.Tensor)
    problems = []
    a, b = _whole(ev, ev.groups()[0]), _whole(other, other.groups()[0])
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.numel() == exp.log_prob_tol.numel():
        problems += ev.compare(a, b.to(torch.float64).reshape(exp.log_prob_tol.shape), 2 * exp.log_prob_tol,
                               f"output vs {what}", equal_nan=True)
    for who, ga, gb, bound in (("student grad", ev.full_grad(), other.full_grad(), exp.grad_tol),
                               ("teacher grad", _teacher_grad(ev.groups()[0]), _teacher_grad(other.groups()[0]),
                                exp.grad_teacher_tol)):
        if ga is not None and gb is not None and bound is not None and gb.numel() == bound.numel():
            problems += ev.compare(ga, gb.to(torch.float64).reshape(bound.shape), 2 * bound, f"{who} vs {what}",
                                   equal_nan=True)
    return problems


DISTILL_JUDGE = OneOutputJudge(values, gradients, grad_flags, shapes_dtypes, finite, outputs_match)


# ------------------------------------------------------------------ the level's own checks
@check("divergence-self-zero", evidence=("divergence",), needs="forward",
       applies=lambda c, t: c.T > 0 and c.function == "divergence" and c.self_teacher)
def self_zero(ev: Evidence) -> list[str]:
    """KL(p, p) = 0: with the teacher's logits equal to the student's, every divergence but the soft
    cross-entropy is 0, whatever the support, temperature or mask, within the float32 bound of its
    terms (given top-k log-probs are the teacher pass's float32 ones: their rounding may move the
    oracle off 0, and is allowed too); and where the student's distribution is the divergence's own
    (the whole vocabulary, or a renormalized support) its gradient is 0 as well."""
    c = _case(ev)
    problems = []
    for r in ev.ranks:
        exp = _expected(ev, r)
        assert isinstance(exp.log_prob, torch.Tensor) and isinstance(exp.log_prob_tol, torch.Tensor)
        problems += ev.compare(r.obs.log_prob, torch.zeros_like(exp.log_prob), exp.log_prob_tol + exp.log_prob.abs(),
                               f"{r.name} divergence of the student from itself")
    grad, exp = ev.full_grad(), ev.expected
    if grad is not None and exp.grad is not None and exp.grad_tol is not None \
            and (c.teacher == "full" or c.renormalize):
        problems += ev.compare(grad, torch.zeros_like(exp.grad), exp.grad_tol + exp.grad.abs(),
                               "its gradient (all shards)")
    return problems


def _chunk_rows(c: Any) -> int:
    """The rows a call works on at once: its chunk's, or all of them."""
    return min(c.T, c.chunk_size) if c.chunk_size > 0 else c.T


def _caller_buffer(c: DistillCase) -> list[int] | None:
    """The shape of the caller's buffer the student's logits are a view of (their gradient lands in
    it, through the view's backward), or None for logits handed over as they are."""
    if c.layout in ("contiguous", "nonleaf"):
        return None
    return list(laid_out(torch.empty(c.T, c.v_local, device="meta"), c.layout, False)[0].shape)


def _gathered(c: DistillCase, t: dict) -> bool:
    """A storage that only an all-gather of the shards makes: `>= V` columns in its last dimension
    over `>=` a chunk's rows in the others. Not a vector over the rows, alone (`[T]`) or stacked
    (`[2, T]`: its last dimension is the rows', whatever V is), and not the caller's own buffer."""
    shape = t["shape"]
    return (len(shape) >= 2 and shape[-1] >= c.vocab and math.prod(shape[:-1]) >= _chunk_rows(c)
            and shape[-1] not in (c.T, _chunk_rows(c)) and shape != _caller_buffer(c))


@check("memory-no-vocab-gather", evidence=("divergence", "memory"), min_ranks=2, reads=("memory",), needs="forward",
       applies=lambda c, t: c.T > 0 and c.width < c.v_local)
def no_vocab_gather(ev: Evidence) -> list[str]:
    """No full-vocabulary gather: at TP > 1 no storage the call allocates or keeps, forward or
    backward, spans the whole vocabulary's width for a chunk's rows (`>= V` columns in its last
    dimension over `>=` a chunk's rows in the others, which only an all-gather of the shards makes;
    every legitimate buffer is a shard's `V_local` columns, a top-k's `k`, or a vector over the rows).
    A vector over the rows whose length reaches V (`[T]`, or stacked `[2, T]`), and the caller's own
    buffer of a strided view of the logits (which the view's backward fills), are no gather."""
    c = _case(ev)
    problems = []
    for r in ev.ranks:
        mem = r.obs.memory
        for meter in ("retained", "peak_forward", "peak_backward"):
            big = [t for t in mem.get(f"{meter}_tensors", []) if _gathered(c, t)]
            if big:
                t = big[0]
                problems.append(f"{r.name}: {meter} holds {t['dtype']}{t['shape']} ({t['how']}, from {t['op']}): "
                                f"the whole vocabulary's {c.vocab} columns for {_chunk_rows(c)} rows, a "
                                f"full-vocabulary gather")
    return problems
