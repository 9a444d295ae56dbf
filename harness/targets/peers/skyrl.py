"""SkyRL's Megatron log-probs and entropy (`distributed/megatron/model_utils.py`), as its Megatron worker composes them.

Kernel: the log-probs of the autograd functions that `from_parallel_logits_to_logprobs` dispatches
to once its targets are aligned (`DistributedLogprob`, or `ChunkedDistributedLogprob` when a chunk
size splits the rows: the dispatch rule of SkyRL #1650, `chunk_size < rows`; older commits chunk at
any size, and the adapter follows the commit: `_chunked`), and the entropy of
`vocab_parallel_entropy` on the same logits tensor, as the worker computes both from one model
output (the version-counter defect fixed by SkyRL #1650 lives in exactly that sharing). The
entropy's chunk size is passed where `vocab_parallel_entropy` takes one (SkyRL #1890 onwards).

The fused LM-head log-prob (SkyRL #1841) is the `skyrl_fused_linear` adapter.

SkyRL takes its TP group from megatron-core's `parallel_state` (the entropy) and as an argument
(the log-probs): the adapter checks the two are the one the harness asked for. No keep mask, no
metric-only entropy flag (autograd alone decides). CP: SkyRL's CP paths gather over a CP group with
packed-sequence bookkeeping that the kernel level does not reach; they are not checked here.

The file is loaded on its own (`_source`): SkyRL's package `__init__`s import its trainer (ray,
vLLM, hydra); `model_utils.py` itself needs torch and megatron-core only, so nothing is stubbed.
Its path moved from `skyrl-train/skyrl_train/...` to `skyrl/backends/skyrl_train/...` (SkyRL
#1139); both are searched.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import FLOAT16_OUTPUT_FP32, GPT_LOGITS_CONTIGUOUS, parallel_state_group
from harness.targets.peers._source import PeerSource, missing

HOW = ("git clone https://github.com/NovaSky-AI/SkyRL && export PYTHONPATH=$PWD/SkyRL:$PYTHONPATH "
       "(model_utils.py needs torch and megatron-core only)")
SOURCE = PeerSource("SkyRL", files=("skyrl/backends/skyrl_train/distributed/megatron/model_utils.py",
                                    "skyrl-train/skyrl_train/distributed/megatron/model_utils.py"),
                    markers=("skyrl/backends", "skyrl-train/skyrl_train"), how=HOW)
HARNESS = Declaration(
    capabilities={"keep_mask": False, "metric_only_entropy": False},
    peer=PeerInfo(requires=("megatron.core", "skyrl"), install=HOW, upstream=(
        "skyrl.backends.skyrl_train.distributed.megatron.model_utils.DistributedLogprob",
        "skyrl.backends.skyrl_train.distributed.megatron.model_utils.ChunkedDistributedLogprob",
        "skyrl.backends.skyrl_train.distributed.megatron.model_utils.vocab_parallel_entropy")),
    # What SkyRL's own caller makes (its Megatron worker's loss, `skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py`); the harness's
    # cases beyond it are findings beyond its use (harness.checks.use).
    use=[
        {"where": {"regime": "neginf"},
         "why": "skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:644-646, 696, 893-894: the log-probs and the entropy are computed from the model's logits "
                "(divided by the temperature); nothing masks them to -inf"},
        {"where": {"dtype": ["bf16", "fp16"]},
         "why": "skyrl/backends/skyrl_train/workers/megatron/megatron_worker.py:622-623 builds the model with megatron-bridge's "
                "`provider.provide_distributed_model(..., bf16=bf16)`, whose `get_model` wraps it in Float16Module when it runs "
                f"in bf16 or fp16: {FLOAT16_OUTPUT_FP32}, so the logits reach the routine in float32"},
        {"where": {"layout": "transposed"},
         "why": f"skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:696-697: the log-probs get the model's logits as they come, and the entropy a row slice of "
                f"them (:893); {GPT_LOGITS_CONTIGUOUS}: never a transposed view"},
    ],
)

_MU = SOURCE.load()  # None without SkyRL's tree on sys.path; RoutineMissing when this commit lacks the file
if _MU is not None:
    missing(SOURCE, _MU, "DistributedLogprob", "ChunkedDistributedLogprob", "vocab_parallel_entropy")


def _mu():
    return SOURCE.require(_MU)


def _chunked(mu, rows: int, chunk_size: int) -> bool:
    """Whether `from_parallel_logits_to_logprobs` of this commit takes the chunked function: since
    SkyRL #1650 only when the chunk splits the rows, before it whenever a chunk size is given."""
    if chunk_size <= 0:
        return False
    skips_short = "chunk_size < seq_len" in inspect.getsource(mu.from_parallel_logits_to_logprobs)
    return chunk_size < rows if skips_short else True


