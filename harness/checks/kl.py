"""How the KL-estimator level (docs/kl.md) is judged: its float64 oracle with the allowed error of
every entry (`kl_expected`), and its judge of the oracle checks (`values`, `gradients`, `grad-flags`,
`shapes-dtypes`, `finite`; `harness.checks.outputs` asks `KL_JUDGE`).

The bound (docs/kl.md, Tolerance): the routine's arithmetic is float32 on the log-probs' own values
(bf16 log-probs are upcast exactly), so the oracle is the float64 math of the same input values and
the bound is a few float32 roundings of each quantity the estimator goes through, at its magnitude:
with `x` the (clamped) log-ratio and `E = exp(-x)`,

    k1: |x|      k2: x^2      k3: E (|x| + C_FN + 2) + 2 (1 + |x|)

per token (the subtraction's rounding `u |x|` carried through the estimator: `x^2` for k2, `E |x|`
through k3's exponential; exp's own `C_FN` ulps; the roundings of the sums), times `K = 4` units of
float32 roundoff `u`. A reduction adds its summation's roundings, `2 T u sum |v|` (any order), and the
mean's division. The gradient's scale is the derivative's (k1: 1, k2: |x|, k3: E (|x| + C_FN + 1) + 1)
times the upstream weight, plus one rounding to the log-probs' dtype (bf16: `OUT_U`).

Named for its level, as `levels/kl.py` declares it and `cases/kl.py`, `reference/kl.py`, `engine/kl.py`,
`checks/kl.py` and `mutants/kl.py` hold its parts: a level keeps one module name across the layers."""
from __future__ import annotations

from typing import cast

import torch

from harness.cases.kl import KLCase
from harness.checks import Evidence
from harness.checks.oracle import Expected, OneOutputJudge
from harness.checks.tolerance import C_FN, OUT_U, U32
from harness.reference import kl as ref

K = 4.0  # roundings of each quantity's magnitude allowed
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def _case(ev: Evidence) -> KLCase:
    return cast(KLCase, ev.case)  # the judge judges this level's cases only


