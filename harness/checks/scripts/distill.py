"""The distillation level's stand-alone scripts (`DISTILL_SCRIPT`): one rank's shard of the student's
(and the teacher's) logits handed to the case's function (`distill_divergence`, `distill_log_softmax`,
`distill_topk`, `distill_gather`), judged against `reference/distill.py`'s float64 answer, its
gradients by float64 autograd through it as the oracle takes them.

Named for its level, as `checks/distill.py` judges it and `reference/distill.py` is its oracle: a
level keeps one module name across the layers.
"""
from __future__ import annotations

from typing import Any

from harness.cases.case import DistillCase
from harness.checks.scripts import LevelScript
from harness.reference import distill as reference

DISTILL_CODE = '''
def run(routine, rank, group):
    """This rank's shard of the student's logits (a leaf that requires grad as the caller's does) and of
    a full or top-k teacher's, the teacher pass's top-k where the case hands it over; one call of the
    case's function, and the backward of sum(w * output) (this rank's columns of w for the sharded
    log-softmax)."""
    x = inputs(CASE)
    cols = slice(rank * CASE.v_local, (rank + 1) * CASE.v_local)
    student = x.student[:, cols].clone().requires_grad_(CASE.requires_grad)
    teacher = x.teacher[:, cols].clone().requires_grad_(CASE.teacher_grad)
    common = dict(temperature=CASE.temperature, chunk_size=CASE.chunk_size)
    ids = None
    with phase("forward"):
        if CASE.function == "log_softmax":
            out = routine(student, group, **common)
        elif CASE.function == "topk":
            out, ids = routine(student, CASE.k, group, **common)
        elif CASE.function == "gather":
            out = routine(student, x.topk_ids, group, renormalize=CASE.renormalize, **common)
        else:
            out = routine(student, group, teacher_logits=None if CASE.teacher == "given" else teacher,
                          teacher_topk_log_probs=x.topk_log_probs if CASE.teacher == "given" else None,
                          teacher_topk_indices=x.topk_ids if CASE.teacher == "given" else None,
                          k=CASE.k if CASE.teacher == "topk" else 0, kind=CASE.kind, beta=CASE.beta,
                          renormalize=CASE.renormalize, **common)
    w = x.weights[:, cols] if CASE.function == "log_softmax" else x.weights
    with phase("backward"):
        if torch.is_tensor(out) and out.requires_grad and out.numel() == w.numel():
            (out * w.to(out.dtype).reshape(out.shape)).nan_to_num(0.0, 0.0, 0.0).sum().backward()
    return {"out": detached(out), "ids": detached(ids), "grad": student.grad, "grad_teacher": teacher.grad}


def reference_output(student, teacher, x):
    """The function's float64 answer over the whole vocabulary (a top-k's: every log-prob, to judge
    any valid top-k)."""
    if CASE.function in ("log_softmax", "topk"):
        return log_softmax(student, CASE.temperature)
    if CASE.function == "gather":
        return gather(student, x.topk_ids, CASE.temperature, CASE.renormalize)
    given = CASE.teacher == "given"
    return divergence(student, None if given else teacher, x.topk_log_probs if given else None,
                      x.topk_ids if given else None, CASE.k if CASE.teacher == "topk" else 0, CASE.kind,
                      CASE.beta, CASE.temperature, CASE.renormalize)


def reference_grads(x):
    """The float64 gradients of sum(w * output) w.r.t. the student's and a differentiable teacher's
    logits, by autograd through the reference."""
    student = x.student.to(torch.float64).requires_grad_(CASE.grad_on)
    teacher = x.teacher.to(torch.float64).requires_grad_(CASE.teacher_grad_on)
    weighted = reference_output(student, teacher, x) * x.weights.to(torch.float64)
    loss = (weighted if CASE.function == "divergence" else weighted.nan_to_num(0.0, 0.0, 0.0)).sum()
    leaves = {key: t for key, t in (("grad", student), ("grad_teacher", teacher)) if t.requires_grad}
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def outputs(results, x):
    """(name, what a rank returned, the float64 answer, its bound) for every rank's output."""
    want = reference_output(x.student, x.teacher, x)
    cols = lambda rank: slice(rank * CASE.v_local, (rank + 1) * CASE.v_local)
    if CASE.function == "log_softmax":
        return [(f"rank {rank} log_softmax shard", r["out"], want[:, cols(rank)], OUT_TOL[:, cols(rank)])
                for rank, r in enumerate(results)]
    return [(f"rank {rank} {CASE.function}", r["out"], want, OUT_TOL) for rank, r in enumerate(results)]


def grads(results):
    """(name, the gradient gathered from every rank's shard or None, the float64 one) per logits asked."""
    want = reference_grads(inputs(CASE))
    gathered = lambda key: None if any(r[key] is None for r in results) else torch.cat([r[key] for r in results], -1)
    return [(who, gathered(key), want[key]) for key, who in (("grad", "student"), ("grad_teacher", "teacher"))
            if key in want]
'''

