"""What a case should produce: the float64 oracle run once per case in the main process, with the
allowed error of every value and gradient entry (`tolerance`, derived in docs/tolerances.md).

Tolerances are float32-scale whatever the input dtype, since the contract makes the math float32:
the bf16/fp16 logits are upcast exactly, and only the gradient, returned in the logits' dtype, may
carry one more rounding to that dtype.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from harness import reference
from harness.base import levels
from harness.cases.case import Case, DistillCase, KernelCase, LinearCase, WrapperCase
from harness.checks.distill_tolerance import (
    derivative_error,
    divergence_bound,
    entry_bounds,
    output_rounding,
    relative,
    softmax_grad_bound,
    term_derivatives,
)
from harness.checks.tolerance import Rows, grad_bound, linear_bounds, value_bounds
from harness.reference import distill as ref
from harness.reference.cp import PAD, local_rows, response_positions

PerSample = list[torch.Tensor]


@dataclass(frozen=True)
class Expected:
    log_prob: torch.Tensor | PerSample  # kernel: [T]; wrapper: per-sample [R_i]
    entropy: torch.Tensor | PerSample | None
    grad: torch.Tensor | None  # full [T, V] float64; linear level: the full weight's [V, H]
    entropy_requires_grad: bool
    log_prob_tol: torch.Tensor | PerSample  # the allowed |error|, shaped like the values
    entropy_tol: torch.Tensor | PerSample | None
    grad_tol: torch.Tensor | None  # shaped like grad
    grad_hidden: torch.Tensor | None = None  # linear level: [T, H], what every TP rank must hold
    grad_hidden_tol: torch.Tensor | None = None


def _no_twin(ev: Any, other: Any, what: str) -> list[str]:
    return []


@dataclass(frozen=True)
class OneOutputJudge:
    """The oracle checks' judging at a level of one output (`harness.checks.outputs` asks `Level.judge`):
    its functions, each `(Evidence) -> problems`; `outputs_match(ev, other, what)` compares a case with
    its twin (none where the level's cases have no twin); no loss terms to tell apart."""
    values: Any
    gradients: Any
    grad_flags: Any
    shapes_dtypes: Any
    finite: Any
    outputs_match: Any = _no_twin

    def gradient_terms(self, ev: Any, related: Any) -> str:
        return ""


@functools.lru_cache(maxsize=256)
def expected(case: Case) -> Expected:
    """The case's level's oracle (`Level.expected`), once per case."""
    return levels.of(case).expected(case)


@functools.lru_cache(maxsize=512)
def expected_on(case: Case, cp_rank: int = 0) -> Expected:
    """What CP rank `cp_rank` of a case must hold (`Level.oracle_on`): at CP 1, the oracle itself."""
    return levels.of(case).oracle_on(case, cp_rank)


def wrapper_on(case: WrapperCase, cp_rank: int = 0) -> Expected:
    """What CP rank `cp_rank` of a wrapper case must hold, derived from the whole sequence's oracle:
    per sample, the values at its response positions (reference.cp), and the gradient on its own
    local rows (0 on padding rows)."""
    full = expected(case)
    if case.cp == 1:
        return full
    positions = [torch.tensor(response_positions(L, R, case.cp, cp_rank), dtype=torch.int64)
                 for L, R in zip(case.total_lengths, case.response_lengths, strict=True)]
    at = lambda values: [v[p] for v, p in zip(values, positions, strict=True)]  # noqa: E731
    pick = lambda values: None if values is None else at(values)  # noqa: E731
    rows = torch.tensor(local_rows(list(case.total_lengths), case.cp, case.cp_layout, cp_rank), dtype=torch.int64)
    real = rows != PAD

    def local(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        out = t.new_zeros((rows.numel(), t.shape[-1]))
        out[real] = t[rows[real]]
        return out
    return Expected(log_prob=at(full.log_prob), entropy=pick(full.entropy), grad=local(full.grad),
                    entropy_requires_grad=full.entropy_requires_grad, log_prob_tol=at(full.log_prob_tol),
                    entropy_tol=pick(full.entropy_tol), grad_tol=local(full.grad_tol))


def _abs_sum(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The weight that bounds the error of two calls' summed gradients (one call: its own)."""
    return a if a is None or b is None else a.abs() + b.abs()


def kernel_expected(case: KernelCase) -> Expected:
    inp = case.inputs()
    x = inp.logits.to(torch.float64)
    stats = Rows(x, inp.tokens, inp.keep_mask)  # shared by the values' and the gradient's bounds
    grad = grad_tol = None
    w_lp, w_ent = inp.total_weights()  # two calls into one gradient: the gradient is linear in the weights
    w2 = w_ent if case.expects_entropy_grad else None
    if case.grad_on:
        grad = reference.logits_grad(x, inp.tokens, inp.keep_mask, w_lp, w2)
        # The error of two calls' summed gradients is bounded by the sum of their weights' sizes.
        w1_abs = _abs_sum(inp.w_log_prob, inp.w_log_prob_2)
        w2_abs = _abs_sum(inp.w_entropy, inp.w_entropy_2) if w2 is not None else None
        rounded = grad.abs()
        if inp.w_log_prob_2 is not None or inp.w_entropy_2 is not None:
            # Each call's gradient is rounded to the logits' dtype before the two are summed in it:
            # three roundings, of |g1|, |g2| and |g1 + g2|, which can be far larger than the sum.
            for w_lp_i, w_ent_i in ((inp.w_log_prob, inp.w_entropy), (inp.w_log_prob_2, inp.w_entropy_2)):
                rounded = rounded + reference.logits_grad(x, inp.tokens, inp.keep_mask, w_lp_i,
                                                          w_ent_i if w2 is not None else None).abs()
        grad_tol = grad_bound(x, inp.tokens, inp.keep_mask, w1_abs, w2_abs, tp=case.tp, dtype=case.dtype,
                              grad=rounded, rows=stats)
    lp_tol, ent_tol = value_bounds(x, inp.tokens, inp.keep_mask, tp=case.tp, rows=stats)
    return Expected(
        log_prob=reference.log_probs(x, inp.tokens, inp.keep_mask),
        entropy=reference.entropy(x) if case.with_entropy else None,
        grad=grad, entropy_requires_grad=case.expects_entropy_grad,
        log_prob_tol=lp_tol, entropy_tol=ent_tol if case.with_entropy else None, grad_tol=grad_tol,
    )


def linear_expected(case: LinearCase) -> Expected:
    inp = case.inputs()
    w1 = inp.w_log_prob
    w2 = inp.w_entropy if case.expects_entropy_grad else None
    grads = reference.linear_grads(inp.hidden, inp.weight, inp.tokens, w1, w2) if case.grad_on else None
    tol = linear_bounds(inp.hidden, inp.weight, inp.tokens, w1, w2, tp=case.tp, dtype=case.dtype) \
        if case.grad_on else linear_bounds(inp.hidden, inp.weight, inp.tokens, None, None, tp=case.tp)
    # A frozen input gets no gradient: None expected (the other is unchanged: dh does not depend on
    # whether dW is asked for, nor the reverse).
    want_w, want_h = grads is not None and case.weight_grad, grads is not None and case.hidden_grad
    return Expected(
        log_prob=reference.linear_log_probs(inp.hidden, inp.weight, inp.tokens),
        entropy=reference.linear_entropy(inp.hidden, inp.weight) if case.with_entropy else None,
        grad=grads[1] if grads is not None and want_w else None, entropy_requires_grad=case.expects_entropy_grad,
        log_prob_tol=tol["log_prob"], entropy_tol=tol["entropy"] if case.with_entropy else None,
        grad_tol=tol.get("grad_weight") if want_w else None, grad_hidden=grads[0] if grads is not None and want_h else None,
        grad_hidden_tol=tol.get("grad_hidden") if want_h else None,
    )


def _per_sample(values: torch.Tensor, rows: list[torch.Tensor]) -> PerSample:
    return [values[r] for r in rows]


def wrapper_expected(case: WrapperCase) -> Expected:
    inp = case.inputs()
    args = case.args()
    lengths, responses = list(case.total_lengths), list(case.response_lengths)
    common: dict[str, Any] = dict(unconcat_tokens=inp.unconcat_tokens, total_lengths=lengths, response_lengths=responses,
                                  with_entropy=case.with_entropy, top_p_token_ids=inp.top_p_token_ids,
                                  top_p_token_offsets=inp.top_p_token_offsets)
    out = reference.wrapper_outputs(inp.logits, args, **common)
    w_lp, w_ent = inp.total_weights()  # two calls into one gradient: the gradient is linear in the weights
    w2 = w_ent if out["entropy_requires_grad"] else None
    grad = reference.wrapper_logits_grad(inp.logits, args, w_log_probs=w_lp, w_entropy=w2, **common) \
        if case.grad_on else None
    rounded = grad
    if inp.w_log_probs_2 is not None:  # the error bound of two summed gradients
        assert inp.w_entropy_2 is not None  # the second call's weights come as a pair
        if grad is not None and case.dtype != "fp32":
            # As at the kernel: each call's gradient is rounded to the bf16/fp16 logits' dtype before
            # the two are summed in it (float32 logits carry no rounding there).
            rounded = grad.abs() + sum(reference.wrapper_logits_grad(
                inp.logits, args, w_log_probs=a, w_entropy=b if w2 is not None else None, **common).abs()
                for a, b in ((inp.w_log_probs, inp.w_entropy), (inp.w_log_probs_2, inp.w_entropy_2)))
        w_lp = [a.abs() + b.abs() for a, b in zip(inp.w_log_probs, inp.w_log_probs_2, strict=True)]
        w2 = ([a.abs() + b.abs() for a, b in zip(inp.w_entropy, inp.w_entropy_2, strict=True)]
              if w2 is not None else None)
    # The bounds are those of the kernel on the rows the wrapper hands it: the logits divided by the
    # temperature (one more float32 rounding of the input when it is not 1), shifted targets, the
    # replayed keep mask, and the response weights; the chain rule through 1/t scales the gradient.
    t = case.temperature if case.temperature is not None else 1.0
    z = reference.apply_temperature(inp.logits, t)
    tokens = reference.shifted_targets(inp.unconcat_tokens, lengths)
    rows = reference.response_rows(lengths, responses)
    mask = reference.top_p_keep_mask(case.T, case.vocab, lengths, responses, inp.top_p_token_ids,
                                     inp.top_p_token_offsets)
    divided = t != 1.0
    stats = Rows(z, tokens, mask)  # shared by the values' and the gradient's bounds
    lp_tol, ent_tol = value_bounds(z, tokens, mask, tp=case.tp, input_rounded=divided, rows=stats)
    grad_tol = None
    if grad is not None:
        assert rounded is not None  # with the gradient
        w1_rows = _scatter(w_lp, rows, case.T)
        w2_rows = _scatter(w2, rows, case.T) if w2 is not None else None
        grad_tol = grad_bound(z, tokens, mask, w1_rows, w2_rows, tp=case.tp, dtype=case.dtype, input_rounded=divided,
                              grad=rounded * t, rows=stats) / abs(t)
    return Expected(
        log_prob=out["log_probs"], entropy=out["entropy"], grad=grad,
        entropy_requires_grad=out["entropy_requires_grad"],
        log_prob_tol=_per_sample(lp_tol, rows),
        entropy_tol=_per_sample(ent_tol, rows) if case.with_entropy else None, grad_tol=grad_tol,
    )


def _scatter(per_sample: PerSample, rows: list[torch.Tensor], T: int) -> torch.Tensor:
    """Per-sample response weights as one [T] vector, 0 on the rows outside every response."""
    w = torch.zeros(T, dtype=torch.float64)
    for values, r in zip(per_sample, rows, strict=True):
        w[r] = values.to(torch.float64)
    return w


# The distillation level (docs/distill.md): the float64 oracle of `reference.distill` on the whole
# vocabulary, gradients by float64 autograd through it, bounds from `distill_tolerance`.
@dataclass(frozen=True)
class DistillExpected(Expected):
    """`log_prob` holds the function's output (the log-softmax `[T, V]`, the top-k log-probs `[T, k']`
    at the oracle's ids, the gathered `[T, K]`, the divergence `[T]`) and `log_prob_tol` its bound."""
    grad_teacher: torch.Tensor | None = None  # [T, V]: a differentiable teacher's gradient
    grad_teacher_tol: torch.Tensor | None = None
    full_log_probs: torch.Tensor | None = None  # [T, V]: the whole vocabulary's, to judge any top-k
    full_log_probs_tol: torch.Tensor | None = None


def _on_vocab(values: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros((ids.shape[0], vocab), dtype=torch.float64).scatter_add_(-1, ids, values)


def _grad(case: DistillCase, loss_of, *leaves: torch.Tensor) -> list[torch.Tensor | None]:
    """Float64 autograd of the case's loss w.r.t. the leaves that require grad."""
    wanted = [x for x in leaves if x.requires_grad]
    if not wanted:
        return [None] * len(leaves)
    grads = iter(torch.autograd.grad(loss_of(), wanted))
    return [next(grads) if x.requires_grad else None for x in leaves]


def distill_expected(case: DistillCase) -> DistillExpected:
    inp = case.inputs()
    T, V, tp, temp = case.T, case.vocab, case.tp, case.temperature
    rounded = temp != 1.0
    xs = inp.student.to(torch.float64).requires_grad_(case.grad_on and case.function != "topk")
    xt = inp.teacher.to(torch.float64).requires_grad_(case.teacher_grad_on)
    w = inp.weights.to(torch.float64)
    zs = ref.scaled(inp.student, temp)
    e_full, p_full = entry_bounds(zs, tp, rounded)
    lp_full = zs.log_softmax(-1)
    extra: dict = {}
    grad_s = grad_s_tol = grad_t = grad_t_tol = None

    if case.function == "log_softmax":
        values, tol = lp_full, e_full
        if xs.requires_grad:
            (grad_s,) = _grad(case, lambda: (ref.log_softmax(xs, temp) * w).nan_to_num(0.0, 0.0, 0.0).sum(), xs)
            ids = torch.arange(V).expand(T, V)
            grad_s_tol = softmax_grad_bound(w, torch.zeros_like(w), ids, p_full, relative(e_full), V, tp)
    elif case.function == "topk":
        values, ids = ref.topk(inp.student, case.k, temp)
        tol = e_full.gather(-1, ids)
        extra = dict(full_log_probs=lp_full, full_log_probs_tol=e_full)
    elif case.function == "gather":
        ids = inp.topk_ids
        values = ref.gather(inp.student, ids, temp, case.renormalize)
        if case.renormalize:
            tol, q = entry_bounds(zs.gather(-1, ids), tp, rounded)
            pi, r = _on_vocab(q, ids, V), _on_vocab(relative(tol), ids, V)
        else:
            tol, pi, r = e_full.gather(-1, ids), p_full, relative(e_full)
        if xs.requires_grad:
            (grad_s,) = _grad(case, lambda: (ref.gather(xs, ids, temp, case.renormalize) * w)
                              .nan_to_num(0.0, 0.0, 0.0).sum(), xs)
            grad_s_tol = softmax_grad_bound(w, torch.zeros_like(w), ids, pi, r, V, tp)
    else:
        teacher = None if case.teacher == "given" else xt
        given_lp = inp.topk_log_probs if case.teacher == "given" else None
        given_ids = inp.topk_ids if case.teacher == "given" else None
        k = case.k if case.teacher == "topk" else 0
        ids = ref.support(teacher, given_ids, k, V, T, temp)
        whole = case.teacher == "full"

        def divergence(s: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
            return ref.divergence(s, t, given_lp, given_ids, k, case.kind, case.beta, temp, case.renormalize)

        values = divergence(xs, teacher).detach()
        ls, lt = ref.support_log_probs(inp.student, inp.teacher if teacher is not None else None, given_lp, ids,
                                       temp, case.renormalize or whole)
        zt = ref.scaled(inp.teacher, temp)
        et_full, pt_full = entry_bounds(zt, tp, rounded)
        if whole or not case.renormalize:
            es, ps, rs = e_full.gather(-1, ids), p_full, relative(e_full)
            et, pt, rt = ((et_full.gather(-1, ids), pt_full, relative(et_full)) if teacher is not None else
                          (torch.zeros_like(ls), None, None))
        else:
            es, qs = entry_bounds(zs.gather(-1, ids), tp, rounded)
            ps, rs = _on_vocab(qs, ids, V), _on_vocab(relative(es), ids, V)
            t_values = zt.gather(-1, ids) if teacher is not None else inp.topk_log_probs.to(torch.float64) / temp
            et, qt = entry_bounds(t_values, tp, rounded)
            pt, rt = _on_vocab(qt, ids, V), _on_vocab(relative(et), ids, V)
        d = term_derivatives(ls, lt, case.kind, case.beta)
        tol = divergence_bound(d, es, et, tp)
        wl = w.unsqueeze(-1)
        if case.has_backward:
            grad_s, grad_t = _grad(case, lambda: (divergence(xs, teacher) * w).sum(), xs, xt)
            if grad_s is not None:
                grad_s_tol = softmax_grad_bound(d["a"], derivative_error(d, "a", es, et), ids, ps, rs, V, tp) * wl.abs()
            if grad_t is not None and pt is not None and rt is not None:
                grad_t_tol = softmax_grad_bound(d["b"], derivative_error(d, "b", es, et), ids, pt, rt, V, tp) * wl.abs()
        if grad_t is not None and grad_t_tol is not None:
            extra.update(grad_teacher=grad_t, grad_teacher_tol=output_rounding(grad_t, grad_t_tol / temp, w, case.dtype, temp))
    if grad_s is not None and grad_s_tol is not None:
        grad_s_tol = output_rounding(grad_s, grad_s_tol / temp, w, case.dtype, temp)
    return DistillExpected(log_prob=values.detach(), entropy=None, grad=grad_s, entropy_requires_grad=False,
                           log_prob_tol=tol, entropy_tol=None, grad_tol=grad_s_tol, **extra)
