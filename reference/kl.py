"""Per-token KL estimators between a policy's and a reference's log-probs (docs/kl.md), in float64.

Pure math on tensors: no distribution, no I/O. `x = log_probs - ref_log_probs` is the log-ratio
log(pi / pi_ref) at the sampled token; the estimators of KL(pi || pi_ref) (Schulman, "Approximating
KL divergence") are

    k1 = x                      (unbiased, high variance, any sign)
    k2 = x^2 / 2                (biased, >= 0)
    k3 = exp(-x) - 1 + x        (unbiased, >= 0: r - 1 - log r with r = pi_ref / pi)

`clamp` clamps the log-ratio to [-clamp, clamp] before the estimator (verl's `low_var_kl` clamps it
to [-20, 20]); outside that range the estimate is constant, and its gradient with respect to the
policy's log-probs is 0. A clamp of the estimate itself (verl's `low_var_kl` and OpenRLHF's
`compute_approx_kl` clamp it to [-10, 10]) is not part of the contract (docs/kl.md).

Named for its level, as `levels/kl.py` declares it and `cases/kl.py`, `reference/kl.py`, `engine/kl.py`,
`checks/kl.py` and `mutants/kl.py` hold its parts: a level keeps one module name across the layers."""
from __future__ import annotations

import torch

KINDS = ("k1", "k2", "k3")
REDUCTIONS = ("none", "token_mean", "sum")


def log_ratio(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    x = log_probs.to(torch.float64) - ref_log_probs.to(torch.float64)
    return x if clamp is None else x.clamp(-clamp, clamp)


def estimator(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The estimate at log-ratio `x`."""
    if kind == "k1":
        return x.clone()
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return torch.expm1(-x) + x
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KINDS)}")


def derivative(x: torch.Tensor, kind: str) -> torch.Tensor:
    """d estimate / d x at log-ratio `x`."""
    if kind == "k1":
        return torch.ones_like(x)
    if kind == "k2":
        return x.clone()
    if kind == "k3":
        return -torch.expm1(-x)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KINDS)}")


def inside(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """Where the clamp passes the log-ratio through (a closed interval, as torch.clamp's gradient)."""
    x = log_ratio(log_probs, ref_log_probs)
    return torch.ones_like(x, dtype=torch.bool) if clamp is None else x.abs() <= clamp


def valid(mask: torch.Tensor | None, T: int) -> torch.Tensor:
    return torch.ones(T, dtype=torch.bool) if mask is None else mask.to(torch.bool)


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3",
                mask: torch.Tensor | None = None, reduction: str = "none",
                clamp: float | None = None) -> torch.Tensor:
    """Per-token estimates `[T]` (0 at masked tokens), or their sum over the valid tokens, or their
    mean over the valid tokens (0 when there is none)."""
    per_token = estimator(log_ratio(log_probs, ref_log_probs, clamp), kind)
    keep = valid(mask, per_token.shape[0])
    per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
    return reduce(per_token, keep, reduction)


def reduce(per_token: torch.Tensor, keep: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    if reduction == "token_mean":
        return total / max(int(keep.sum()), 1)
    raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(REDUCTIONS)}")


def grad_log_probs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, weight: torch.Tensor, kind: str = "k3",
                   mask: torch.Tensor | None = None, reduction: str = "none",
                   clamp: float | None = None) -> torch.Tensor:
    """The gradient of `sum(weight * kl_estimate(...))` with respect to the policy's log-probs: the
    estimator's derivative at the clamped log-ratio, 0 where the clamp holds it or the token is
    masked, times the upstream weight (`[T]` for reduction "none", a scalar otherwise), divided by
    the number of valid tokens for the token mean."""
    x = log_ratio(log_probs, ref_log_probs, clamp)
    keep = valid(mask, x.shape[0])
    d = derivative(x, kind) * (inside(log_probs, ref_log_probs, clamp) & keep)
    w = weight.to(torch.float64)
    if reduction == "token_mean":
        w = w / max(int(keep.sum()), 1)
    return d * w
