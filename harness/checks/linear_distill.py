"""How the fused-linear distillation level (docs/linear-distill.md) is judged: its float64 oracle with
the allowed error of the loss and of every gradient entry (`linear_distill_expected`), and its judge of
the oracle checks (`values`, `gradients`, `grad-flags`, `shapes-dtypes`, `finite`).

The bound (docs/linear-distill.md, Tolerance), first order, nothing tuned:
- each logit carries its float32 matmul's error `gamma_H |h| |W|^T` (bf16 inputs are exact in float32,
  and so are their products), plus one rounding to the inputs' dtype (a head's logits come out in
  it), plus the division by a temperature other than 1;
- a log-probability over the vocabulary moves by its logit's error plus the probability-weighted
  mean of the row's (`d log p_v = dz_v - sum_u p_u dz_u`), on top of the distillation level's own
  bound of a float32 log-softmax (`distill_tolerance.entry_bounds`);
- the per-token divergence and its derivative carry those through the distillation level's
  `divergence_bound` and `softmax_grad_bound`; the cross-entropy term through its log-prob's;
- the sums over the valid tokens add their roundings (`growth`), the loss's mixture two more;
- the gradients `G W` and `G^T h` go through two float32 matmuls (over V, over T) and one rounding
  to the inputs' dtype, as the fused-linear level's (`tolerance.linear_bounds`).

Named for its level, as `levels/linear_distill.py` declares it and `cases/`, `reference/`, `engine/`,
`targets/fused_linear_distill.py` and `mutants/linear_distill.py` hold its parts."""
from __future__ import annotations

from typing import Any, cast

import torch

from harness.cases.linear_distill import IGNORE_INDEX, LinearDistillCase
from harness.checks import Evidence
from harness.checks import distill_tolerance as dt
from harness.checks.oracle import Expected, OneOutputJudge
from harness.checks.tolerance import OUT_FLOOR, OUT_U, U32, dot_growth, growth
from harness.reference import distill as dref
from harness.reference import linear_distill as ref

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def _case(ev: Evidence) -> LinearDistillCase:
    return cast(LinearDistillCase, ev.case)  # the judge judges this level's cases only


def _logit_error(h: torch.Tensor, W: torch.Tensor, dtype: str) -> torch.Tensor:
    """`[T, V]` allowed |error| of each logit of `h W^T` as a head computes it in `dtype`."""
    x = h @ W.T
    return U32 * dot_growth(h.shape[1]) * (h.abs() @ W.abs().T) + OUT_U[dtype] * x.abs()


