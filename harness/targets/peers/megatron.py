"""megatron-core's `tensor_parallel.vocab_parallel_cross_entropy` as a log-prob-only kernel target.

Megatron's vocab-parallel cross entropy is the peer most RL trainers start from: the loss is
`log(sum exp x) - x[target]` over the TP-sharded vocab, so `log_prob = -loss` (label smoothing 0).
It computes no entropy and takes no keep mask, and says so through `HARNESS_CAPABILITIES`: the
harness then draws no case that needs either. It takes its group from `megatron.core.parallel_state`,
not from an argument, and has no row chunking: `chunk_size` (a memory knob whose value must not
change the results) is accepted and ignored. Calling it once per chunk on views of one float32
tensor would not work: its in-place writes to the input (below) bump the shared version counter and
the first chunk's backward fails.

The adapter adds nothing else: it hands megatron the caller's tensor as a trainer would, so the
checks see megatron's own behaviour. On float32 input they find the in-place writes of
Megatron-LM PR #1594 (`.float()` is a no-op there, so `-=`, `exp(out=)` and `div_` overwrite the
caller's logits with the softmax): `input-integrity` fails for fp32 cases, every log-prob check passes.
"""
from __future__ import annotations

import dataclasses

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import parallel_state_group

HARNESS = Declaration(
    capabilities={"entropy": False, "keep_mask": False},
    peer=PeerInfo(requires=("megatron.core",), install="pip install megatron-core (a harness dependency)",
                  upstream=("megatron.core.tensor_parallel.vocab_parallel_cross_entropy",)),
    # What megatron-core's own caller makes: GPTModel computes its loss with it on the output layer's
    # logits (`megatron/core/models/gpt/gpt_model.py:714`, through `compute_language_model_loss`,
    # megatron/core/models/common/language_module/language_module.py:128-171, megatron-core 0.16.1). The
    # harness's cases beyond it are findings beyond its use (harness.checks.use).
    use=[
        {"where": {"context": ["accumulate", "two_calls", "two_inputs"]},
         "why": "megatron/core/models/gpt/gpt_model.py:714: one call on each forward's own logits; no second call or second backward reaches the "
                "same logits tensor"},
        {"where": {}, "check": "input-integrity",
         "why": "megatron/core/models/gpt/gpt_model.py:714-716: the logits go into the loss and GPTModel returns the loss; nothing reads the logits "
                "again, so what the call writes into them is never used"},
        {"where": {"T": 0},
         "why": "megatron/core/models/gpt/gpt_model.py:714: the logits of a micro-batch of `seq_length` positions: never empty"},
    ],
)


def megatron_kernel(tp, logits, tokens):
    """megatron-core's call as GPTModel's loss makes it: `vocab_parallel_cross_entropy` (of `tp`,
    `megatron.core.tensor_parallel`) on the caller's logits, its group parallel_state's; the
    log-prob is minus the loss. Needs only torch and megatron-core: `harness repro --script` embeds it."""
    return -tp.vocab_parallel_cross_entropy(logits, tokens.reshape(-1).long()), None


# `harness repro --script`: megatron-core's module, imported as installed, and the call.
HARNESS = dataclasses.replace(HARNESS, script={
    "name": "megatron-core", "files": {"tp": "megatron.core.tensor_parallel"}, "kernel": megatron_kernel, "megatron": True,
    "how": "pip install megatron-core (the script imports it as installed)"})


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over megatron-core: `(log_prob [T] float32, None)`."""
    from megatron.core import tensor_parallel

    if with_entropy:
        raise NotImplementedError("megatron vocab_parallel_cross_entropy computes no entropy "
                                  "(HARNESS_CAPABILITIES['entropy'] is False)")
    if log_prob_keep_mask is not None:
        raise NotImplementedError("megatron vocab_parallel_cross_entropy takes no keep mask "
                                  "(HARNESS_CAPABILITIES['keep_mask'] is False)")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V_local], got {tuple(logits.shape)}")
    parallel_state_group(tp_group, "megatron's vocab_parallel_cross_entropy")
    return megatron_kernel(tensor_parallel, logits, tokens.to(device=logits.device))
