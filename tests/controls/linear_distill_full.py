"""Control `linear_distill_full`: the fused-linear distillation level (docs/linear-distill.md) another
way than the built-in routine (harness/targets/fused_linear_distill.py): unchunked (the chunk size
ignored, as the contract lets a routine), the logits upcast before the matmul, the divergences through
`torch.nn.functional.kl_div` with the JSD's mixture built in probability space, the hard loss through
`cross_entropy`'s own `ignore_index` and sum, and plain autograd."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, as `kl_div(input=log q, target=log p)` writes it."""
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)


def linear_distill_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                        teacher_weight: Optional[torch.Tensor], labels: torch.Tensor, *, kind: str = "jsd",
                        beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                        hard_weight: float = 0.0, soft_weight: float = 1.0, chunk_size: int = -1) -> torch.Tensor:
    s = student_hidden.float() @ student_weight.float().T
    t = teacher_hidden.float().detach()
    if teacher_weight is not None:
        t = t @ teacher_weight.float().detach().T
    ls, lt = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
    if kind == "forward_kl":
        per = _kl(lt, ls)
    elif kind == "reverse_kl":
        per = _kl(ls, lt)
    elif kind == "soft_ce":
        per = -(F.softmax(t / temperature, -1) * ls).sum(-1)
    elif kind == "jsd":
        lm = torch.log(beta * lt.exp() + (1 - beta) * ls.exp())
        per = beta * _kl(lt, lm) + (1 - beta) * _kl(ls, lm)
    else:
        raise ValueError(f"unknown distillation loss {kind!r}")
    keep = (labels != ignore_index).float()
    n = keep.sum().clamp(min=1)
    hard = F.cross_entropy(s, labels, ignore_index=ignore_index, reduction="sum") if hard_weight else 0.0
    return (soft_weight * (per * keep).sum() + hard_weight * hard) / n
