"""ms-swift's Megatron trainers' log-probs and entropy, `compute_logps_and_entropy_from_logits` (`swift/megatron/trainers/vocab_parallel_utils.py`).

`compute_logps_and_entropy_from_logits(logits [B, S, V_local], labels [B, S], compute_entropy,
entropy_chunk_size)`: a vocab-parallel log-softmax (max and sum-of-exp all-reduced over
megatron-core's TP group, with `torch.distributed.all_reduce`), the target's log-prob gathered and
all-reduced, and the entropy `-sum(p log p)` of the same log-softmax in chunks of
`entropy_chunk_size` rows, all-reduced. Labels come aligned (ms-swift rolls them beforehand) and
`-100` marks a masked label; the contract's tokens are all in the vocabulary. The adapter passes the
logits as a `[1, T, V_local]` view and the tokens as `[1, T]` labels; `chunk_size <= 0` is
ms-swift's default entropy chunk (512). Both outputs come in the logits' dtype; the entropy is
differentiable whenever the logits are (no keep mask, no metric-only flag). The TP group comes from
`parallel_state` (the adapter checks it is the harness's). No CP at this level.

The file is loaded on its own (`_source`): `swift/__init__.py` and `swift/megatron/__init__.py`
import transformers, peft and Megatron-LM's training code; `vocab_parallel_utils.py` needs torch
and `megatron.core.mpu` only, so nothing is stubbed.
"""
from __future__ import annotations

import dataclasses

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import FLOAT16_OUTPUT_FP32, GPT_LOGITS_CONTIGUOUS, NONCONTIGUOUS, parallel_state_group
from harness.targets.peers._source import PeerSource, missing

HOW = ("git clone https://github.com/modelscope/ms-swift && export PYTHONPATH=$PWD/ms-swift:$PYTHONPATH "
       "(vocab_parallel_utils.py needs torch and megatron-core only)")
SOURCE = PeerSource("ms-swift", files=("swift/megatron/trainers/vocab_parallel_utils.py",),
                    markers=("swift/megatron",), how=HOW)
HARNESS = Declaration(
    capabilities={"keep_mask": False, "metric_only_entropy": False},
    peer=PeerInfo(requires=("megatron.core", "swift"), install=HOW, upstream=(
        "swift.megatron.trainers.vocab_parallel_utils.compute_logps_and_entropy_from_logits",)),
    # What ms-swift's own callers make (its Megatron GRPO trainer, `swift/megatron/trainers/grpo_trainer.py`,
    # and the log-probs of `swift/megatron/trainers/utils.py:449`); the harness's cases beyond it are
    # findings beyond its use (harness.checks.use).
    use=[
        {"where": {}, "check": ["gradients", "tp-invariance", "chunk-invariance", "finite"], "term": "entropy",
         "why": "swift/megatron/trainers/grpo_trainer.py:1079-1106: the entropy is a logged metric and, through "
                "`entropies >= entropy_threshold`, a token mask; the GRPO loss never differentiates it"},
        {"where": {"regime": "neginf"},
         "why": "swift/megatron/trainers/grpo_trainer.py:899-906 (and utils.py:445-449): the logits are the model's "
                "output, divided by the temperature; nothing masks them to -inf"},
        {"where": {"T": 0},
         "why": "swift/megatron/trainers/grpo_trainer.py:892-906: the logits are those of a micro-batch of encoded "
                "samples, each with its prompt tokens: never empty"},
        {"where": {"dtype": ["bf16", "fp16"]},
         "why": "swift/megatron/utils/megatron_lm_utils.py:521 wraps the model in Float16Module: "
                f"{FLOAT16_OUTPUT_FP32}, so the logits reach this routine in float32"},
        {"where": {"layout": NONCONTIGUOUS},
         "why": f"swift/megatron/trainers/grpo_trainer.py:899: the logits are the model's output; {GPT_LOGITS_CONTIGUOUS}"},
        {"where": {"context": ["accumulate", "two_calls", "two_inputs"]},
         "why": "swift/megatron/trainers/grpo_trainer.py:899-906: one call on each micro-batch's own model output; no "
                "second call or second backward reaches the same logits tensor"},
        {"where": {}, "check": "input-integrity",
         "why": "swift/megatron/trainers/grpo_trainer.py:899-906 (and utils.py:445-449): the logits are read by this "
                "call only; what it leaves in them is never read again"},
    ],
)

_VP = SOURCE.load()  # None without ms-swift's tree on sys.path; RoutineMissing when this commit lacks the file
if _VP is not None:
    missing(SOURCE, _VP, "compute_logps_and_entropy_from_logits")


def swift_kernel(vp, logits, tokens, with_entropy=False, chunk_size=-1):
    """ms-swift's call, as its Megatron GRPO trainer makes it (`_compute_per_token_logps`): the
    logits as `[1, T, V_local]`, the aligned labels as `[1, T]`; `chunk_size <= 0` is ms-swift's
    default entropy chunk, 512. Needs only torch and `vp`, ms-swift's `vocab_parallel_utils.py`:
    `harness repro --script` embeds it."""
    labels = tokens.reshape(1, -1).to(device=logits.device, dtype=torch.long)
    log_prob, entropy = vp.compute_logps_and_entropy_from_logits(
        logits.unsqueeze(0), labels, compute_entropy=with_entropy,
        entropy_chunk_size=chunk_size if chunk_size > 0 else 512)
    return log_prob.reshape(-1), entropy.reshape(-1) if entropy is not None else None


# `harness repro --script`: the files the call needs from ms-swift's tree, and the call itself.
HARNESS = dataclasses.replace(HARNESS, script={"name": "ms-swift", "files": {"vp": SOURCE.files}, "kernel": swift_kernel,
                                               "megatron": True, "how": HOW})


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over ms-swift: `(log_prob [T], entropy [T] or None)`, in the logits' dtype."""
    if log_prob_keep_mask is not None:
        raise NotImplementedError("ms-swift takes no keep mask (HARNESS_CAPABILITIES['keep_mask'] is False)")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V_local], got {tuple(logits.shape)}")
    vp = SOURCE.require(_VP)
    parallel_state_group(tp_group, "ms-swift's vocab_parallel_utils")
    return swift_kernel(vp, logits, tokens, with_entropy, chunk_size)