DISTILL_JUDGES = {"values": '''
def judge(results):
    """The function's output each rank returns, against the float64 answer of the same inputs: each
    rank's log-softmax shard, the gathered log-probs, the divergence, or a valid top-k."""
    x = inputs(CASE)
    if CASE.function == "topk":
        full = reference_output(x.student, x.teacher, x)
        return [p for rank, r in enumerate(results) for p in topk_problems(rank, r, results[0], full)]
    return [p for name, got, want, bound in outputs(results, x) for p in compare(got, want, bound, name)[0]]


def topk_problems(rank, r, first, full):
    """A valid top-k: distinct global ids in range, the same on every rank, none below an id left
    out and in descending order (within the bounds), its log-probs those of its ids."""
    ids, what = r["ids"], f"rank {rank} topk"
    if not torch.is_tensor(ids) or tuple(ids.shape) != (CASE.T, CASE.width) or ids.dtype != torch.int64:
        return [f"{what}: indices {getattr(ids, 'dtype', type(ids).__name__)}{list(getattr(ids, 'shape', []))}, "
                f"expected int64[{CASE.T}, {CASE.width}]"]
    if ids.numel() and (ids.min() < 0 or ids.max() >= CASE.vocab or (ids.sort(-1).values.diff(dim=-1) == 0).any()):
        return [f"{what}: ids repeat or leave [0, {CASE.vocab}): {ids.tolist()}"]
    problems = []
    if rank and not torch.equal(ids, first["ids"]):
        problems.append(f"{what}: ids differ from rank 0's (a replicated output is the same on every rank)")
    hi, lo = full + FULL_TOL, full - FULL_TOL
    chosen = torch.zeros_like(full, dtype=torch.bool).scatter_(-1, ids, True)
    left_out = (hi.gather(-1, ids).amin(-1) < lo.masked_fill(chosen, -math.inf).amax(-1)).nonzero()
    if left_out.numel():
        row = int(left_out[0])
        problems.append(f"{what}: not a top-{CASE.width} in row {row}: ids {ids[row].tolist()} leave out id "
                        f"{int(lo[row].masked_fill(chosen[row], -math.inf).argmax())}, above a selected one")
    unordered = (hi.gather(-1, ids)[:, :-1] < lo.gather(-1, ids)[:, 1:]).any(-1).nonzero()
    if unordered.numel():
        problems.append(f"{what}: row {int(unordered[0])} not in descending order")
    at_ids = compare(r["out"], full.gather(-1, ids), FULL_TOL.gather(-1, ids), f"{what} log_probs at its ids")
    return problems + at_ids[0]
''', "gradients": '''
def judge(results):
    """The gradient w.r.t. the student's logits (and a differentiable teacher's), gathered from every
    rank's shard, against the float64 gradient of sum(w * output) through the reference."""
    problems = []
    for who, got, want in grads(results):
        bound = GRAD_TOL if who == "student" else GRAD_TEACHER_TOL
        if got is None:
            problems.append(f"no gradient reached the {who}'s logits")
            continue
        problems += compare(got, want, bound, f"{who} grad (all shards)")[0]
        if problems and TP > 1:
            problems.append(f"outside the bound in the {who}'s shards of rank(s) {off_ranks(got, want, bound)}")
    return problems


def off_ranks(got, want, bound):
    """The ranks whose vocab shard holds an entry outside its bound."""
    b = bound.clamp_min(1e-300)
    outside = ~torch.isclose(got.to(torch.float64) / b, want / b, rtol=0.0, atol=1.0)
    return sorted({int(i) // CASE.v_local for i in outside.nonzero()[:, -1].tolist()})
''', "finite": '''
def judge(results):
    """NaN or inf in the output or the gradients where the float64 answer is finite."""
    x = inputs(CASE)
    pairs = [] if CASE.function == "topk" else [(name, got, want) for name, got, want, _ in outputs(results, x)]
    if CASE.has_backward:
        pairs += [(f"{who} grad (all shards)", got, want) for who, got, want in grads(results)]
    return [p for name, got, want in pairs for p in nonfinite(name, got, want)]
'''}


def refuse(case: Any) -> str | None:
    if case.layout != "contiguous":
        return "scripts hand over the student's logits contiguous (layout at its default)"
    return None


DISTILL_SCRIPT = LevelScript(
    # Not memory-logits-dtype: a log-softmax's output is a float32 [T, V_local] by contract, and the
    # gradient of the loss w.r.t. it too, which a tally of the backward cannot tell from the routine's.
    checks=("values", "gradients", "finite", "crash", "empty-input"),
    code=DISTILL_CODE,
    judges=DISTILL_JUDGES,
    uses={"inputs": DistillCase.inputs, "log_softmax": reference.log_softmax, "gather": reference.gather,
          "divergence": reference.divergence},
    bounds={"OUT_TOL": "log_prob_tol", "FULL_TOL": "full_log_probs_tol", "GRAD_TOL": "grad_tol",
            "GRAD_TEACHER_TOL": "grad_teacher_tol"},
    refuse=refuse,
)
