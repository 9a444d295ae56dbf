"""verl's pure-torch fused linear for PPO, `FusedLinearForPPO`, as a fused-linear target.

`verl.utils.experimental.torch_functional.FusedLinearForPPO(chunk_size=512)` takes hidden states
`[B, T, H]` (or `[T, H]`) and the LM head's weight `[V, H]` and returns `(log_probs float32, entropy
in the hidden dtype)`, each `[B, T]`, computing the logits per chunk of rows (upcast to float32) and recomputing them in a
hand-written backward. It is not tensor-parallel (no process group): at TP > 1 the adapter
all-gathers the weight's vocab shards (`_mpu.gather_vocab`, whose backward returns each rank its
own rows of the weight gradient), so every rank computes the full-vocab answer and the full hidden
gradient, as the contract asks. Both outputs always carry autograd history when an input requires
grad (no metric-only flag); with `with_entropy=False` the adapter drops the entropy verl computes
anyway. `chunk_size <= 0` means verl's default, 512. The hidden states go in as verl's model
forwards hand them over (`verl/models/transformers/dense_common.py`: the decoder's `outputs[0]`,
`[B, T, H]`, with `[B, T]` labels): the case's hidden states as a batch of one, `hidden.unsqueeze(0)`,
a view. That is the path verl #6913 fixed (its forward flattened the batch under no_grad and so
lost the hidden states' `requires_grad`). The `impl_backend="torch"` path is checked
(the Triton one needs CUDA).
"""
from __future__ import annotations

import dataclasses

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import gather_vocab

HARNESS = Declaration(
    capabilities={"metric_only_entropy": False, "tensor_parallel": False},
    peer=PeerInfo(requires=("verl",), install="pip install verl==0.9.1",
                  upstream=("verl.utils.experimental.torch_functional.FusedLinearForPPO",)),
    # What verl's own caller makes: its model forward with fused kernels (`verl/models/transformers/dense_common.py:104-127`)
    # hands over the decoder's hidden states and `self.lm_head.weight`. Under LoRA
    # (`verl/workers/engine/fsdp/transformer_impl.py:349`, peft) the base parameters, the LM head among
    # them, are frozen (a frozen head: in use) and the adapters train in the decoder layers.
    use=[
        {"where": {"frozen": "hidden"},
         "why": "verl/workers/engine/fsdp/transformer_impl.py:349 wraps the model in peft's LoRA with "
                "target_modules all-linear (verl/trainer/config/model/hf_model.yaml:49): the adapters train in the "
                "decoder layers, so the hidden states verl/models/transformers/dense_common.py:104 hands over require grad; without LoRA every "
                "parameter trains: a frozen trunk under a trained head never happens"},
    ],
)
HOW = ("git clone https://github.com/verl-project/verl && export PYTHONPATH=$PWD/verl:$PYTHONPATH "
       "(torch_functional.py needs torch only), or pip install verl")


def verl_linear(tf, hidden, weight, tokens, with_entropy=False, chunk_size=-1):
    """verl's call, as its model forwards make it (`verl/models/transformers/dense_common.py`):
    `FusedLinearForPPO(chunk_size)` on the decoder's `[B, T, H]` output and `[B, T]` labels, with
    the full LM head; `chunk_size <= 0` is verl's default, 512. Needs only torch and `tf`, verl's
    `torch_functional.py`: `harness repro --script` embeds it."""
    import inspect

    # verl's first forms (before its Triton backend) take no impl_backend: they are the torch path.
    torch_path = {"impl_backend": "torch"} if "impl_backend" in inspect.signature(tf.FusedLinearForPPO).parameters else {}
    fused = tf.FusedLinearForPPO(chunk_size=chunk_size if chunk_size > 0 else 512, **torch_path)
    log_prob, entropy = fused(hidden.unsqueeze(0), weight, tokens.reshape(1, -1).long())
    return log_prob[0], entropy[0] if with_entropy else None


# `harness repro --script`: the file the call needs from verl's tree, and the call (at TP 1: verl's
# fused linear is not tensor-parallel, and the harness's gather of the shards is not verl's code).
HARNESS = dataclasses.replace(HARNESS, script={
    "name": "verl", "files": {"tf": ("verl/utils/experimental/torch_functional.py",)}, "linear": verl_linear, "how": HOW})


def calculate_linear_log_probs_and_entropy(hidden, weight, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                           with_entropy_grad=True):
    """Fused-linear level over verl: `(log_prob [T] float32, entropy [T] or None)`."""
    from verl.utils.experimental import torch_functional

    return verl_linear(torch_functional, hidden, gather_vocab(weight, tp_group, dim=0), tokens, with_entropy,
                       chunk_size)
