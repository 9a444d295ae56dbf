"""The tolerance policy: a first-order float32 rounding-error bound, per row for the values and per
element for the gradient, computed from the float64 row itself (derivation: docs/tolerances.md).

It holds for any float32 algorithm in a stated class: shifted or unshifted softmax, sequential,
pairwise or blocked sums with sequential chains of at most CHAIN roundings combined in any order
(every order at all below V = CHAIN / 2), online softmax over vocab blocks, recompute in backward,
all-gather plus torch.log_softmax. It grows with the vocab size, the logits' magnitudes and the
entropy, not with a tuned constant; math in bf16 or a gradient rounded to bf16 exceed it by far
(the `low-precision-math` and `gradient-quantized-bf16` mutants). `linear_bounds` extends it to the
fused-linear level: the float32 matmuls over H (forward) and over V and T (backward).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

from harness.checks.problems import Problem

U32 = 2.0 ** -24
C_FN = 4.0  # exp / log within 2 ulp: 4 u relative (glibc, Sleef u10, CUDA expf/logf, Triton tl.exp)
CHAIN = 1024  # the longest sequential accumulation chain assumed, in roundings (docs/tolerances.md, A2)
OUT_U = {"fp32": 0.0, "bf16": 2.0 ** -7, "fp16": 2.0 ** -10}  # one ulp: the gradient cast to the logits' dtype, in any rounding mode
OUT_FLOOR = {"fp32": 2.0 ** -126, "bf16": 2.0 ** -126, "fp16": 2.0 ** -24}  # flush-to-zero / subnormal floor


def depth(vocab: int, tp: int, chain: int | None = CHAIN) -> int:
    """Roundings on the path of one term through a vocab sum (S, W or sum p x), adds and rescales.

    chain=None: any order at all, e.g. strictly sequential over the whole (gathered) vocab with an
    online-softmax rescale at every element: D = 2V.  chain=c: sequential chains of at most c
    roundings (a per-thread / per-block loop), whose ceil(V/c) results and the tp ranks are then
    combined in any order with <= 2 roundings (add + rescale) per step."""
    vocab, tp = max(int(vocab), 1), max(int(tp), 1)
    if chain is None:
        return 2 * vocab
    return min(2 * vocab, int(chain) + 2 * math.ceil(vocab / int(chain)) + 2 * tp)


def growth(vocab: int, tp: int, chain: int | None = CHAIN) -> float:
    """Summation growth factor g = gamma_D / u = D / (1 - D u): the relative error of a float32 sum
    of same-sign terms is at most g*u (Higham, Accuracy and Stability, 4.2)."""
    d = depth(vocab, tp, chain)
    return d / (1.0 - d * U32)


def _mask(x: torch.Tensor, tokens: torch.Tensor, keep_mask: torch.Tensor | None) -> torch.Tensor:
    if keep_mask is None:
        return x
    keep = keep_mask.to(torch.bool, copy=True)
    keep[torch.arange(x.shape[0]), tokens.long()] = True
    return x.masked_fill(~keep, float("-inf"))


def row_stats(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 per-row quantities over the finite entries of x [T, V] (-inf = absent)."""
    x = x.to(torch.float64)
    fin = torch.isfinite(x)
    n = fin.sum(-1).clamp_min(1).to(torch.float64)
    m = torch.where(fin, x, torch.full_like(x, -math.inf)).max(-1).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    L = torch.logsumexp(torch.where(fin, x, torch.full_like(x, -math.inf)), -1)
    L = torch.where(torch.isfinite(L), L, torch.zeros_like(L))
    xs = torch.where(fin, x, m.unsqueeze(-1))                  # finite stand-in, weight 0 below
    ell = xs - L.unsqueeze(-1)                                 # log p
    p = torch.where(fin, ell.exp(), torch.zeros_like(x))
    gap = m.unsqueeze(-1) - xs                                 # m - x >= 0
    H = -(p * ell).sum(-1)
    E = lambda t: (p * t).sum(-1)                              # noqa: E731
    return dict(n=n, m=m, L=L, H=H, p=p, ell=ell, gap=gap, fin=fin,
                A=torch.where(fin, x.abs(), torch.zeros_like(x)).max(-1).values,
                G1=E(gap), G2=E(gap * gap), a1=E(xs.abs()), X=E(xs.abs() * gap),
                Q=E((ell.abs() + 1) * (gap + ell.abs())),
                XH=E(xs.abs() * (ell + H.unsqueeze(-1)).abs()))


