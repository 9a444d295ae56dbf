"""verl's Megatron-backend log-probs and entropy, composed as verl's engine composes them.

`verl.utils.megatron.tensor_parallel`: `vocab_parallel_entropy(logits)` (its own autograd function,
three all-reduces) and `vocab_parallel_log_probs_from_logits(logits, labels)` (minus Megatron's
`vocab_parallel_cross_entropy`). Both take the TP group from megatron-core's `parallel_state`.

The composition is verl 0.9.1's `MegatronEngine._lm_head_logits_processor`
(`verl/workers/engine/megatron/transformer_impl.py`): when an entropy is asked for, the log-probs
are computed on `logits.clone()` and the entropy on the logits themselves. That clone is verl's
own code, kept because Megatron's cross entropy writes into float32 logits; the adapter adds no
other. verl has no keep mask and no metric-only entropy flag (autograd alone decides whether the
entropy is differentiable; verl's trainers compute it only when `entropy_coeff != 0` or asked to),
and `chunk_size` is ignored: the chunked entropy is the `verl_chunked` adapter.
"""
from __future__ import annotations

import dataclasses

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import FLOAT16_OUTPUT_FP32, parallel_state_group

HARNESS = Declaration(
    capabilities={"keep_mask": False, "metric_only_entropy": False},
    peer=PeerInfo(requires=("verl", "megatron.core"), install="pip install verl==0.9.1",
                  upstream=("verl.utils.megatron.tensor_parallel.vocab_parallel_entropy",
                            "verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits")),
    # What verl's own caller makes: its Megatron engine's `_lm_head_logits_processor` (`verl/workers/engine/megatron/transformer_impl.py:1183-1233`),
    # which `forward_step` hands each micro-batch's model output (:1352-1361). The harness's cases
    # beyond it are findings beyond its use (harness.checks.use); `verl_chunked` shares them.
    use=[
        {"where": {"regime": "neginf"},
         "why": "verl/workers/engine/megatron/transformer_impl.py:1201: the logits are the model's output divided by the temperature; nothing masks them to -inf"},
        {"where": {"dtype": ["bf16", "fp16"]},
         "why": f"verl/utils/megatron_utils.py:241 wraps the model in Float16Module when it runs in bf16 or fp16: "
                f"{FLOAT16_OUTPUT_FP32}, so the logits reach the engine in float32"},
        {"where": {"context": ["accumulate", "two_calls", "two_inputs"]},
         "why": "verl/workers/engine/megatron/transformer_impl.py:1352-1361: the processor runs once on each micro-batch's own model output; no second call "
                "or second backward ever reaches the same logits tensor"},
        {"where": {}, "check": "input-integrity",
         "why": "verl/workers/engine/megatron/transformer_impl.py:1206-1231: the logits are read by this call only (the entropy on them, the log-probs on "
                "`logits.clone()` or, without an entropy, on them); what the call leaves in them is never read again"},
        {"where": {"T": 0},
         "why": "verl/trainer/ppo/ray_trainer.py:1255: `left_right_2_no_padding` packs each sample's prompt and "
                "response tokens, and a micro-batch holds whole samples: its logits are never empty"},
    ],
)


HOW = ("git clone https://github.com/verl-project/verl && export PYTHONPATH=$PWD/verl:$PYTHONPATH "
       "(tensor_parallel.py needs torch and megatron-core only), or pip install verl")
FILES = {"tp": ("verl/utils/megatron/tensor_parallel.py",)}


def verl_engine(tp, logits, tokens, with_entropy=False, chunk_size=-1):
    """verl's engine's composition (`MegatronEngine._lm_head_logits_processor`): with an entropy,
    the log-probs on `logits.clone()` and the entropy on the logits themselves. Needs only torch
    and `tp`, verl's `verl/utils/megatron/tensor_parallel.py`: `harness repro --script` embeds it."""
    tokens = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
    entropy, logits_bak = None, logits
    if with_entropy:
        logits_bak = logits.clone()
        entropy = tp.vocab_parallel_entropy(logits)
    return tp.vocab_parallel_log_probs_from_logits(logits_bak, tokens), entropy


# `harness repro --script`: the file the call needs from verl's tree, and the call itself.
HARNESS = dataclasses.replace(HARNESS, script={"name": "verl", "files": FILES, "kernel": verl_engine, "megatron": True,
                                               "how": HOW})


def checked(tp_group, log_prob_keep_mask):
    """verl's module, after refusing what verl cannot take (a keep mask, a group not parallel_state's)."""
    from verl.utils.megatron import tensor_parallel

    if log_prob_keep_mask is not None:
        raise NotImplementedError("verl takes no keep mask (HARNESS_CAPABILITIES['keep_mask'] is False)")
    parallel_state_group(tp_group, "verl's tensor_parallel functions")
    return tensor_parallel


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over verl: `(log_prob [T] float32, entropy [T] in the logits' dtype or None)`."""
    return verl_engine(checked(tp_group, log_prob_keep_mask), logits, tokens, with_entropy)
