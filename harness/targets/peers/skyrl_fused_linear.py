"""SkyRL's fused LM-head log-prob, `FusedLinearChunkedDistributedLogprob` (SkyRL #1841), at the fused-linear level.

`FusedLinearChunkedDistributedLogprob.apply(hidden [B, S, H], weight [V_local, H], target [B, S],
vocab_start, vocab_end, chunk_size, tp_group, inference_only)`: the log-prob of each row's target
from the decoder's hidden states and this rank's LM-head shard, the logits recomputed per sequence
chunk in a hand-written backward. The adapter hands it the case's hidden states as a `[1, T, H]`
view (`hidden.unsqueeze(0)`, as SkyRL's worker passes its `[B, S, H]` decoder output): a strided
hidden stays strided. `chunk_size <= 0` is one chunk of all rows.

The function returns each TP rank's share of the hidden states' gradient (its vocab shard's
`grad_logits @ weight`); SkyRL's worker sums the shares outside it: it runs Megatron with sequence
parallelism whenever TP > 1 (`provider.sequence_parallel = tp > 1`), and its output processor
all-gathers the hidden states with `gather_from_sequence_parallel_region(...,
tensor_parallel_output_grad=True)`, whose backward reduce-scatters that gradient over the TP group.
The harness hands every rank the whole (replicated) hidden states, so the adapter composes the
function with megatron-core's `copy_to_tensor_model_parallel_region` (identity forward, the same
sum in the backward), as Megatron's own output layer does without sequence parallelism.

Log-probs only (`HARNESS_CAPABILITIES["entropy"]` False): SkyRL's fused entropy
(`_fused_vocab_parallel_entropy_from_hidden`) is a metric written into a preallocated buffer that
SkyRL calls under `no_grad`; the contract's entropy is differentiable on request, so it is not
checked here. Commits before SkyRL #1841 have no fused routine: the adapter refuses them
(`untestable`). The file is loaded as the `skyrl` adapter loads it (nothing stubbed).
"""
from __future__ import annotations

import dataclasses

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import missing
from harness.targets.peers.skyrl import _MU, HOW, SOURCE, _group, _mu

HARNESS = Declaration(
    capabilities={"entropy": False, "keep_mask": False, "metric_only_entropy": False},
    peer=PeerInfo(requires=("megatron.core", "skyrl"), install=HOW, upstream=(
        "skyrl.backends.skyrl_train.distributed.megatron.model_utils.FusedLinearChunkedDistributedLogprob",)),
    # What SkyRL's own caller makes: the fused path
    # (`skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:664-676`) hands over the decoder's hidden states and the output layer's weight (:164). Under LoRA the
    # pre-wrap hook freezes every base parameter, the LM head included (a frozen head: in use), and
    # the adapters train in the decoder layers, so the hidden states always require grad.
    use=[
        {"where": {"frozen": "hidden"},
         "why": "skyrl/backends/skyrl_train/workers/megatron/adapter_store.py:44-50: under LoRA only the adapters of "
                "the decoder layers train (the base parameters, the LM head among them, are frozen), so the hidden "
                "states the fused head gets require grad; without LoRA every parameter trains: a frozen trunk under "
                "a trained head never happens"},
        {"where": {"T": 0},
         "why": "skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:666-668: the hidden states are "
                "those of a micro-batch's `[B, S]` sequences, padding included: never empty"},
    ],
)

if _MU is not None:
    missing(SOURCE, _MU, "FusedLinearChunkedDistributedLogprob")


def skyrl_fused(mu, hidden, weight, tokens, tp_group, with_entropy=False, chunk_size=-1):
    """SkyRL's call of its fused LM-head log-prob as its Megatron worker makes it: the decoder's
    `[1, T, H]` output, this rank's `[V_local, H]` head shard and its vocab range, the TP group, and
    `inference_only` on the passes without a gradient; at TP > 1 with megatron-core's
    `copy_to_tensor_model_parallel_region` around the hidden states (the sum of the ranks' hidden
    gradients that SkyRL's sequence-parallel gather does). `chunk_size <= 0`: one chunk of all rows.
    Needs only torch, megatron-core and `mu`, SkyRL's `model_utils.py`: `harness repro --script`
    embeds it."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    h, start = hidden.unsqueeze(0), torch.distributed.get_rank(tp_group) * weight.shape[0]  # h: a view of the caller's
    h = copy_to_tensor_model_parallel_region(h) if tp_group.size() > 1 and h.requires_grad else h  # caller's TP sum
    inference_only = not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad))
    return mu.FusedLinearChunkedDistributedLogprob.apply(
        h, weight, tokens.reshape(1, -1).long(), start, start + weight.shape[0],
        chunk_size if chunk_size > 0 else max(hidden.shape[0], 1), tp_group, inference_only).reshape(-1), None


# `harness repro --script`: the file the call needs from SkyRL's tree, and the call itself.
HARNESS = dataclasses.replace(HARNESS, script={"name": "SkyRL", "files": {"mu": SOURCE.files}, "linear": skyrl_fused,
                                               "megatron": True, "how": HOW})


def calculate_linear_log_probs_and_entropy(hidden, weight, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                           with_entropy_grad=True):
    """Fused-linear level over SkyRL: `(log_prob [T] float32, None)`."""
    if with_entropy:
        raise NotImplementedError("SkyRL's fused entropy is a no-grad metric (HARNESS_CAPABILITIES['entropy'] is False)")
    group, _ = _group(tp_group)
    return skyrl_fused(_mu(), hidden, weight, tokens, group, with_entropy, chunk_size)
