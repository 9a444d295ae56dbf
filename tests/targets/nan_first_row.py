"""The built-in kernel, except that its first row's log-prob is NaN, chunked or not and at any TP
size: `finite` (and `values`) must find it, and the invariances must not, since the same case
unchunked and at TP 1 gives the same NaN."""
import torch

from harness.targets import fused


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    log_prob, entropy = fused.calculate_log_probs_and_entropy(
        logits, tokens, tp_group, with_entropy=with_entropy, chunk_size=chunk_size,
        log_prob_keep_mask=log_prob_keep_mask, with_entropy_grad=with_entropy_grad)
    nan_first = torch.ones_like(log_prob)
    nan_first[:1] = float("nan")
    return log_prob * nan_first, entropy