def _log_prob_error(z: torch.Tensor, dz: torch.Tensor, input_rounded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(e, p)`: each log-prob of `log_softmax(z)` with `z` off by `dz`, and the probabilities."""
    e, p = dt.entry_bounds(z, 1, input_rounded)
    return e + dz + (p * dz).sum(-1, keepdim=True), p


def linear_distill_expected(case: LinearDistillCase) -> Expected:
    """The float64 oracle of the case's inputs (reference.linear_distill), with the bounds above."""
    inp = case.inputs()
    kw: dict[str, Any] = dict(kind=case.kind, beta=case.beta, temperature=case.temperature, ignore_index=IGNORE_INDEX,
                              hard_weight=case.hard_weight, soft_weight=case.soft_weight)
    value, gh, gw = ref.grads(inp.student_hidden, inp.student_weight, inp.teacher_hidden, inp.teacher_weight,
                              inp.labels, inp.weight, **kw)
    h, W = inp.student_hidden.to(torch.float64), inp.student_weight.to(torch.float64)
    s, t = ref.logits(inp.student_hidden, inp.student_weight, inp.teacher_hidden, inp.teacher_weight)
    Ds = _logit_error(h, W, case.dtype)
    Dt = torch.zeros_like(t) if inp.teacher_weight is None else \
        _logit_error(inp.teacher_hidden.to(torch.float64), inp.teacher_weight.to(torch.float64), case.dtype)
    tau = float(case.temperature)
    scaled = tau != 1.0
    zs, zt = dref.scaled(s, tau), dref.scaled(t, tau)
    es, ps = _log_prob_error(zs, Ds / tau + U32 * zs.abs() * scaled, scaled)
    et, _ = _log_prob_error(zt, Dt / tau + U32 * zt.abs() * scaled, scaled)
    keep = ref.valid(inp.labels, IGNORE_INDEX)
    n = max(int(keep.sum()), 1)
    soft, hard = ref.per_token(s, t, inp.labels, case.kind, case.beta, case.temperature, IGNORE_INDEX)
    T, V = s.shape
    d = dt.term_derivatives(zs.log_softmax(-1), zt.log_softmax(-1), case.kind, case.beta)
    soft_err = dt.divergence_bound(d, es, et, 1) * keep
    ids = torch.where(keep, inp.labels, torch.zeros_like(inp.labels)).to(torch.int64).unsqueeze(-1)
    eh, ph = _log_prob_error(s, Ds, False)
    hard_err = eh.gather(-1, ids).squeeze(-1) * keep
    g = growth(T, 1) * U32
    soft_tot = soft_err.sum() + g * soft.abs().sum()
    hard_tot = hard_err.sum() + g * hard.abs().sum()
    hw, sw = abs(case.hard_weight), abs(case.soft_weight)
    tol = (hw * hard_tot + sw * soft_tot) / n + 4 * U32 * (hw * hard.abs().sum() + sw * soft.abs().sum()) / n \
        + U32 * value.abs()
    # The gradient w.r.t. the student's logits, G = c_soft dsoft/ds + c_hard dhard/ds, and its error.
    w = abs(inp.weight)
    da = dt.derivative_error(d, "a", es, et)
    pi_r = dt.relative(es)
    full = torch.arange(V).expand(T, V)
    soft_g_err = dt.softmax_grad_bound(d["a"], da, full, ps, pi_r, V, 1) / tau
    onehot = torch.zeros_like(s).scatter_(-1, ids, 1.0)
    hard_g_err = ph * dt.relative(eh) + 2 * U32 * (ph + onehot)
    c = w / n * keep.unsqueeze(-1).to(torch.float64)
    G_abs = c * (sw * (d["a"] - ps * d["a"].sum(-1, keepdim=True)).abs() / tau + hw * (ph - onehot).abs())
    err_G = c * (sw * soft_g_err + hw * hard_g_err) + 3 * U32 * G_abs
    out_u = OUT_U[case.dtype]
    gh_tol = (err_G + (2 * out_u + U32 * dot_growth(V)) * G_abs) @ W.abs() + out_u * gh.abs() + OUT_FLOOR[case.dtype]
    gw_tol = (err_G + (out_u + U32 * dot_growth(T)) * G_abs).T @ h.abs() + out_u * gw.abs() + OUT_FLOOR[case.dtype]
    # Accumulating the head's gradient over chunks in its own dtype (a chunk's partial sum rounded
    # each time) is allowed one rounding per chunk of the partial sums' magnitude.
    chunks = 1 if case.chunk_size < 1 else -(-T // case.chunk_size)
    if chunks > 1 and out_u:
        gw_tol = gw_tol + chunks * out_u * (G_abs.T @ h.abs())
    return Expected(log_prob=value, entropy=None, grad=gw, entropy_requires_grad=False, log_prob_tol=tol,
                    entropy_tol=None, grad_tol=gw_tol, grad_hidden=gh, grad_hidden_tol=gh_tol)


# ------------------------------------------------------------------ the judge
def values(ev: Evidence) -> list[str]:
    """The loss against the float64 oracle."""
    c, exp = _case(ev), ev.expected
    assert isinstance(exp.log_prob, torch.Tensor) and isinstance(exp.log_prob_tol, torch.Tensor)
    return [p for r in ev.ranks
            for p in ev.compare(r.obs.log_prob, exp.log_prob, exp.log_prob_tol, f"{r.name} {c.kind} loss")]


def gradients(ev: Evidence) -> list[str]:
    """The gradients reaching the student's hidden states and its LM head."""
    exp = ev.expected
    problems = []
    for r in ev.ranks:
        for what, got, want, tol in (("student hidden states", r.obs.grad_hidden, exp.grad_hidden, exp.grad_hidden_tol),
                                     ("student LM head", r.obs.grad, exp.grad, exp.grad_tol)):
            assert want is not None and tol is not None
            if got is None:
                problems.append(f"{r.name}: no gradient reached the {what}")
            else:
                problems += ev.compare(got, want, tol, f"{r.name} grad of the {what}")
    return problems


def grad_flags(ev: Evidence) -> list[str]:
    """The loss requires grad (the student's inputs do)."""
    return [f"{r.name}: loss requires_grad=False, expected True (the student's hidden states and head require grad)"
            for r in ev.ranks
            if r.obs.log_prob_meta is not None and not isinstance(r.obs.log_prob_meta, list)
            and not r.obs.log_prob_meta.requires_grad]


def shapes_dtypes(ev: Evidence) -> list[str]:
    """A 0-dim float32 loss; each gradient in its input's shape and dtype."""
    c = _case(ev)
    dtype = _DTYPE_NAMES[c.dtype]
    problems = []
    for r in ev.ranks:
        meta = r.obs.log_prob_meta
        if meta is not None and not isinstance(meta, list) and (tuple(meta.shape) != () or meta.dtype != "float32"):
            problems.append(f"{r.name}: loss {meta.dtype}{list(meta.shape)}, expected a 0-dim float32")
        for what, g, shape in (("hidden states", r.obs.grad_hidden_meta, (c.T, c.H)),
                               ("LM head", r.obs.grad_meta, (c.v_local, c.H))):
            if g is not None and (g.dtype != dtype or tuple(g.shape) != shape):
                problems.append(f"{r.name}: grad of the student {what} {g.dtype}{list(g.shape)}, expected "
                                f"{dtype}{list(shape)}")
    return problems


def finite(ev: Evidence) -> list[str]:
    """No NaN or inf in the loss or the gradients (the oracle's are finite: no valid label gives 0)."""
    problems = []
    for r in ev.ranks:
        for name, got in (("loss", r.obs.log_prob), ("grad of the hidden states", r.obs.grad_hidden),
                          ("grad of the LM head", r.obs.grad)):
            if isinstance(got, torch.Tensor) and not torch.isfinite(got.to(torch.float64)).all():
                bad = int((~torch.isfinite(got.to(torch.float64))).sum())
                problems.append(f"{r.name} {name}: {bad} non-finite entr{'y' if bad == 1 else 'ies'}")
    return problems


def outputs_match(ev: Evidence, other: Evidence, what: str) -> list[str]:
    """The same case unchunked within twice the bound (both carry their error): the loss and both
    gradients; a NaN both ways agrees here (whether it should be there is `finite`'s)."""
    exp, mine, theirs = ev.expected, ev.ranks[0].obs, other.ranks[0].obs
    problems = []
    for who, a, b, bound in (("loss", mine.log_prob, theirs.log_prob, exp.log_prob_tol),
                             ("grad of the student hidden states", mine.grad_hidden, theirs.grad_hidden,
                              exp.grad_hidden_tol),
                             ("grad of the student LM head", mine.grad, theirs.grad, exp.grad_tol)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(bound, torch.Tensor) \
                and b.numel() == bound.numel():
            problems += ev.compare(a, b.to(torch.float64).reshape(bound.shape), 2 * bound, f"{who} vs {what}",
                                   equal_nan=True)
    return problems


LINEAR_DISTILL_JUDGE = OneOutputJudge(values, gradients, grad_flags, shapes_dtypes, finite, outputs_match)
