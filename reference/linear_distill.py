"""Float64 oracle of the fused-linear distillation level (docs/linear-distill.md): a student's hidden
states and LM head, a teacher's (hidden states and head, or logits), and the distillation loss over the
valid tokens of the whole batch.

Pure float64 math on copies of the inputs: no chunks (the contract's answer does not depend on them),
no distribution, no I/O. With `s = h_s W_s^T` and `t = h_t W_t^T` (or the teacher's logits as given),
`valid = labels != ignore_index` and `n = max(#valid, 1)`:

    soft = sum_valid D(log_softmax(s / tau), log_softmax(t / tau)) / n
    hard = sum_valid -log_softmax(s)[label] / n          (at temperature 1)
    loss = hard_weight * hard + soft_weight * soft

`D` is the distillation level's per-token divergence (`reference.distill.divergence_terms`, docs/contract.md
Level 3): the forward KL(t || s), the reverse KL(s || t), the generalized JSD with mixture weight beta
(`m = beta t + (1 - beta) s`, 0 < beta < 1) or the soft cross-entropy `-sum t log s`.

Named for its level, as `levels/linear_distill.py` declares it and `cases/`, `engine/`, `checks/`,
`targets/fused_linear_distill.py` and `mutants/linear_distill.py` hold its parts: a level keeps one
module name across the layers.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from harness.reference import distill

KINDS = ("forward_kl", "reverse_kl", "jsd", "soft_ce")


class Logits(NamedTuple):
    student: Tensor  # [T, V] float64
    teacher: Tensor  # [T, V] float64


def logits(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
           teacher_weight: Tensor | None) -> Logits:
    """Both models' float64 logits (the teacher's given as they are when it has no head)."""
    s = student_hidden.to(torch.float64) @ student_weight.to(torch.float64).T
    t = teacher_hidden.to(torch.float64)
    return Logits(s, t if teacher_weight is None else t @ teacher_weight.to(torch.float64).T)


def valid(labels: Tensor, ignore_index: int) -> Tensor:
    return labels != ignore_index


def per_token(s: Tensor, t: Tensor, labels: Tensor, kind: str, beta: float, temperature: float,
              ignore_index: int) -> tuple[Tensor, Tensor]:
    """`(soft [T], hard [T])`: each token's divergence at the temperature and its cross-entropy at 1,
    0 at an ignored token (whose label need not be a vocabulary id)."""
    keep = valid(labels, ignore_index)
    if kind not in KINDS:
        raise ValueError(f"unknown distillation loss {kind!r}; valid: {', '.join(KINDS)}")
    ls = distill.log_softmax(s, temperature)
    lt = distill.log_softmax(t, temperature)
    soft = distill.divergence_terms(ls, lt, kind, beta).sum(-1)
    ids = torch.where(keep, labels, torch.zeros_like(labels)).to(torch.int64)
    hard = -distill.log_softmax(s).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros_like(soft)
    return torch.where(keep, soft, zero), torch.where(keep, hard, zero)


def loss_of_logits(s: Tensor, t: Tensor, labels: Tensor, kind: str = "jsd", beta: float = 0.5,
                   temperature: float = 1.0, ignore_index: int = -100, hard_weight: float = 0.0,
                   soft_weight: float = 1.0) -> Tensor:
    """The 0-dim float64 loss from the two models' logits (differentiable w.r.t. `s`)."""
    soft, hard = per_token(s, t, labels, kind, beta, temperature, ignore_index)
    n = max(int(valid(labels, ignore_index).sum()), 1)
    return (hard_weight * hard.sum() + soft_weight * soft.sum()) / n


def loss(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor | None,
         labels: Tensor, kind: str = "jsd", beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
         hard_weight: float = 0.0, soft_weight: float = 1.0) -> Tensor:
    """The contract's loss in float64, differentiable w.r.t. the student's hidden states and head when
    they require grad (the teacher's logits are constants)."""
    s = student_hidden.to(torch.float64) @ student_weight.to(torch.float64).T
    t = logits(student_hidden.detach(), student_weight.detach(), teacher_hidden, teacher_weight).teacher
    return loss_of_logits(s, t, labels, kind, beta, temperature, ignore_index, hard_weight, soft_weight)


def grads(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor | None,
          labels: Tensor, weight: float, **kw) -> tuple[Tensor, Tensor, Tensor]:
    """`(loss, d(weight * loss)/d hidden [T, H], d(weight * loss)/d W [V, H])` in float64."""
    h = student_hidden.detach().to(torch.float64).requires_grad_(True)
    w = student_weight.detach().to(torch.float64).requires_grad_(True)
    value = loss(h, w, teacher_hidden, teacher_weight, labels, **kw)
    gh, gw = torch.autograd.grad(weight * value, (h, w))
    return value.detach(), gh, gw
