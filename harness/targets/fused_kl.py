"""The built-in KL-estimator routine (docs/kl.md), the default target's `kl` level:

    kl_estimate(log_probs, ref_log_probs, kind="k3", mask=None, reduction="none", clamp=None)

Per token, in float32 (bf16 log-probs are upcast exactly): the log-ratio `x = log_probs -
ref_log_probs`, clamped to [-clamp, clamp] when a clamp is given, then the estimator (k1 = x,
k2 = x^2 / 2, k3 = exp(-x) - 1 + x); masked tokens are 0 (`torch.where`, so a masked token's value
never reaches the result); "token_mean" divides the sum by the number of valid tokens (0 without
one), "sum" is the sum. Autograd differentiates it: the clamp's gradient is 0 outside its range.

Every concern is a method, so a mutant overrides exactly one (`harness/targets/mutants/kl.py`).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["KL_ROUTINE", "FusedKL"]

KINDS = ("k1", "k2", "k3")
REDUCTIONS = ("none", "token_mean", "sum")


class FusedKL:
    def upcast(self, t: torch.Tensor) -> torch.Tensor:
        return t.float()

    def log_ratio(self, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
        return self.upcast(log_probs) - self.upcast(ref_log_probs)

    def clamp_log_ratio(self, x: torch.Tensor, clamp: Optional[float]) -> torch.Tensor:
        return x if clamp is None else x.clamp(-clamp, clamp)

    def estimate(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "k1":
            return x
        if kind == "k2":
            return 0.5 * x.square()
        return torch.exp(-x) - 1.0 + x  # k3: r - 1 - log r, r = pi_ref / pi

    def valid(self, mask: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if mask is None:
            return torch.ones_like(x, dtype=torch.bool)
        return mask.to(device=x.device) != 0

    def masked(self, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, values, torch.zeros_like(values))

    def count(self, keep: torch.Tensor) -> torch.Tensor:
        return keep.sum().clamp(min=1).to(torch.float32)

    def reduce(self, values: torch.Tensor, keep: torch.Tensor, reduction: str) -> torch.Tensor:
        if reduction == "none":
            return values
        if reduction == "sum":
            return values.sum()
        return values.sum() / self.count(keep)

    def kl_estimate(self, log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3",
                    mask: Optional[torch.Tensor] = None, reduction: str = "none",
                    clamp: Optional[float] = None) -> torch.Tensor:
        if kind not in KINDS:
            raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KINDS)}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(REDUCTIONS)}")
        x = self.clamp_log_ratio(self.log_ratio(log_probs, ref_log_probs), clamp)
        keep = self.valid(mask, x)
        return self.reduce(self.masked(self.estimate(x, kind), keep), keep, reduction)


KL_ROUTINE = FusedKL()
