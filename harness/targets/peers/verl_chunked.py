"""verl's chunked entropy, `vocab_parallel_entropy_with_chunking`, with verl's log-probs.

As the `verl` adapter, with the entropy verl's engine computes when
`entropy_from_logits_with_chunking` is set: `_VocabParallelEntropy` applied to slices of at most
`chunk_size` sequence positions, written into a float32 `zeros` buffer. It chunks along dimension 1
of a `[batch, seq, V_local]` tensor (a 2-D input raises `IndexError`), so the adapter hands it the
logits as a batch of one, `logits.unsqueeze(0)`: a view, no copy, as verl's engine passes its
`[1, total_nnz, V_local]` logits. `chunk_size <= 0` means verl's default, 2048. Before verl #6446
the engine had no chunked entropy on Megatron and computed `vocab_parallel_entropy` whatever
`entropy_from_logits_with_chunking` said; the adapter follows that form on such a tree.
"""
from __future__ import annotations

import dataclasses

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers.verl import FILES, HOW, checked
from harness.targets.peers.verl import HARNESS as VERL

HARNESS = Declaration(
    capabilities={"keep_mask": False, "metric_only_entropy": False},
    peer=PeerInfo(requires=("verl", "megatron.core"), install="pip install verl==0.9.1",
                  upstream=("verl.utils.megatron.tensor_parallel.vocab_parallel_entropy_with_chunking",
                            "verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits")),
    # verl's engine calls the chunked entropy where it calls the unchunked one: the same use (verl.py).
    use=VERL.use,
)


def verl_engine_chunked(tp, logits, tokens, with_entropy=False, chunk_size=-1):
    """verl's engine's composition with `entropy_from_logits_with_chunking` set: the entropy of
    `vocab_parallel_entropy_with_chunking` on the `[1, T, V_local]` logits (chunks of `chunk_size`
    rows; `<= 0`: verl's default, 2048), the log-probs on `logits.clone()`. A tree from before verl
    #6446 has no chunked entropy, and its engine computed `vocab_parallel_entropy` whatever the flag
    said: so does this. Needs only torch and `tp`: `harness repro --script` embeds it."""
    entropy, logits_bak = None, logits.clone() if with_entropy else logits
    if with_entropy and hasattr(tp, "vocab_parallel_entropy_with_chunking"):
        chunk = chunk_size if chunk_size > 0 else 2048
        entropy = tp.vocab_parallel_entropy_with_chunking(logits.unsqueeze(0), chunk_size=chunk).squeeze(0)
    elif with_entropy:
        entropy = tp.vocab_parallel_entropy(logits)
    return tp.vocab_parallel_log_probs_from_logits(logits_bak, tokens.reshape(-1).long()), entropy


# `harness repro --script`: the file the call needs from verl's tree, and the call itself.
HARNESS = dataclasses.replace(HARNESS, script={"name": "verl", "files": FILES, "kernel": verl_engine_chunked,
                                               "megatron": True, "how": HOW})


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over verl's chunked entropy: `(log_prob [T] float32, entropy [T] float32 or None)`."""
    return verl_engine_chunked(checked(tp_group, log_prob_keep_mask), logits, tokens, with_entropy, chunk_size)
