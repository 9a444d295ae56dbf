"""verl's Triton fused linear cross entropy, `linear_cross_entropy` (CUDA only), as a fused-linear target.

`verl.utils.kernel.linear_cross_entropy.linear_cross_entropy(hidden, weight, labels, temperature,
reduction, dist_process_group)` is verl's memory-saving kernel (`use_fused_kernels`): it takes the
hidden states and this rank's vocab shard of the LM head's weight, reduces over
`dist_process_group`, and returns `(logprobs, entropy)`, as verl's `model_forward_fused` calls it
(temperature 1.0, reduction "none", the TP group). Its kernels are Triton and it opens NVTX
ranges, so the target declares `"cpu": False`: CPU runs refuse it and pytest sessions skip it. It
has no metric-only flag; with `with_entropy=False` the adapter drops the entropy it computes anyway.
This adapter has not yet run on a GPU from this project (docs/peers.md).
"""
from __future__ import annotations

import torch

from harness.targets.declaration import Declaration, PeerInfo

HARNESS = Declaration(
    capabilities={"metric_only_entropy": False, "cpu": False},
    peer=PeerInfo(requires=("verl", "triton"), install="pip install verl==0.9.1 (on a CUDA machine)",
                  upstream=("verl.utils.kernel.linear_cross_entropy.linear_cross_entropy",)),
    script={"none": "its kernels are Triton, CUDA only, and a script runs on CPU over gloo"},
    # What verl's own caller makes: its model forward with the Triton backend (`verl/models/transformers/dense_common.py:173-195`), the
    # same hidden states and LM head as `verl_fused_linear`'s, so the same use.
    use=[
        {"where": {"frozen": "hidden"},
         "why": "verl/workers/engine/fsdp/transformer_impl.py:349 wraps the model in peft's LoRA with "
                "target_modules all-linear (verl/trainer/config/model/hf_model.yaml:49): the adapters train in the "
                "decoder layers, so the hidden states verl/models/transformers/dense_common.py:173 hands over require grad; without LoRA every "
                "parameter trains"},
    ],
)


def calculate_linear_log_probs_and_entropy(hidden, weight, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                           with_entropy_grad=True):
    """Fused-linear level over verl's Triton kernel: `(log_prob [T], entropy [T] or None)`."""
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    tokens = tokens.reshape(-1).to(device=hidden.device, dtype=torch.long)
    log_prob, entropy = linear_cross_entropy(hidden, weight, tokens, 1.0, "none", tp_group)
    return log_prob, entropy if with_entropy else None
