"""The built-in fused-linear distillation routine (docs/linear-distill.md), the default target's
`linear_distill` level:

    linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, *,
                        kind="jsd", beta=0.5, temperature=1.0, ignore_index=-100, hard_weight=0.0,
                        soft_weight=1.0, chunk_size=-1)

A chunk of tokens at a time: the chunk's student logits (`h W^T`, in the inputs' dtype, then float32)
and the teacher's (its head without autograd, or its logits as given), the divergence of the two
log-softmaxes at the temperature and the cross-entropy of the student's at temperature 1, each
masked to the valid tokens (`labels != ignore_index`) and summed; the sums of every chunk are divided
once by the valid tokens of the whole batch (at least 1). Each chunk runs under activation
checkpointing, so the backward recomputes its logits: the forward keeps no `[T, V]` tensor.

Every concern is a method, so a mutant overrides exactly one (`harness/targets/mutants/linear_distill.py`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["LINEAR_DISTILL_ROUTINE", "FusedLinearDistill"]

KINDS = ("forward_kl", "reverse_kl", "jsd", "soft_ce")


class FusedLinearDistill:
    def spans(self, T: int, chunk_size: int) -> list[tuple[int, int]]:
        step = T if chunk_size < 1 else chunk_size
        return [(s, min(s + step, T)) for s in range(0, T, max(step, 1))]

    def student_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (hidden @ weight.T).float()

    def teacher_logits(self, hidden: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return (hidden if weight is None else hidden @ weight.T).float()

    def log_softmax(self, x: torch.Tensor, temperature: float) -> torch.Tensor:
        return (x / temperature if temperature != 1.0 else x).log_softmax(dim=-1)

    def divergence(self, ls: torch.Tensor, lt: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
        """Per row `[n]`, float32, from the two log-softmaxes."""
        if kind == "forward_kl":
            return (lt.exp() * (lt - ls)).sum(-1)
        if kind == "reverse_kl":
            return (ls.exp() * (ls - lt)).sum(-1)
        if kind == "soft_ce":
            return -(lt.exp() * ls).sum(-1)
        lm = torch.logaddexp(lt + math.log(beta), ls + math.log(1.0 - beta))
        return beta * (lt.exp() * (lt - lm)).sum(-1) + (1.0 - beta) * (ls.exp() * (ls - lm)).sum(-1)

    def hard(self, logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        ids = torch.where(keep, labels, torch.zeros_like(labels))
        return -logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    def valid(self, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        return labels != ignore_index

    def masked_sum(self, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, values, torch.zeros_like(values)).sum()

    def count(self, keep: torch.Tensor) -> torch.Tensor:
        return keep.sum().clamp(min=1).to(torch.float32)

    def chunk_sums(self, hidden: torch.Tensor, weight: torch.Tensor, t_logits: torch.Tensor, labels: torch.Tensor,
                   keep: torch.Tensor, kind: str, beta: float, temperature: float,
                   with_hard: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's (soft, hard) sums over its valid tokens."""
        s = self.student_logits(hidden, weight)
        soft = self.masked_sum(self.divergence(self.log_softmax(s, temperature),
                                               self.log_softmax(t_logits, temperature), kind, beta), keep)
        hard = self.masked_sum(self.hard(s, labels, keep), keep) if with_hard else soft.new_zeros(())
        return soft, hard

    def combine(self, soft: torch.Tensor, hard: torch.Tensor, keep: torch.Tensor, hard_weight: float,
                soft_weight: float) -> torch.Tensor:
        return (hard_weight * hard + soft_weight * soft) / self.count(keep)

    def linear_distill_loss(self, student_hidden: torch.Tensor, student_weight: torch.Tensor,
                            teacher_hidden: torch.Tensor, teacher_weight: Optional[torch.Tensor], labels: torch.Tensor,
                            *, kind: str = "jsd", beta: float = 0.5, temperature: float = 1.0,
                            ignore_index: int = -100, hard_weight: float = 0.0, soft_weight: float = 1.0,
                            chunk_size: int = -1) -> torch.Tensor:
        if kind not in KINDS:
            raise ValueError(f"unknown distillation loss {kind!r}; valid: {', '.join(KINDS)}")
        if kind == "jsd" and not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1, got {beta} (0 and 1 are forward_kl and reverse_kl)")
        keep = self.valid(labels, ignore_index)
        soft = hard = student_hidden.new_zeros((), dtype=torch.float32)
        for s, e in self.spans(student_hidden.shape[0], chunk_size):
            t_logits = self.teacher_logits(teacher_hidden[s:e], teacher_weight)
            cs, ch = checkpoint(self.chunk_sums, student_hidden[s:e], student_weight, t_logits, labels[s:e],
                                keep[s:e], kind, beta, temperature, hard_weight != 0, use_reentrant=False)
            soft, hard = soft + cs, hard + ch
        return self.combine(soft, hard, keep, hard_weight, soft_weight)


LINEAR_DISTILL_ROUTINE = FusedLinearDistill()