def _inference_only(x: torch.Tensor) -> bool:
    """SkyRL's flag as its worker sets it: True on the passes that take no gradient."""
    return not (torch.is_grad_enabled() and x.requires_grad)


def _group(tp_group):
    group = parallel_state_group(tp_group, "SkyRL's vocab_parallel_entropy")
    return group, dist.get_rank(group)


def _entropy(mu, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
    takes_chunk = "chunk_size" in inspect.signature(mu.vocab_parallel_entropy).parameters
    if takes_chunk and chunk_size > 0:
        return mu.vocab_parallel_entropy(logits, chunk_size=chunk_size)
    return mu.vocab_parallel_entropy(logits)


def skyrl_kernel(mu, logits, tokens, tp_group, with_entropy=False, chunk_size=-1):
    """SkyRL's call of `mu`, its `model_utils.py`, as its Megatron worker makes it: the logits as
    `[1, T, V_local]` (a view: the log-probs and the entropy share the caller's tensor), this rank's
    vocabulary range, `ChunkedDistributedLogprob` where the chunk splits the rows (the dispatch of
    SkyRL #1650 on; before it any chunk size chunked), `inference_only` on the passes without a
    gradient, and `vocab_parallel_entropy` (with the chunk size where it takes one, SkyRL #1890 on).
    Needs only torch and `mu`: `harness repro --script` embeds it."""
    x, t, start = logits.unsqueeze(0), tokens.reshape(1, -1).long(), torch.distributed.get_rank(tp_group) * logits.shape[1]
    end, inference_only = start + logits.shape[1], not (torch.is_grad_enabled() and logits.requires_grad)
    Fn, chunk = (mu.ChunkedDistributedLogprob, [chunk_size]) if 0 < chunk_size < len(logits) else (mu.DistributedLogprob, [])
    log_prob = Fn.apply(x, t, start, end, *chunk, tp_group, inference_only).reshape(-1)
    entropy = mu.vocab_parallel_entropy
    chunk = {"chunk_size": chunk_size} if chunk_size > 0 and "chunk_size" in entropy.__code__.co_varnames else {}
    return log_prob, entropy(x, **chunk).reshape(-1) if with_entropy else None


# `harness repro --script`: the file the call needs from SkyRL's tree, and the call itself.
HARNESS = dataclasses.replace(HARNESS, script={"name": "SkyRL", "files": {"mu": SOURCE.files}, "kernel": skyrl_kernel,
                                               "megatron": True, "how": HOW})


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over SkyRL: `(log_prob [T] float32, entropy [T] in the logits' dtype or None)`."""
    if log_prob_keep_mask is not None:
        raise NotImplementedError("SkyRL takes no keep mask (HARNESS_CAPABILITIES['keep_mask'] is False)")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V_local], got {tuple(logits.shape)}")
    mu = _mu()
    group, rank = _group(tp_group)
    v_local = logits.shape[1]
    start = rank * v_local
    # [1, T, V_local] as SkyRL's worker holds them: a view, so SkyRL sees the caller's tensor.
    x, target = logits.unsqueeze(0), tokens.reshape(1, -1).to(device=logits.device, dtype=torch.long)
    if _chunked(mu, logits.shape[0], chunk_size):
        log_prob = mu.ChunkedDistributedLogprob.apply(x, target, start, start + v_local, chunk_size, group,
                                                      _inference_only(logits))
    else:
        log_prob = mu.DistributedLogprob.apply(x, target, start, start + v_local, group, _inference_only(logits))
    entropy = _entropy(mu, x, chunk_size).reshape(-1) if with_entropy else None
    return log_prob.reshape(-1), entropy
