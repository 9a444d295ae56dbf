"""Control `kl_ratio`: the KL-estimator level (docs/kl.md) another way than the built-in routine
(harness/targets/fused_kl.py): from the reference's side, `kl = ref - policy` (verl's sign), k3 as
`expm1(kl) - kl` (no cancellation of exp against 1), k2 as `kl * kl / 2`, the clamp as a `torch.where`
select, the mask as a float multiplier, and the token mean as a sum over a float count."""
from __future__ import annotations

from typing import Optional

import torch


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3",
                mask: Optional[torch.Tensor] = None, reduction: str = "none",
                clamp: Optional[float] = None) -> torch.Tensor:
    kl = ref_log_probs.to(torch.float32) - log_probs.to(torch.float32)  # -log r
    if clamp is not None:
        kl = torch.where(kl > clamp, torch.full_like(kl, clamp),
                         torch.where(kl < -clamp, torch.full_like(kl, -clamp), kl))
    if kind == "k1":
        est = -kl
    elif kind == "k2":
        est = kl * kl / 2
    elif kind == "k3":
        est = torch.expm1(kl) - kl
    else:
        raise ValueError(f"unknown KL estimator {kind!r}")
    m = torch.ones_like(est) if mask is None else (mask != 0).to(torch.float32)
    est = est * m
    if reduction == "none":
        return est
    if reduction == "sum":
        return est.sum()
    if reduction == "token_mean":
        return est.sum() / torch.clamp(m.sum(), min=1.0)
    raise ValueError(f"unknown reduction {reduction!r}")
