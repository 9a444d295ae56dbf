"""Float64 reference oracle for fused tensor-parallel log-prob/entropy routines (docs/contract.md)."""

from . import distill
from .kernel import effective_keep_mask, entropy, log_probs, logits_grad
from .linear import linear_entropy, linear_grads, linear_log_probs, linear_logits
from .wrapper import (
    apply_temperature,
    entropy_grad_rule,
    recorded_rows,
    response_rows,
    shifted_targets,
    top_p_keep_mask,
    wrapper_logits_grad,
    wrapper_outputs,
)

__all__ = [
    "effective_keep_mask",
    "log_probs",
    "entropy",
    "logits_grad",
    "entropy_grad_rule",
    "apply_temperature",
    "shifted_targets",
    "response_rows",
    "recorded_rows",
    "top_p_keep_mask",
    "wrapper_outputs",
    "wrapper_logits_grad",
    "linear_logits",
    "linear_log_probs",
    "linear_entropy",
    "linear_grads",
    "distill",
]