class Rows:
    """The row statistics of one input, masked and unmasked, computed once for every bound that
    reads them (an oracle run asks for the values' and the gradient's bounds of the same rows)."""

    def __init__(self, x: torch.Tensor, tokens: torch.Tensor, keep_mask: torch.Tensor | None):
        self.x, self.tokens, self.keep_mask = x.to(torch.float64), tokens.long(), keep_mask

    @functools.cached_property
    def unmasked(self) -> dict[str, torch.Tensor]:
        return row_stats(self.x)

    @functools.cached_property
    def masked(self) -> dict[str, torch.Tensor]:
        return self.unmasked if self.keep_mask is None else row_stats(_mask(self.x, self.tokens, self.keep_mask))


def _lse_err(s: dict, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(relative error of the softmax normaliser S, absolute error of lse), in units of 1."""
    eps_s = U32 * (g + 2 * C_FN + 2 + s["G1"])
    d_lse = eps_s + U32 * (C_FN + 1) * (s["L"].abs() + s["n"].log())
    return eps_s, d_lse


def _entropy_bound(s: dict, g: float) -> torch.Tensor:
    eps_s, d_lse = _lse_err(s, g)
    lnn = s["n"].log()
    # (a) shifted: H = log S - W/S, W = sum e (x - m)
    shifted = eps_s * (1 + s["G1"]) + U32 * (C_FN * lnn + s["G1"] * (g + C_FN + 3) + s["G2"] + s["H"])
    # (b) lse - sum(p x), p = e/S normalised (softmax), lse possibly from another pass
    unshifted = d_lse + eps_s * s["a1"] + U32 * (s["X"] + (g + C_FN + 2) * s["a1"] + s["H"])
    # (c) log_softmax then -sum(exp(l) l)
    d_logs = eps_s + U32 * C_FN * lnn
    logsm = d_logs * (s["H"] + 1) + U32 * (s["Q"] + (g + C_FN + 1) * s["H"])
    return torch.maximum(torch.maximum(shifted, unshifted), logsm)


def _input_rounding_values(s: dict, xt: torch.Tensor | None) -> torch.Tensor:
    """Extra error when the routine rounds its inputs once (x/temperature in float32)."""
    return U32 * ((xt.abs() if xt is not None else 0) + s["a1"])


def value_bounds(x, tokens, keep_mask=None, tp: int = 1, chain: int | None = CHAIN,
                 input_rounded: bool = False, rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Allowed |error| per row of (log_prob [T], entropy [T]) for a float32 routine. `rows`: the
    statistics of (x, tokens, keep_mask) when the caller has them already."""
    rows = rows or Rows(x, tokens, keep_mask)
    x, tokens = rows.x, rows.tokens
    g = growth(x.shape[-1], tp, chain)
    sm = rows.masked
    xt = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    _, d_lse_m = _lse_err(sm, g)
    lp = d_lse_m + 2 * U32 * ((xt - sm["L"]).abs() + (sm["m"] - xt).abs())
    s = rows.unmasked
    ent = _entropy_bound(s, g)
    if input_rounded:
        lp = lp + _input_rounding_values(sm, xt)
        ent = ent + U32 * s["XH"]
    return lp, ent


def grad_bound(x, tokens, keep_mask, w1, w2, tp: int = 1, dtype: str = "fp32", chain: int | None = CHAIN,
               input_rounded: bool = False, grad: torch.Tensor | None = None, rows: Rows | None = None
               ) -> torch.Tensor:
    """Allowed |error| per element [T, V] of the gradient of sum(w1 lp) + sum(w2 H).

    w1 / w2: [T] upstream weights or None (term absent).  dtype: the logits' (= gradient's) dtype.
    grad: the float64 oracle gradient (recomputed when None), or the sum of the magnitudes of every
    gradient that is rounded to `dtype` on the way (two calls summed in the logits' dtype).
    `rows`: the statistics of (x, tokens, keep_mask) when the caller has them already."""
    rows = rows or Rows(x, tokens, keep_mask)
    x, tokens = rows.x, rows.tokens
    T, V = x.shape
    g = growth(V, tp, chain)
    bound = torch.zeros_like(x)
    gexact = torch.zeros_like(x)
    _, ent_b = value_bounds(x, tokens, None, tp, chain, rows=rows)  # the entropy's bound: never masked
    if w1 is not None:
        sm = rows.masked
        _, d_lse = _lse_err(sm, g)
        q = sm["p"]
        r = d_lse.unsqueeze(-1) + U32 * (sm["ell"].abs() + sm["gap"] + C_FN + 1)   # rel. error of q_i
        onehot = torch.zeros_like(x)
        onehot[torch.arange(T), tokens] = 1.0
        a1 = w1.to(torch.float64).abs().unsqueeze(-1)
        term = q * r + 2 * U32 * (onehot - q).abs()
        if input_rounded:
            term = term + U32 * q * (torch.where(sm["fin"], x.abs(), torch.zeros_like(x)) + sm["a1"].unsqueeze(-1))
        bound += a1 * term
        gexact += w1.to(torch.float64).unsqueeze(-1) * (onehot - q)
    if w2 is not None:
        s = rows.unmasked
        _, d_lse = _lse_err(s, g)
        p, ell, H = s["p"], s["ell"], s["H"].unsqueeze(-1)
        r = d_lse.unsqueeze(-1) + U32 * (ell.abs() + s["gap"] + C_FN + 1)
        d_ell = d_lse.unsqueeze(-1) + U32 * (2 * ell.abs() + s["gap"])
        core = (ell + H).abs()
        term = p * ((r + 2 * U32) * core + d_ell + ent_b.unsqueeze(-1)
                    + 2 * U32 * (ell.abs() + H + 2))
        if input_rounded:
            xa = torch.where(s["fin"], x.abs(), torch.zeros_like(x))
            term = term + U32 * p * ((xa + s["a1"].unsqueeze(-1)) * (core + 1) + s["XH"].unsqueeze(-1))
        bound += w2.to(torch.float64).abs().unsqueeze(-1) * term
        gexact += w2.to(torch.float64).unsqueeze(-1) * torch.where(p > 0, -p * (ell + H), torch.zeros_like(p))
    if grad is None:
        grad = gexact
    wsum = (w1.abs() if w1 is not None else 0) + (w2.abs() if w2 is not None else 0)
    wsum = torch.as_tensor(wsum, dtype=torch.float64).reshape(-1, 1) if not isinstance(wsum, int) else 0.0
    floor = OUT_FLOOR["fp32"] * 64 * (1 + wsum)  # float32 underflow of q, p
    return bound + (U32 + OUT_U[dtype]) * grad.abs() + floor + OUT_FLOOR[dtype]


def compare(actual: Any, expected: torch.Tensor, bound: torch.Tensor, what: str,
            output: str = "", equal_nan: bool = False) -> tuple[list[str], float | None]:
    """|actual - expected| <= bound elementwise. torch.testing.assert_close decides, on both sides
    divided by the bound (an absolute difference of at most 1 passes; matching infinities pass, NaN
    fails); the message is the harness's own, in the quantity's units: the worst element first
    (actual, expected, |error| > bound), then how many elements are outside their bound.
    Returns (problems, the worst error/bound over the entries finite on both sides, or None); each
    problem is about `output` (`checks.problems`) and carries its worst entry. `equal_nan`: NaN on
    both sides agrees (two runs of one routine compared: a NaN both give is `finite`'s to report)."""
    if not isinstance(actual, torch.Tensor):
        return [Problem(f"{what}: expected a tensor, got {type(actual).__name__}", output)], None
    a = actual.detach().to(torch.float64)
    if a.numel() != expected.numel():
        return [Problem(f"{what}: {a.numel()} elements, expected {expected.numel()}", output)], None
    a = a.reshape(expected.shape)
    b = bound.to(torch.float64).reshape(bound.shape + (1,) * (expected.dim() - bound.dim())).expand_as(expected)
    b = b.clamp_min(1e-300)
    both = torch.isfinite(a) & torch.isfinite(expected)
    ratio = (a - expected).abs() / b
    worst = ratio[both].max().item() if both.any() else None
    try:
        torch.testing.assert_close(a / b, expected / b, atol=1.0, rtol=0.0, check_dtype=False, equal_nan=equal_nan)
    except AssertionError:
        return [_mismatch(what, a, expected, b, ratio, both, output, equal_nan)], worst
    return [], worst


def _mismatch(what: str, a: torch.Tensor, expected: torch.Tensor, b: torch.Tensor, ratio: torch.Tensor,
              both: torch.Tensor, output: str, equal_nan: bool) -> Problem:
    """The failure message of `compare`: the worst element, then the count outside the bound (the
    elements torch.isclose, which assert_close applies, finds apart)."""
    outside = ~torch.isclose(a / b, expected / b, rtol=0.0, atol=1.0, equal_nan=equal_nan)
    finite_out = outside & both
    if finite_out.any():
        i = tuple(int(k) for k in (ratio.masked_fill(~finite_out, -1) == ratio[finite_out].max()).nonzero()[0])
        head = (f"worst at {list(i)}: actual {a[i].item():.9g}, expected {expected[i].item():.9g}, "
                f"|error| {abs(a[i] - expected[i]).item():.3g} > bound {b[i].item():.3g}")
    else:  # only non-finite mismatches: a NaN, or an infinity where the other side differs
        i = tuple(int(k) for k in outside.nonzero()[0]) if outside.any() else ()
        head = (f"not finite at {list(i)}: actual {a[i].item():.9g}, expected {expected[i].item():.9g}" if i
                else "outside the bound")
    n, total = int(outside.sum()), outside.numel()
    text = f"{what}: {head}; {n} of {total} element(s) outside the bound ({100.0 * n / max(total, 1):.3g}%)"
    if not i:
        return Problem(text, output)
    return Problem(text, output, index=i, actual=float(a[i].item()), expected=float(expected[i].item()),
                   bound=float(b[i].item()))


def dot_growth(n: int) -> float:
    """gamma_n / u for a float32 dot product of n terms, in any order and blocking, products included
    (Higham, Accuracy and Stability, 3.5): |fl(a . b) - a . b| <= gamma_n |a| . |b|."""
    n = max(int(n), 1)
    return n / (1.0 - n * U32)


def linear_bounds(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, w1: torch.Tensor | None,
                  w2: torch.Tensor | None, tp: int = 1, dtype: str = "fp32") -> dict[str, torch.Tensor]:
    """Allowed |error| of a float32 fused-linear routine (docs/tolerances.md, "The fused-linear
    level"): "log_prob" and "entropy" per row [T], "grad_hidden" [T, H] and "grad_weight" [V, H]
    (the full head, every shard in rank order), for the loss sum(w1 lp) + sum(w2 H).

    First order: the logits x = h W^T carry the float32 matmul's error D = gamma_H |h| |W|^T (bf16 and
    fp16 inputs are exact in float32 and their products too), which moves the values and the logit
    gradient G through their first derivatives; the kernel's own bounds are added at x. The gradient
    G (possibly rounded to the inputs' dtype first) then goes through two more float32 matmuls,
    dh = G W over the vocab (and the TP all-reduce, which may add the ranks' partial sums in the
    inputs' dtype) and dW = G^T h over the rows; each result is rounded once to the inputs' dtype."""
    h, W = hidden.to(torch.float64), weight.to(torch.float64)
    T, H = h.shape
    V = W.shape[0]
    x = h @ W.T
    tokens = tokens.long()
    D = U32 * dot_growth(H) * (h.abs() @ W.abs().T)  # [T, V] error of each float32 logit
    s = row_stats(x)
    p, core = s["p"], (s["ell"] + s["H"].unsqueeze(-1)).abs()  # |log p + H|: the entropy's sensitivity
    s1, s2 = (p * D).sum(-1, keepdim=True), (p * core * D).sum(-1, keepdim=True)
    lp_k, ent_k = value_bounds(x, tokens, None, tp)
    out = {"log_prob": lp_k + D.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) + s1.squeeze(-1),
           "entropy": ent_k + s2.squeeze(-1)}
    if w1 is None and w2 is None:
        return out
    rows = torch.arange(T)
    g = torch.zeros_like(x)
    dg = torch.zeros_like(x)  # first-order change of G under the logits' error D
    if w1 is not None:
        a1 = w1.to(torch.float64)
        onehot = torch.zeros_like(x)
        onehot[rows, tokens] = 1.0
        g += a1.unsqueeze(-1) * (onehot - p)
        dg += a1.abs().unsqueeze(-1) * p * (D + s1)  # d q_j = q_j (dx_j - sum_k q_k dx_k)
    if w2 is not None:
        a2 = w2.to(torch.float64)
        g += a2.unsqueeze(-1) * torch.where(p > 0, -p * (s["ell"] + s["H"].unsqueeze(-1)), torch.zeros_like(p))
        # d[-p_j (l_j + H)] = -(dp_j (l_j + H) + p_j (dl_j + dH)), each term bounded in D
        dg += a2.abs().unsqueeze(-1) * p * ((D + s1) * (core + 1) + s2)
    err_g = grad_bound(x, tokens, None, w1, w2, tp=tp, dtype="fp32") + dg  # G as the routine has it
    ga, out_u = g.abs(), OUT_U[dtype]
    dh, dw = g @ W, g.T @ h
    # dh: G possibly rounded to the inputs' dtype, and the tp ranks' partial sums reduced in it.
    n_dh = V + max(int(tp), 1)
    out["grad_hidden"] = (err_g + (out_u * (1 + tp) + U32 * dot_growth(n_dh)) * ga) @ W.abs() \
        + out_u * dh.abs() + OUT_FLOOR[dtype]
    out["grad_weight"] = (err_g + (out_u + U32 * dot_growth(T)) * ga).T @ h.abs() \
        + out_u * dw.abs() + OUT_FLOOR[dtype]
    return out
