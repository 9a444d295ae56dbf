"""Liger-Kernel's vocab-parallel cross entropy (Triton, CUDA only) as a log-prob-only kernel target.

`liger_kernel.transformers.LigerVocabParallelCrossEntropy`: Megatron's algorithm with Triton
kernels, an explicit `tp_group` (None or a one-rank group at TP 1), a float32 softmax buffer saved
for backward and the gradient written into that buffer. It takes `[S, B, V_local]` logits and
returns the per-token loss `[S, B]`, so the adapter hands it the logits as `[T, 1, V_local]` (a
view) and returns minus the loss. No entropy, no keep mask; `chunk_size` is ignored. Triton needs
CUDA, so the target declares `"cpu": False`: CPU runs refuse it and pytest sessions skip it, saying so.
"""
from __future__ import annotations

import torch

from harness.targets.declaration import Declaration, PeerInfo

HARNESS = Declaration(
    capabilities={"entropy": False, "keep_mask": False, "cpu": False},
    peer=PeerInfo(requires=("liger_kernel", "triton"), install="pip install liger-kernel",
                  upstream=("liger_kernel.transformers.LigerVocabParallelCrossEntropy",)),
    script={"none": "its kernels are Triton, CUDA only, and a script runs on CPU over gloo"},
    # A library: no trainer of its own calls it here, so nothing is declared beyond its use (every case
    # drawn is taken as in its use; a trainer that adopts it declares its own).
    use=[],
)


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over Liger: `(log_prob [T] float32, None)`."""
    # liger-kernel is the GPU-only `peers-gpu` extra: absent where the type checker runs.
    from liger_kernel.transformers import LigerVocabParallelCrossEntropy  # pyright: ignore[reportMissingImports]

    if with_entropy or log_prob_keep_mask is not None:
        raise NotImplementedError("Liger's vocab-parallel cross entropy computes no entropy and takes no keep mask")
    tokens = tokens.reshape(-1, 1).to(device=logits.device, dtype=torch.long)
    loss = LigerVocabParallelCrossEntropy()(logits.unsqueeze(1), tokens, tp_group=tp_group)
    return -loss.reshape(-1), None
