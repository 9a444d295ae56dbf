"""Fused-linear distillation defects (docs/linear-distill.md): each class overrides one step of the
built-in routine (`harness/targets/fused_linear_distill.py`) and is checked at that level only, at TP 1
(the level's cases run there). Each is a defect a chunked distillation loss has had, or plausibly could.

Named for its level, as `levels/linear_distill.py` declares it and `cases/`, `reference/`, `engine/`,
`checks/` and `targets/fused_linear_distill.py` hold its parts."""
from __future__ import annotations

import torch

from harness.targets.fused_linear_distill import FusedLinearDistill
from harness.targets.mutants import mutant

LD = ("linear_distill",)
TP1 = (1,)


@mutant("ld-mean-per-chunk", "each chunk's loss divided by its own valid tokens and the chunks averaged: "
        "a token of a sparse chunk weighs more than one of a full chunk", ("values", "gradients"), tp=TP1, levels=LD)
class MeanPerChunk(FusedLinearDistill):
    def linear_distill_loss(self, student_hidden, student_weight, teacher_hidden, teacher_weight, labels, *,
                            chunk_size=-1, **kw):
        whole = super().linear_distill_loss  # one chunk's mean, over its own valid tokens
        parts = [whole(student_hidden[s:e], student_weight, teacher_hidden[s:e], teacher_weight, labels[s:e], **kw)
                 for s, e in self.spans(student_hidden.shape[0], chunk_size)]
        return torch.stack(parts).mean()


@mutant("ld-ignored-tokens-distilled", "the divergence summed over every token, the ignored ones (prompt, "
        "padding) too, as Liger's chunked JSD did before it masked them", ("values", "gradients"),
        tp=TP1, levels=LD)
class IgnoredTokensDistilled(FusedLinearDistill):
    def chunk_sums(self, hidden, weight, t_logits, labels, keep, kind, beta, temperature, with_hard):
        soft, _ = super().chunk_sums(hidden, weight, t_logits, labels, torch.ones_like(keep), kind, beta,
                                     temperature, False)
        _, hard = super().chunk_sums(hidden, weight, t_logits, labels, keep, kind, beta, temperature, with_hard)
        return soft, hard


@mutant("ld-jsd-beta-swapped", "the generalized JSD with beta and 1 - beta swapped (the mixture and the "
        "weights of its two KLs)", ("values", "gradients"), tp=TP1, levels=LD)
class JsdBetaSwapped(FusedLinearDistill):
    def divergence(self, ls, lt, kind, beta):
        return super().divergence(ls, lt, kind, 1.0 - beta if kind == "jsd" else beta)


@mutant("ld-temperature-on-hard-loss", "the hard-label cross-entropy taken at the distillation temperature "
        "too (the contract's is at temperature 1)", ("values", "gradients"), tp=TP1, levels=LD)
class TemperatureOnHardLoss(FusedLinearDistill):
    def chunk_sums(self, hidden, weight, t_logits, labels, keep, kind, beta, temperature, with_hard):
        soft, _ = super().chunk_sums(hidden, weight, t_logits, labels, keep, kind, beta, temperature, False)
        s = self.student_logits(hidden, weight) / temperature
        hard = self.masked_sum(self.hard(s, labels, keep), keep) if with_hard else soft.new_zeros(())
        return soft, hard


@mutant("ld-mean-over-all-tokens", "the loss divided by every token of the batch, the ignored ones too",
        ("values", "gradients"), tp=TP1, levels=LD)
class MeanOverAllTokens(FusedLinearDistill):
    def count(self, keep):
        return torch.tensor(float(max(keep.numel(), 1)), device=keep.device)


@mutant("ld-empty-labels-nan", "a batch without a valid label divided by its zero count: 0 / 0 = NaN "
        "(a masked mean without a floor)", ("finite",), tp=TP1, levels=LD)
class EmptyLabelsNan(FusedLinearDistill):
    def count(self, keep):
        return keep.sum().to(torch.float32)


@mutant("ld-head-not-trained", "the student's LM head detached: only the hidden states get a gradient",
        ("gradients",), tp=TP1, levels=LD)
class HeadNotTrained(FusedLinearDistill):
    def student_logits(self, hidden, weight):
        return super().student_logits(hidden, weight.detach())


@mutant("ld-temperature-squared", "the soft loss scaled by the temperature squared (Hinton's gradient "
        "correction, which the contract's callers do not apply)", ("values", "gradients"), tp=TP1, levels=LD)
class TemperatureSquared(FusedLinearDistill):
    def combine(self, soft, hard, keep, hard_weight, soft_weight):
        return super().combine(soft * self._tau ** 2, hard, keep, hard_weight, soft_weight)

    def linear_distill_loss(self, *args, temperature=1.0, **kw):
        self._tau = temperature
        return super().linear_distill_loss(*args, temperature=temperature, **kw)
