"""Level-1 checks of `calculate_log_probs_and_entropy` against the float64 oracle; they hold for
the fused-linear level too (`calculate_linear_log_probs_and_entropy`, docs/fused-linear.md), whose
gradients are two: the hidden states' (the same full gradient on every rank) and the weight shard's.

Named for the level it checks, as `reference/kernel.py` computes that level and
`targets/mutants/kernel.py` breaks it: a level keeps one module name across the layers."""
from __future__ import annotations

from typing import Callable

import torch

from harness.cases.case import Case, KernelCase, LinearCase
from harness.checks import Evidence, check, distill
from harness.checks.terms import kernel_terms

TOKEN_LEVELS = ("kernel", "linear")
# The checks shared with the distillation level, whose cases `harness.checks.distill` judges.
SHARED = (*TOKEN_LEVELS, "distill")
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _grad_shapes(c: KernelCase | LinearCase) -> dict[str, tuple[tuple[int, ...], str]]:
    """What each rank's gradients must be: name -> (shape, what the dtype follows)."""
    if isinstance(c, LinearCase):
        return {"grad": ((c.v_local, c.H), "the weight's"), "grad_hidden": ((c.T, c.H), "the hidden states'")}
    return {"grad": ((c.T, c.v_local), "the logits'")}


def _nonempty(c: KernelCase, t) -> bool:
    return c.T > 0


@check("values", levels=SHARED, applies=_nonempty, needs="forward", terms=True)
def values(ev: Evidence) -> list[str]:
    """log-probs and entropy match the float64 oracle of the same input values, at float32 scale.
    Distillation level: each function's output, a top-k as any valid top-k (docs/distill.md)."""
    if ev.case.level == "distill":
        return distill.values(ev)
    problems = []
    for r in ev.ranks:  # every DP replica against the oracle of its own data
        exp = ev.expected_for(r)
        assert isinstance(exp.log_prob, torch.Tensor) and isinstance(exp.log_prob_tol, torch.Tensor)  # not per sample
        problems += ev.compare(r.obs.log_prob, exp.log_prob, exp.log_prob_tol, f"{r.name} log_prob")
        if isinstance(exp.entropy, torch.Tensor) and isinstance(exp.entropy_tol, torch.Tensor) \
                and r.obs.entropy is not None:
            problems += ev.compare(r.obs.entropy, exp.entropy, exp.entropy_tol, f"{r.name} entropy")
    return problems


def _gradient_terms(ev: Evidence, run: Callable[[Case], Evidence]) -> str:
    return "" if ev.case.level == "distill" else kernel_terms(ev, run, gradients)


@check("gradients", levels=SHARED, applies=lambda c, t: c.T > 0 and c.has_backward, reads=("autograd",),
       explain=_gradient_terms, terms=True)
def gradients(ev: Evidence) -> list[str]:
    """The local gradient is the local slice of the oracle's gradient of sum(w1*lp) + sum(w2*H);
    with two calls (accumulated microbatches, or two losses summed in one graph), the sum of both;
    with two calls on different inputs in one graph (two_inputs), each call's inputs get their own.
    Linear level: the weight shard's gradient is its slice of the full head's, and every rank's
    hidden-state gradient is the full one (all-reduced over the TP group); a frozen input gets None.
    In every TP group of the world, against the oracle of its DP replica's data.
    Distillation level: the student's (and a differentiable teacher's) shards (docs/distill.md)."""
    if ev.case.level == "distill":
        return distill.gradients(ev)
    problems = []
    for second in ((False, True) if ev.case.context == "two_inputs" else (False,)):
        for group in ev.groups():
            problems += _gradients(ev, group, second)
    return problems


