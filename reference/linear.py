"""Float64 oracle for the fused-linear level (docs/fused-linear.md): the LM head's matmul and the
kernel's math over the full vocab, and the gradients w.r.t. the hidden states and the weight.

Pure float64 on copies of the inputs; no distribution. `weight` is the full `[V, H]` head (every
shard stacked in rank order), so the oracle needs no notion of TP.

Named for its level, as `targets/mutants/linear.py` breaks it: a level keeps one module name across
the layers.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kernel import entropy, log_probs, logits_grad

__all__ = ["linear_entropy", "linear_grads", "linear_log_probs", "linear_logits"]


def linear_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """`[T, V]` float64 logits `hidden @ weight.T` (exact products of the upcast inputs)."""
    return hidden.to(torch.float64) @ weight.to(torch.float64).T


def linear_log_probs(hidden: Tensor, weight: Tensor, tokens: Tensor) -> Tensor:
    """`[T]` float64 log-softmax of the row at the target."""
    return log_probs(linear_logits(hidden, weight), tokens)


def linear_entropy(hidden: Tensor, weight: Tensor) -> Tensor:
    """`[T]` float64 entropy of the softmax of each row."""
    return entropy(linear_logits(hidden, weight))


def linear_grads(hidden: Tensor, weight: Tensor, tokens: Tensor, w_log_prob: Tensor | None,
                 w_entropy: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """`(d_hidden [T, H], d_weight [V, H], d_logits [T, V])`, float64, of
    `sum(w_log_prob * log_prob) + sum(w_entropy * entropy)` (a None weight: the term is absent).

    The chain rule through x = h W^T: dL/dh = G W and dL/dW = G^T h, with G the kernel's logit
    gradient. Column-parallel: every rank's d_hidden is this full sum over the vocab."""
    h, w = hidden.to(torch.float64), weight.to(torch.float64)
    g = logits_grad(h @ w.T, tokens, None, w_log_prob, w_entropy)
    return g @ w, g.T @ h, g
