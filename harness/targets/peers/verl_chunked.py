"""verl's chunked entropy, `vocab_parallel_entropy_with_chunking`, with verl's log-probs.

As the `verl` adapter, with the entropy verl's engine computes when
`entropy_from_logits_with_chunking` is set: `_VocabParallelEntropy` applied to slices of at most
`chunk_size` sequence positions, written into a float32 `zeros` buffer. It chunks along dimension 1
of a `[batch, seq, V_local]` tensor (a 2-D input raises `IndexError`), so the adapter hands it the
logits as a batch of one, `logits.unsqueeze(0)`: a view, no copy. `chunk_size <= 0` means verl's
default, 2048.
"""
from __future__ import annotations

import torch

from harness.targets.peers._mpu import parallel_state_group

HARNESS_CAPABILITIES = {"keep_mask": False, "metric_only_entropy": False}
HARNESS_PEER = dict(requires=("verl", "megatron.core"), install="pip install verl==0.9.1",
                    upstream=("verl.utils.megatron.tensor_parallel.vocab_parallel_entropy_with_chunking",
                              "verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits"))
VERL_DEFAULT_CHUNK = 2048


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over verl's chunked entropy: `(log_prob [T] float32, entropy [T] float32 or None)`."""
    from verl.utils.megatron.tensor_parallel import (vocab_parallel_entropy_with_chunking,
                                                     vocab_parallel_log_probs_from_logits)

    if log_prob_keep_mask is not None:
        raise NotImplementedError("verl takes no keep mask (HARNESS_CAPABILITIES['keep_mask'] is False)")
    parallel_state_group(tp_group, "verl's tensor_parallel functions")
    tokens = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
    entropy, logits_bak = None, logits
    if with_entropy:
        logits_bak = logits.clone()  # verl's, as in _lm_head_logits_processor
        chunk = chunk_size if chunk_size > 0 else VERL_DEFAULT_CHUNK
        entropy = vocab_parallel_entropy_with_chunking(logits.unsqueeze(0), chunk_size=chunk).squeeze(0)
    return vocab_parallel_log_probs_from_logits(logits_bak, tokens), entropy