def _gradients(ev: Evidence, group: list, second: bool) -> list[str]:
    exp, where = ev.expected_for(group[0], second), group[0].group_name
    call = (" (second call)" if second else "") + (f" ({where})" if where else "")
    grad = ev.full_grad(group, second)
    if ev.case.level != "linear":
        if grad is None:
            return [f"no gradient reached the logits{call} (log_prob is not differentiable)"]
        assert exp.grad is not None and exp.grad_tol is not None  # the check applies to cases with a backward
        return ev.compare(grad, exp.grad, exp.grad_tol, f"grad (all shards){call}")
    problems = []
    if exp.grad is not None and exp.grad_tol is not None:
        if grad is None:
            problems.append(f"no gradient reached the weight shard{call}")
        else:
            problems += ev.compare(grad, exp.grad, exp.grad_tol, f"weight grad (all shards){call}")
    if exp.grad_hidden is None or exp.grad_hidden_tol is None:
        return problems
    # Column-parallel: every rank must hold the full gradient of the replicated hidden states.
    for r in group:
        got = r.obs.grad_hidden_2 if second else r.obs.grad_hidden
        if got is None:
            problems.append(f"rank {r.rank}: no gradient reached the hidden states{call}")
        else:
            problems += ev.compare(got, exp.grad_hidden, exp.grad_hidden_tol, f"rank {r.rank} hidden grad{call}")
    return problems


@check("grad-flags", levels=SHARED, needs="forward", terms=True)
def grad_flags(ev: Evidence) -> list[str]:
    """entropy.requires_grad == with_entropy and with_entropy_grad and logits.requires_grad (linear
    level: the hidden states and weight require grad) (and
    autograd on: nothing carries a gradient under no_grad / inference_mode); entropy is None
    exactly when not requested; log_prob follows the logits.
    Distillation level: the output follows the differentiable inputs (docs/distill.md)."""
    if ev.case.level == "distill":
        return distill.grad_flags(ev)
    c = ev.case
    assert isinstance(c, (KernelCase, LinearCase))  # levels=TOKEN_LEVELS
    problems = []
    for r in ev.ranks:
        lp, ent = r.obs.log_prob_meta, r.obs.entropy_meta
        assert not isinstance(lp, list) and not isinstance(ent, list)  # one tensor each at these levels
        if lp and lp.requires_grad != c.grad_on:
            problems.append(f"rank {r.rank}: log_prob.requires_grad={lp.requires_grad}, "
                            f"inputs' requires_grad={c.requires_grad}, context {c.context}")
        if c.with_entropy and ent is None:
            problems.append(f"rank {r.rank}: with_entropy=True but entropy is None")
        if not c.with_entropy and ent is not None:
            problems.append(f"rank {r.rank}: with_entropy=False but an entropy tensor was returned")
        if ent is not None and c.with_entropy and ent.requires_grad != c.expects_entropy_grad:
            problems.append(
                f"rank {r.rank}: entropy.requires_grad={ent.requires_grad}, expected {c.expects_entropy_grad} "
                f"(with_entropy_grad={c.with_entropy_grad}, inputs' requires_grad={c.requires_grad}, "
                f"context {c.context})")
    return problems


@check("shapes-dtypes", levels=SHARED, needs="forward", terms=True)
def shapes_dtypes(ev: Evidence) -> list[str]:
    """T elements out, float32 out, the gradient in the logits' dtype and shape (linear level: the
    weight shard's and the hidden states' gradients in their dtype and shape).
    Distillation level: each function's shape, float32 out, int64 ids (docs/distill.md)."""
    if ev.case.level == "distill":
        return distill.shapes_dtypes(ev)
    c = ev.case
    assert isinstance(c, (KernelCase, LinearCase))  # levels=TOKEN_LEVELS
    want_grad_dtype = _DTYPE_NAMES[c.dtype]
    problems = []
    for r in ev.ranks:
        for key, meta in (("log_prob", r.obs.log_prob_meta), ("entropy", r.obs.entropy_meta)):
            if meta is None:
                continue
            assert not isinstance(meta, list)  # one tensor at these levels
            shape = meta.shape
            if meta.numel != c.T or len(shape) > 2 or (len(shape) == 2 and shape[1] != 1):
                problems.append(f"rank {r.rank}: {key} shape {list(shape)}, expected [{c.T}] or [{c.T}, 1]")
            if meta.dtype != "float32":
                problems.append(f"rank {r.rank}: {key} dtype {meta.dtype}, expected float32")
        for key, (shape, whose) in _grad_shapes(c).items():
            g = getattr(r.obs, f"{key}_meta")
            if g is None:
                continue
            if g.dtype != want_grad_dtype:
                problems.append(f"rank {r.rank}: {key} dtype {g.dtype}, expected {want_grad_dtype} ({whose} dtype)")
            if g.shape != shape:
                problems.append(f"rank {r.rank}: {key} shape {list(g.shape)}, expected {list(shape)}")
    return problems


