"""verl's chunked entropy, `vocab_parallel_entropy_with_chunking`, with verl's log-probs.

As the `verl` adapter, with the entropy verl's engine computes when
`entropy_from_logits_with_chunking` is set: `_VocabParallelEntropy` applied to slices of at most
`chunk_size` sequence positions, written into a float32 `zeros` buffer. It chunks along dimension 1
of a `[batch, seq, V_local]` tensor (a 2-D input raises `IndexError`), so the adapter hands it the
logits as a batch of one, `logits.unsqueeze(0)`: a view, no copy. `chunk_size <= 0` means verl's
default, 2048.
"""
from __future__ import annotations

from harness.targets.peers.verl import engine_call

HARNESS_CAPABILITIES = {"keep_mask": False, "metric_only_entropy": False}
HARNESS_PEER = dict(requires=("verl", "megatron.core"), install="pip install verl==0.9.1",
                    upstream=("verl.utils.megatron.tensor_parallel.vocab_parallel_entropy_with_chunking",
                              "verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits"))
VERL_DEFAULT_CHUNK = 2048


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over verl's chunked entropy: `(log_prob [T] float32, entropy [T] float32 or None)`."""
    from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy_with_chunking

    chunk = chunk_size if chunk_size > 0 else VERL_DEFAULT_CHUNK
    return engine_call(logits, tokens, tp_group, with_entropy, log_prob_keep_mask,
                       lambda x: vocab_parallel_entropy_with_chunking(x.unsqueeze(0), chunk_size=chunk).squeeze(0))
