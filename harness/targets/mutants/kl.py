"""KL-estimator defects (docs/kl.md): each class overrides one step of the built-in routine
(`harness/targets/fused_kl.py`) and is checked at the KL-estimator level only, at TP 1 (the level's
cases run there). Each is a defect trainers' KL code has had, or plausibly could.

Named for its level, as `levels/kl.py` declares it and `cases/kl.py`, `reference/kl.py`, `engine/kl.py`,
`checks/kl.py` and `mutants/kl.py` hold its parts: a level keeps one module name across the layers."""
from __future__ import annotations

import torch

from harness.targets.fused_kl import FusedKL
from harness.targets.mutants import mutant

KL = ("kl",)
TP1 = (1,)


@mutant("kl-k3-ratio-inverted", "k3 of the inverted ratio pi / pi_ref: exp(x) - 1 - x, the estimator of the "
        "reverse KL", ("values",), tp=TP1, levels=KL)
class K3RatioInverted(FusedKL):
    def estimate(self, x, kind):
        return torch.exp(x) - 1.0 - x if kind == "k3" else super().estimate(x, kind)


@mutant("kl-k2-without-half", "k2 as (log r)^2, without the 1/2", ("values", "gradients"), tp=TP1, levels=KL)
class K2WithoutHalf(FusedKL):
    def estimate(self, x, kind):
        return x.square() if kind == "k2" else super().estimate(x, kind)


@mutant("kl-clamp-ignored", "the clamp argument dropped: the far tail's log-ratio reaches the estimator",
        ("values",), tp=TP1, levels=KL)
class ClampIgnored(FusedKL):
    def clamp_log_ratio(self, x, clamp):
        return x


@mutant("kl-clamp-grad-leaked", "the clamp applied as a straight-through (its value, the identity's "
        "gradient): a clamped token still pushes the policy", ("gradients",), tp=TP1, levels=KL)
class ClampGradLeaked(FusedKL):
    def clamp_log_ratio(self, x, clamp):
        return x if clamp is None else x + (x.clamp(-clamp, clamp) - x).detach()


@mutant("kl-mean-over-all-tokens", "the token mean divided by every token, the masked ones too",
        ("values", "gradients"), tp=TP1, levels=KL)
class MeanOverAllTokens(FusedKL):
    def count(self, keep):
        return torch.tensor(float(max(keep.numel(), 1)), device=keep.device)


@mutant("kl-mask-ignored", "the mask dropped: masked tokens (padding, the prompt) enter the estimate",
        ("values", "gradients"), tp=TP1, levels=KL)
class MaskIgnored(FusedKL):
    def valid(self, mask, x):
        return super().valid(None, x)


@mutant("kl-empty-mean-nan", "the token mean of a batch without a valid token is 0 / 0 (a masked mean "
        "without a floor on its count)", ("finite",), tp=TP1, levels=KL)
class EmptyMeanNan(FusedKL):
    def count(self, keep):
        return keep.sum().to(torch.float32)


@mutant("kl-policy-detached", "the policy's log-probs detached: the KL term carries no gradient",
        ("grad-flags", "gradients"), tp=TP1, levels=KL)
class PolicyDetached(FusedKL):
    def log_ratio(self, log_probs, ref_log_probs):
        return super().log_ratio(log_probs.detach(), ref_log_probs)


@mutant("kl-bf16-arithmetic", "the estimator computed in the log-probs' own dtype (bf16), as a routine that "
        "does not upcast does", ("values",), tp=TP1, levels=KL)
class Bf16Arithmetic(FusedKL):
    def upcast(self, t):
        return t

    def reduce(self, values, keep, reduction):
        return super().reduce(values, keep, reduction).float()
