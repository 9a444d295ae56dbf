"""The tolerance policy at the distillation level (docs/distill.md, "Tolerance"): the float32 error
bounds of `tolerance` carried through a log-softmax over any set of entries (the whole vocabulary,
or a top-k support renormalized over itself), a divergence summed over a support, and their
gradients, to first order, per entry. Nothing is tuned: each term is a rounding the contract's
arithmetic makes, weighed by the derivative that carries it to the output.

- A log-probability `z_v - lse` over a set of `n` entries is off by at most `tolerance`'s bound of a
  log-prob (the normaliser's error plus the subtraction's), `e_v`; with a temperature other than 1,
  `z = x / T` is rounded once more (`input_rounded`). Its probability is off by `r_v = e_v + (C_FN + 1) u`
  relative (the exponential, and the division where the routine divides).
- A divergence `D = Σ_v f(log p_s, log p_t)` is off by `Σ |∂f/∂log p_s| e_s + |∂f/∂log p_t| e_t` (first
  order, each entry's error on its own), plus each term's own evaluation (`K_EVAL` roundings of the
  largest quantities it touches) and the float32 sum of the terms over the support (growth `g`, the
  ranks' partial sums included).
- The gradient `a_u [u in S] - π_u Σ_S a` (a = ∂f/∂log p_s, π the distribution that normalised the
  log-probs) is off by the error of `a` (its own derivatives times the entries' errors, plus its
  evaluation), `π`'s relative error times `|Σ a|`, the sum's, and one rounding to the logits' dtype.
"""
from __future__ import annotations

import torch

from harness.checks.tolerance import C_FN, OUT_FLOOR, OUT_U, U32, _lse_err, growth, row_stats
from harness.reference import distill as ref

# Roundings in one divergence term or its derivative: two elementary functions (exp, log) within 2 ulp
# each, and up to six additions and products (jsd's mixture is the longest).
K_EVAL = 2 * C_FN + 6


def entry_bounds(z: torch.Tensor, tp: int, input_rounded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(e, p)` `[T, n]`: the allowed |error| of each log-probability `log_softmax(z)` over the row's
    `n` entries (0 at a -inf entry, which must be -inf exactly), and the float64 probabilities."""
    z = z.to(torch.float64)
    s = row_stats(z)
    _, d_lse = _lse_err(s, growth(z.shape[-1], tp))
    fin = s["fin"]
    zf = torch.where(fin, z, s["m"].unsqueeze(-1))
    e = d_lse.unsqueeze(-1) + 2 * U32 * ((zf - s["L"].unsqueeze(-1)).abs() + (s["m"].unsqueeze(-1) - zf).abs())
    if input_rounded:
        e = e + U32 * (zf.abs() + s["a1"].unsqueeze(-1))
    return torch.where(fin, e, torch.zeros_like(e)), s["p"]


def relative(e: torch.Tensor) -> torch.Tensor:
    """A probability's relative error from its log-probability's absolute one."""
    return e + (C_FN + 1) * U32


def _finite(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def term_derivatives(ls: torch.Tensor, lt: torch.Tensor, kind: str, beta: float) -> dict[str, torch.Tensor]:
    """Float64 per-entry quantities of the divergence's terms on the support: the terms `f`, their
    derivatives `a = ∂f/∂log p_s`, `b = ∂f/∂log p_t`, the derivatives of those w.r.t. the entry's own
    log-probs (`a_s`, `a_t`, `b_s`, `b_t`), and the magnitude `F` of what evaluating them touches."""
    ls = ls.detach().to(torch.float64).requires_grad_()
    lt = lt.detach().to(torch.float64).requires_grad_()
    f = ref.divergence_terms(ls, lt, kind, beta)
    a, b = torch.autograd.grad(f.sum(), (ls, lt), create_graph=True)
    a_s, a_t = torch.autograd.grad(a.sum(), (ls, lt), retain_graph=True, allow_unused=True)
    b_s, b_t = torch.autograd.grad(b.sum(), (ls, lt), allow_unused=True)
    s, t = ls.detach().exp(), lt.detach().exp()
    live = (s > 0) | (t > 0)
    mag = _finite(ls.detach()).abs() + _finite(lt.detach()).abs() + 1.0
    if kind == "jsd":
        m = beta * t + (1 - beta) * s
        mag = mag + torch.where(m > 0, m, torch.ones_like(m)).log().abs()
    out = {"f": f.detach(), "a": a.detach(), "b": b.detach(), "F": (s + t) * mag}
    for name, d in (("a_s", a_s), ("a_t", a_t), ("b_s", b_s), ("b_t", b_t)):
        out[name] = torch.zeros_like(s) if d is None else d.detach()
    return {k: torch.where(live, _finite(v), torch.zeros_like(v)) for k, v in out.items()}


def divergence_bound(d: dict[str, torch.Tensor], es: torch.Tensor, et: torch.Tensor, tp: int) -> torch.Tensor:
    """`[T]` allowed |error| of the divergence from its terms' derivatives `d` and the entries' errors."""
    g = growth(d["f"].shape[-1], tp)
    return ((d["a"].abs() * es + d["b"].abs() * et).sum(-1) + K_EVAL * U32 * d["F"].sum(-1)
            + g * U32 * d["f"].abs().sum(-1))


def derivative_error(d: dict[str, torch.Tensor], side: str, es: torch.Tensor, et: torch.Tensor) -> torch.Tensor:
    """The allowed |error| of `a` (side "a") or `b` (side "b") per entry of the support."""
    return d[f"{side}_s"].abs() * es + d[f"{side}_t"].abs() * et + K_EVAL * U32 * d["F"]


def softmax_grad_bound(a: torch.Tensor, da: torch.Tensor, ids: torch.Tensor, pi: torch.Tensor, r: torch.Tensor,
                       vocab: int, tp: int) -> torch.Tensor:
    """`[T, V]` allowed |error| of `grad_u = a_u [u in S] - π_u Σ_S a` in units of the scaled logits
    `z`: `a` `[T, K]` on the support `ids` with its error `da`, `π` `[T, V]` the distribution that
    normalised the log-probs (0 off the set it covers) with relative error `r` `[T, V]`."""
    T = a.shape[0]
    g = growth(a.shape[-1], tp)
    A = a.sum(-1, keepdim=True)
    on_support = torch.zeros((T, vocab), dtype=torch.float64).scatter_add_(-1, ids, da + U32 * a.abs())
    spread = r * A.abs() + da.sum(-1, keepdim=True) + (g + 2) * U32 * a.abs().sum(-1, keepdim=True)
    return on_support + pi * spread


def output_rounding(grad: torch.Tensor, bound: torch.Tensor, weights: torch.Tensor | None, dtype: str,
                    temperature: float = 1.0) -> torch.Tensor:
    """The bound of a gradient as the routine returns it: the float32 roundings of its last steps
    (the difference `a - π Σ a`, its product with the upstream gradient, the division by a temperature
    other than 1), one rounding to the logits' dtype, and the float32 and output underflow floors
    (as `tolerance.grad_bound`)."""
    w = 0.0 if weights is None else weights.to(torch.float64).abs().reshape(weights.shape[0], -1).sum(-1, keepdim=True)
    roundings = 2 + (temperature != 1.0)
    return bound + (roundings * U32 + OUT_U[dtype]) * grad.abs() + OUT_FLOOR["fp32"] * 64 * (1 + w) + OUT_FLOOR[dtype]
