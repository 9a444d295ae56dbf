"""Float64 oracle for the level-1 kernel (docs/contract.md, "Level 1"), over the full vocab.

Everything is computed on a float64 copy of the inputs, so the oracle is exact to ~1e-15
relative and can judge float32 kernels. Inputs are never written to.

Named for its level, as `checks/kernel.py` checks it and `targets/mutants/kernel.py` breaks it: a
level keeps one module name across the layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["effective_keep_mask", "log_probs", "entropy", "logits_grad"]


def _rows(tokens: Tensor) -> tuple[Tensor, Tensor]:
    # Index pair (row, target) addressing the target entry of every row.
    tokens = tokens.to(torch.int64)
    return torch.arange(tokens.numel(), device=tokens.device), tokens


def effective_keep_mask(keep_mask: Tensor | None, tokens: Tensor) -> Tensor | None:
    """The keep mask `[T, V]` with each row's target forced to kept (a new tensor)."""
    if keep_mask is None:
        return None
    mask = keep_mask.to(torch.bool, copy=True)
    # The contract keeps the target even when the recorded nucleus dropped it; otherwise the
    # log-prob would be -inf.
    mask[_rows(tokens.to(mask.device))] = True
    return mask


def _masked_logits(logits: Tensor, tokens: Tensor, keep_mask: Tensor | None) -> Tensor:
    x = logits.to(torch.float64)
    mask = effective_keep_mask(keep_mask, tokens)
    if mask is None:
        return x
    return x.masked_fill(~mask, float("-inf"))


def log_probs(logits: Tensor, tokens: Tensor, keep_mask: Tensor | None = None) -> Tensor:
    """`[T]` float64: log_softmax of the masked row at the target."""
    x = _masked_logits(logits, tokens, keep_mask)
    return x.log_softmax(dim=-1)[_rows(tokens)]


def _entropy_terms(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # Returns (p, log p, H) for float64 rows x. p * log p is NaN where p == 0 and log p == -inf
    # (a -inf logit); its true limit is 0, hence the where.
    logp = x.log_softmax(dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    return p, logp, -plogp.sum(dim=-1)


def entropy(logits: Tensor) -> Tensor:
    """`[T]` float64 entropy of the unmasked softmax."""
    return _entropy_terms(logits.to(torch.float64))[2]


def logits_grad(
    logits: Tensor,
    tokens: Tensor,
    keep_mask: Tensor | None,
    w_log_prob: Tensor | None,
    w_entropy: Tensor | None,
) -> Tensor:
    """Analytic `[T, V]` float64 gradient of `sum(w_log_prob*log_prob) + sum(w_entropy*entropy)`.

    A None weight means that term is absent from the loss.
    """
    x = logits.to(torch.float64)
    grad = torch.zeros_like(x)
    if w_log_prob is not None:
        # d log q_y / dx_v = [v == y] - q_v, with q the masked softmax (exactly 0 where dropped,
        # so dropped entries get no gradient from this term).
        q = _masked_logits(x, tokens, keep_mask).softmax(dim=-1)
        term = -q
        term[_rows(tokens)] += 1.0
        grad += w_log_prob.to(torch.float64).unsqueeze(-1) * term
    if w_entropy is not None:
        # dH/dx_v = -p_v (log p_v + H); where p_v == 0 the limit is 0, but log p_v may be -inf.
        p, logp, h = _entropy_terms(x)
        term = torch.where(p > 0, -p * (logp + h.unsqueeze(-1)), torch.zeros_like(p))
        grad += w_entropy.to(torch.float64).unsqueeze(-1) * term
    return grad
