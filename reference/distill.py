"""Float64 oracle for the distillation level (docs/contract.md, "Level 3"; docs/distill.md), over the
whole vocabulary.

Pure float64 math on copies of the inputs: the logits are whole rows `[T, V]` (every shard side by
side in rank order), so the oracle needs no notion of TP. A `-inf` logit is a masked vocabulary
entry: its probability is 0, and a divergence term with both probabilities 0 is 0.

The divergence is written term by term (`divergence_terms`) with its `-inf` entries substituted
before any product, so float64 autograd through it gives finite gradients wherever the true ones
are finite; the checks' gradients and the tolerance's partial derivatives both come from it.

Named for its level, as `checks/distill.py` checks it and `targets/mutants/distill.py` breaks it: a
level keeps one module name across the layers.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KINDS", "divergence", "divergence_terms", "gather", "log_softmax", "scaled", "support",
           "support_log_probs", "topk", "topk_threshold"]

KINDS = ("forward_kl", "reverse_kl", "jsd", "mixed", "soft_ce")


def scaled(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """`z = x / temperature` in float64 (the logits upcast exactly, then divided)."""
    return logits.to(torch.float64) / float(temperature)


def log_softmax(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """`[T, V]` float64 `log_softmax(x / temperature)` over the whole vocabulary."""
    return scaled(logits, temperature).log_softmax(dim=-1)


def topk(logits: Tensor, k: int, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """`(log_probs [T, k'], ids [T, k'])`, `k' = min(k, V)`: one top-k of every row, by descending
    value, ties broken toward the lower id (the contract accepts any tie-break; this is the oracle's
    choice, and the one `support` uses)."""
    z = scaled(logits, temperature)
    kk = min(int(k), z.shape[-1])
    ids = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :kk]
    return z.log_softmax(dim=-1).gather(-1, ids), ids


def topk_threshold(logits: Tensor, k: int, temperature: float = 1.0) -> Tensor:
    """`[T]` float64: the k'-th largest value of each row of `z` (every top-k holds the entries above
    it and some of those equal to it)."""
    z = scaled(logits, temperature)
    kk = min(int(k), z.shape[-1])
    return torch.sort(z, dim=-1, descending=True).values[:, kk - 1] if kk else z.new_zeros(z.shape[0])


def gather(logits: Tensor, ids: Tensor, temperature: float = 1.0, renormalize: bool = False) -> Tensor:
    """`[T, K]` float64: `log_softmax(z)` at the global ids, or (`renormalize`) the log-softmax of the
    gathered values of `z` (the distribution restricted to the support)."""
    z = scaled(logits, temperature)
    ids = ids.to(torch.int64)
    if renormalize:
        return z.gather(-1, ids).log_softmax(dim=-1)
    return z.log_softmax(dim=-1).gather(-1, ids)


def support(teacher: Tensor | None, teacher_ids: Tensor | None, k: int, vocab: int, rows: int,
            temperature: float = 1.0) -> Tensor:
    """The divergence's support `[T, K]` (global ids): the whole vocabulary (full teacher, `k <= 0`),
    the teacher's top-k (`k > 0`), or the ids given with the teacher's top-k log-probs."""
    if teacher_ids is not None:
        return teacher_ids.to(torch.int64)
    if teacher is not None and k > 0:
        return topk(teacher, k, temperature)[1]
    return torch.arange(vocab, dtype=torch.int64).expand(rows, vocab)


def support_log_probs(student: Tensor, teacher: Tensor | None, teacher_log_probs: Tensor | None, ids: Tensor,
                      temperature: float = 1.0, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    """`(log p_s, log p_t)` on the support `ids` `[T, K]`, float64, differentiable w.r.t. `student`
    and `teacher` when they require grad: renormalized over the support (`renormalize`) or the
    whole vocabulary's. `teacher` is the teacher's full logits; `teacher_log_probs` (instead) the
    given log-probs at `ids`, renormalized after dividing by the temperature, or used as given."""
    ls = gather(student, ids, temperature, renormalize)
    if teacher is not None:
        return ls, gather(teacher, ids, temperature, renormalize)
    assert teacher_log_probs is not None  # one of the two teachers
    lt = teacher_log_probs.to(torch.float64)
    return ls, (lt / float(temperature)).log_softmax(dim=-1) if renormalize else lt


def _where(cond: Tensor, value: Tensor) -> Tensor:
    # `value` where `cond`, 0 elsewhere, with the unselected entries substituted *before* any use:
    # a -inf there would make a product's gradient NaN even though `where` discards its value.
    return torch.where(cond, value, torch.zeros_like(value))


def _kl_terms(lp: Tensor, lq: Tensor) -> Tensor:
    """`p (log p - log q)` per entry: 0 where p == 0, +inf where p > 0 and q == 0."""
    p = lp.exp()
    live = p > 0
    return _where(live, p) * (_where(live, lp) - _where(live, lq))


def divergence_terms(ls: Tensor, lt: Tensor, kind: str, beta: float = 0.5) -> Tensor:
    """The per-entry terms `f(p_s, p_t)` of the contract's divergence (docs/contract.md, Level 3) from
    the log-probabilities on the support, float64, same shape as the inputs."""
    if kind == "forward_kl":
        return _kl_terms(lt, ls)
    if kind == "reverse_kl":
        return _kl_terms(ls, lt)
    if kind == "mixed":
        return beta * _kl_terms(lt, ls) + (1.0 - beta) * _kl_terms(ls, lt)
    if kind == "soft_ce":
        t = lt.exp()
        return -_where(t > 0, t) * _where(t > 0, ls)
    if kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
        m = beta * lt.exp() + (1.0 - beta) * ls.exp()
        lm = torch.where(m > 0, m, torch.ones_like(m)).log()
        return beta * _kl_terms(lt, lm) + (1.0 - beta) * _kl_terms(ls, lm)
    raise ValueError(f"unknown divergence kind {kind!r}; valid: {', '.join(KINDS)}")


def divergence(student: Tensor, teacher: Tensor | None = None, teacher_log_probs: Tensor | None = None,
               teacher_ids: Tensor | None = None, k: int = 0, kind: str = "forward_kl", beta: float = 0.5,
               temperature: float = 1.0, renormalize: bool = True) -> Tensor:
    """`[T]` float64 per-token divergence of the student from the teacher over the support."""
    T, V = student.shape
    ids = support(teacher, teacher_ids, k, V, T, temperature)
    ls, lt = support_log_probs(student, teacher, teacher_log_probs, ids, temperature, renormalize)
    return divergence_terms(ls, lt, kind, beta).sum(dim=-1)