def _scales(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The magnitudes whose float32 roundings bound a token's value and its derivative."""
    ax = x.abs()
    if kind == "k1":
        return ax, torch.ones_like(x)
    if kind == "k2":
        return x * x, ax
    e = torch.exp(-x)
    return e * (ax + C_FN + 2) + 2 * (1 + ax), e * (ax + C_FN + 1) + 1


def kl_expected(case: KLCase) -> Expected:
    """The float64 oracle of the case's inputs (reference.kl), with the bounds of docs/kl.md."""
    inp = case.inputs()
    a, b = inp.log_probs.to(torch.float64), inp.ref_log_probs.to(torch.float64)
    out = ref.kl_estimate(a, b, case.kind, inp.mask, case.reduction, case.clamp)
    x = ref.log_ratio(a, b, case.clamp)
    keep = ref.valid(inp.mask, case.T)
    value_scale, grad_scale = _scales(x, case.kind)
    token_tol = K * U32 * value_scale * keep
    per_token = ref.kl_estimate(a, b, case.kind, inp.mask, "none", case.clamp)
    n = max(int(keep.sum()), 1)
    if case.reduction == "none":
        tol = token_tol
    else:
        total = token_tol.sum() + 2 * case.T * U32 * per_token.abs().sum()
        tol = total if case.reduction == "sum" else total / n + 2 * U32 * out.abs()
    grad = grad_tol = None
    if case.grad_on:
        grad = ref.grad_log_probs(a, b, inp.weight, case.kind, inp.mask, case.reduction, case.clamp)
        w = inp.weight.to(torch.float64).abs() * keep
        if case.reduction == "token_mean":
            w = w / n
        out_u = OUT_U[case.dtype]
        grad_tol = K * U32 * w * grad_scale * (1 + out_u) + out_u * grad.abs()
    return Expected(log_prob=out, entropy=None, grad=grad, entropy_requires_grad=False, log_prob_tol=tol,
                    entropy_tol=None, grad_tol=grad_tol)


# ------------------------------------------------------------------ the judge
def values(ev: Evidence) -> list[str]:
    """The estimate (per token, or its masked sum or mean) against the float64 oracle."""
    c, exp = _case(ev), ev.expected
    assert isinstance(exp.log_prob, torch.Tensor) and isinstance(exp.log_prob_tol, torch.Tensor)
    return [p for r in ev.ranks
            for p in ev.compare(r.obs.log_prob, exp.log_prob, exp.log_prob_tol, f"{r.name} {c.kind} {c.reduction}")]


def gradients(ev: Evidence) -> list[str]:
    """The gradient reaching the policy's log-probs: the estimator's derivative at the clamped
    log-ratio, 0 where the clamp holds it or the token is masked, times the upstream weight (over
    the valid tokens' count for the token mean)."""
    exp = ev.expected
    if exp.grad is None or exp.grad_tol is None:
        return []
    problems = []
    for r in ev.ranks:
        if r.obs.grad is None:
            problems.append(f"{r.name}: no gradient reached the policy's log-probs")
        else:
            problems += ev.compare(r.obs.grad, exp.grad, exp.grad_tol, f"{r.name} grad of the policy's log-probs")
    return problems


def grad_flags(ev: Evidence) -> list[str]:
    """The estimate requires grad exactly when the policy's log-probs do and autograd is on."""
    c = _case(ev)
    problems = []
    for r in ev.ranks:
        meta = r.obs.log_prob_meta
        if meta is not None and not isinstance(meta, list) and meta.requires_grad != c.grad_on:
            problems.append(f"{r.name}: estimate requires_grad={meta.requires_grad}, expected {c.grad_on} (policy "
                            f"requires_grad={c.requires_grad}, context {c.context})")
    return problems


def shapes_dtypes(ev: Evidence) -> list[str]:
    """`[T]` for reduction "none", a 0-dim scalar otherwise, float32 whatever the inputs' dtype; the
    gradient in the policy's log-probs' dtype and shape."""
    c = _case(ev)
    want = (c.T,) if c.reduction == "none" else ()
    problems = []
    for r in ev.ranks:
        meta = r.obs.log_prob_meta
        if meta is not None and not isinstance(meta, list):
            if tuple(meta.shape) != want:
                problems.append(f"{r.name}: {c.reduction} estimate shape {list(meta.shape)}, expected {list(want)}")
            if meta.dtype != "float32":
                problems.append(f"{r.name}: estimate dtype {meta.dtype}, expected float32")
        g = r.obs.grad_meta
        if g is not None:
            if g.dtype != _DTYPE_NAMES[c.dtype] or tuple(g.shape) != (c.T,):
                problems.append(f"{r.name}: grad {g.dtype}{list(g.shape)}, expected {_DTYPE_NAMES[c.dtype]}[{c.T}] "
                                f"(the policy's log-probs')")
    return problems


def finite(ev: Evidence) -> list[str]:
    """No NaN or inf where the oracle is finite (the estimate and the gradient)."""
    exp = ev.expected
    problems = []
    for r in ev.ranks:
        for name, got, want in (("estimate", r.obs.log_prob, exp.log_prob), ("grad", r.obs.grad, exp.grad)):
            if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or got.numel() != want.numel():
                continue
            bad = torch.isfinite(want) & ~torch.isfinite(got.reshape(want.shape).to(torch.float64))
            if bad.any():
                problems.append(f"{r.name} {name}: {int(bad.sum())} non-finite entries where the oracle is finite"
                                + (f", first at {bad.nonzero()[0].tolist()}" if bad.dim() else ""))
    return problems


KL_JUDGE = OneOutputJudge(values, gradients, grad_flags, shapes_dtypes, finite)
