"""TRL's log-prob and entropy over full-vocab logits: `selective_log_softmax_and_entropy`.

`trl.trainer.utils.selective_log_softmax_and_entropy(logits, index, entropy_requires_grad)` is
`selective_log_softmax` (a per-row `logsumexp` for float32, a per-row `log_softmax` in the input
dtype for bf16/fp16) and `entropy_from_logits` (chunks of 128 rows), with the entropy computed
under `no_grad` when `entropy_requires_grad` is False: the contract's `with_entropy_grad`. On CUDA
TRL switches to a Triton kernel; this adapter checks the torch path wherever it runs on CPU.
Before TRL had the combined function, its trainers called the two pieces themselves; at such a
commit the adapter does what the combined function does: `selective_log_softmax`, then
`entropy_from_logits`, under `no_grad` when `with_entropy_grad` is False.

TRL is not tensor-parallel. At TP 1 the adapter hands it the caller's logits. At TP > 1 it first
all-gathers the vocab shards (`_mpu.gather_vocab`: Megatron's gather-from-TP-region, whose
backward returns each rank its own slice), so every rank computes the full-vocab answer; that is
what a trainer must do to use TRL on TP-sharded logits, and the run costs the gathered
`[T, V]` copy. No keep mask (TRL's `row_mask` drops whole rows); `chunk_size` is ignored.
"""
from __future__ import annotations

import dataclasses

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import gather_vocab

HARNESS = Declaration(
    capabilities={"keep_mask": False, "tensor_parallel": False},
    peer=PeerInfo(requires=("trl",), install="pip install trl",
                  upstream=("trl.trainer.utils.selective_log_softmax_and_entropy",
                            "trl.trainer.utils.selective_log_softmax", "trl.trainer.utils.entropy_from_logits")),
    # What TRL's own callers make (TRL 1.16.0): `selective_log_softmax_and_entropy` in its TPO trainer,
    # `selective_log_softmax` in its other trainers, on the model's logits. The harness's cases beyond
    # it are findings beyond its use (harness.checks.use).
    use=[
        {"where": {"regime": "neginf"},
         "why": "trl/experimental/tpo/tpo_trainer.py:648-656 (and the other callers of selective_log_softmax, e.g. "
                "trl/experimental/orpo/orpo_trainer.py:738): the logits are the model's output; nothing masks them "
                "to -inf"},
        {"where": {"T": 0},
         "why": "trl/experimental/tpo/tpo_trainer.py:648-656: the logits are those of a batch of tokenized "
                "prompt-and-completion pairs: never empty"},
    ],
)


def trl_kernel(tu, logits, tokens, with_entropy=False, with_entropy_grad=True):
    """TRL's call of `tu`, its `trl.trainer.utils`, on full-vocab logits: `selective_log_softmax_and_entropy`
    (the entropy under `no_grad` unless `with_entropy_grad`), or, at a commit without it, its two
    pieces as its trainers called them. Needs only torch and `tu`: `harness repro --script` embeds it
    (TRL is not tensor-parallel: its scripts run at TP 1, where no gather is needed)."""
    tokens = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
    if not with_entropy:
        return tu.selective_log_softmax(logits, tokens), None
    if hasattr(tu, "selective_log_softmax_and_entropy"):
        return tu.selective_log_softmax_and_entropy(logits, tokens, entropy_requires_grad=with_entropy_grad)
    log_prob = tu.selective_log_softmax(logits, tokens)
    with torch.set_grad_enabled(torch.is_grad_enabled() and with_entropy_grad):
        return log_prob, tu.entropy_from_logits(logits)


# `harness repro --script`: TRL's module, imported as installed, and the call (TP 1 only: at TP > 1 the
# shards are gathered by the adapter, not by TRL, and the script writer runs a non-tensor-parallel routine at TP 1).
HARNESS = dataclasses.replace(HARNESS, script={"name": "TRL", "files": {"tu": "trl.trainer.utils"},
                                               "kernel": trl_kernel, "how": "pip install trl"})


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over TRL: `(log_prob [T], entropy [T] or None)`, in the logits' dtype."""
    from trl.trainer import utils

    if log_prob_keep_mask is not None:
        raise NotImplementedError("TRL takes no keep mask (HARNESS_CAPABILITIES['keep_mask'] is False)")
    return trl_kernel(utils, gather_vocab(logits, tp_group), tokens, with_entropy, with_entropy_grad)