@check("finite", levels=SHARED, applies=_nonempty, needs="forward", terms=True)
def finite(ev: Evidence) -> list[str]:
    """No NaN or inf where the oracle is finite (outputs and gradient).
    Distillation level: the output and the gradients (docs/distill.md)."""
    if ev.case.level == "distill":
        return distill.finite(ev)
    exp = ev.expected
    pairs = [("log_prob", ev.obs().log_prob, exp.log_prob), ("entropy", ev.obs().entropy, exp.entropy),
             ("grad", ev.full_grad(), exp.grad)]
    pairs += [(f"rank {r.rank} grad_hidden", r.obs.grad_hidden, exp.grad_hidden) for r in ev.ranks]
    problems = []
    for name, got, want in pairs:
        if not isinstance(got, torch.Tensor) or want is None or got.numel() != want.numel():
            continue
        bad = torch.isfinite(want) & ~torch.isfinite(got.reshape(want.shape).to(torch.float64))
        if bad.any():
            idx = bad.nonzero()[0].tolist()
            problems.append(f"{name}: {int(bad.sum())} non-finite entries where the oracle is finite, first at {idx}")
    return problems


def _outputs_match(ev: Evidence, other: Evidence, what: str) -> list[str]:
    exp = ev.expected
    problems = []
    # Both sides carry their own float32 error: twice the bound.
    for key, bound in (("log_prob", exp.log_prob_tol), ("entropy", exp.entropy_tol)):
        a, b = getattr(ev.obs(), key), getattr(other.obs(), key)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(bound, torch.Tensor) \
                and b.numel() == bound.numel():
            problems += ev.compare(a, b.to(torch.float64).reshape(bound.shape), 2 * bound, f"{key} vs {what}")
    pairs = [("grad", ev.full_grad(), other.full_grad(), exp.grad_tol),
             ("grad_hidden", ev.obs().grad_hidden, other.obs().grad_hidden, exp.grad_hidden_tol)]
    for key, ga, gb, bound in pairs:
        if ga is not None and gb is not None and bound is not None and gb.numel() == bound.numel():
            problems += ev.compare(ga, gb.to(torch.float64).reshape(bound.shape), 2 * bound, f"{key} vs {what}")
    return problems


@check("chunk-invariance", levels=SHARED,
       twin=lambda c: c.replace(chunk_size=-1) if c.chunk_size > 0 and c.T > 0 else None, terms=True)
def chunk_invariance(ev: Evidence) -> list[str]:
    """The same case unchunked gives the same answer within the tolerance.
    Distillation level: a top-k's log-probs, not its ids (docs/distill.md)."""
    if ev.case.level == "distill":
        return distill.outputs_match(ev, ev.twins["chunk-invariance"], "chunk_size=-1")
    return _outputs_match(ev, ev.twins["chunk-invariance"], "chunk_size=-1")


@check("tp-invariance", levels=SHARED, min_ranks=2,
       twin=lambda c: c.replace(tp=1, v_local=c.vocab) if c.T > 0 else None, terms=True)
def tp_invariance(ev: Evidence) -> list[str]:
    """The same global case at TP 1 gives the same answer within the tolerance.
    Distillation level: a top-k's log-probs, not its ids (docs/distill.md)."""
    if ev.case.level == "distill":
        return distill.outputs_match(ev, ev.twins["tp-invariance"], "TP 1")
    return _outputs_match(ev, ev.twins["tp-invariance"], "TP 1")
