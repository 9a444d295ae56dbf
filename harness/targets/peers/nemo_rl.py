"""NeMo-RL's TP x CP log-probs (`nemo_rl/distributed/model_utils.py`), as its Megatron trainer calls them.

The wrapper level is `from_parallel_logits_to_logprobs_packed_sequences` (packed sequences, targets
rolled per sequence, `cu_seqlens_padded`, `tp_group`, `cp_group`, `chunk_size`); the kernel level is
the two autograd functions that it and `from_parallel_logits_to_logprobs` dispatch to once the
targets are aligned (`DistributedLogprob`, `ChunkedDistributedLogprob` when a chunk size is given).
They compute log-probs only: no entropy, no keep mask, and no top-p replay in slime's encoding
(NeMo-RL re-applies top-k/top-p from sampling parameters instead), so `HARNESS_CAPABILITIES` says so.

Context parallelism: NeMo-RL's layout is the load-balanced one (`_get_tokens_on_this_cp_rank`): each
sequence padded to a multiple of 2 * cp, cut into 2 * cp chunks, rank r holding chunks r and
2cp - 1 - r, sequence after sequence. That is the contract's zigzag layout row for row, so the
harness's local logits go to NeMo-RL as they are, with `cu_seqlens_padded` the padded sequence
boundaries. NeMo-RL all-gathers the log-probs over the CP group (`AllGatherCPTensor`) and returns
the whole sequence on every CP rank; the adapter hands back this rank's zigzag pieces of each
response, as the contract asks. It has no all-gather (contiguous) CP layout: with
`HARNESS_CAPABILITIES["allgather_cp"]` False the harness gives it such cases in the zigzag layout,
and a call with `args.allgather_cp` set is refused. Its CP backward moves an index to CUDA, so on
CPU its CP cases are drawn without autograd (`"cp_gradient": {"cpu": False}`): the CP forward is
checked there, the CP gradient on CUDA. `nemo_rl_unpacked` is the same wrapper
over `from_parallel_logits_to_logprobs`.

Past forms: before NeMo-RL's chunked log-probs (no `ChunkedDistributedLogprob`, no `chunk_size`
parameter, both looked up at the call) a chunk size is accepted and ignored, as NeMo-RL then did;
before sequence packing (no `from_parallel_logits_to_logprobs_packed_sequences`, read from the
tree's source at import by `defines`, without importing NeMo-RL) the adapter defines no wrapper
level (`nemo_rl_unpacked` checks the unpacked one).

NeMo-RL is not on the package index in a usable version; the module imports on CPU with torch
alone from a source tree on `PYTHONPATH` (`nemo_rl/__init__.py` needs no other package).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers import defines
from harness.targets.peers._mpu import GPT_LOGITS_CONTIGUOUS, NONCONTIGUOUS, parallel_state_group

# Its CP backward moves an index to CUDA (`AllGatherCPTensor.backward`): on CPU its CP cases run
# without autograd, which checks the CP forward on both paths (docs/peers.md).
# Its trainer hands the packed log-probs bf16 logits when it chunks (`nemo_rl/algorithms/loss/utils.py`).
HARNESS = Declaration(
    capabilities={"entropy": False, "keep_mask": False, "allgather_cp": False, "cp_gradient": {"cpu": False},
                  "wrapper_half_precision": True},
    peer=PeerInfo(
        requires=("nemo_rl.distributed.model_utils",),
        install="put a NeMo-RL source tree on PYTHONPATH: git clone https://github.com/NVIDIA-NeMo/RL nemo-rl "
                "&& export PYTHONPATH=$PWD/nemo-rl:$PYTHONPATH (torch alone runs its model_utils on CPU)",
        upstream=("nemo_rl.distributed.model_utils.from_parallel_logits_to_logprobs_packed_sequences",
                  "nemo_rl.distributed.model_utils.DistributedLogprob",
                  "nemo_rl.distributed.model_utils.ChunkedDistributedLogprob")),
    # What NeMo-RL's own caller makes: its Megatron trainer's log-prob processor (`nemo_rl/models/megatron/train.py:631-665`)
    # hands these functions the model's output as it comes. The harness's cases beyond it are
    # findings beyond its use (harness.checks.use).
    use=[
        {"where": {"layout": NONCONTIGUOUS},
         "why": f"nemo_rl/models/megatron/train.py:640-666: `output_tensor` is the model's output, passed as it comes; {GPT_LOGITS_CONTIGUOUS}"},
        {"where": {"T": 0},
         "why": "nemo_rl/models/megatron/train.py:628-629: the logits span the micro-batch's padded sequence length (`input_ids.shape[1]`), "
                "at least its longest sample: never empty"},
    ],
)


def _inference_only(logits: torch.Tensor) -> bool:
    """NeMo-RL's own flag, set as its trainer sets it: True for the log-prob passes that take no
    gradient (nothing is saved for a backward), False on the training path."""
    return not (torch.is_grad_enabled() and logits.requires_grad)


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over NeMo-RL's TP log-prob functions: `(log_prob [T] float32, None)`."""
    if with_entropy:
        raise NotImplementedError("NeMo-RL's log-prob functions compute no entropy "
                                  "(HARNESS_CAPABILITIES['entropy'] is False)")
    if log_prob_keep_mask is not None:
        raise NotImplementedError("NeMo-RL's log-prob functions take no keep mask "
                                  "(HARNESS_CAPABILITIES['keep_mask'] is False)")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V_local], got {tuple(logits.shape)}")
    if tp_group is None:
        if not dist.is_initialized():
            raise RuntimeError("NeMo-RL's log-prob functions all-reduce over a process group: "
                               "initialise torch.distributed")
        tp_group = dist.group.WORLD
    # Imported from the user's NeMo-RL tree (docs/peers.md), not from an installed package.
    from nemo_rl.distributed import model_utils  # pyright: ignore[reportMissingImports]

    return nemo_rl_kernel(model_utils, logits, tokens, tp_group, chunk_size)


def nemo_rl_kernel(mu, logits, tokens, tp_group, chunk_size=-1):
    """NeMo-RL's call of `mu`, its `nemo_rl/distributed/model_utils.py`, as its Megatron trainer makes
    it: the logits as `[1, T, V_local]` (a view, so the caller's tensor is what NeMo-RL sees), this
    rank's vocabulary range, `inference_only` set as its trainer sets it (True for the log-prob passes
    that take no gradient). Needs only torch: `harness repro --script` embeds it."""
    v_local = logits.shape[1]
    start = torch.distributed.get_rank(tp_group) * v_local
    x, target = logits.unsqueeze(0), tokens.reshape(1, -1).to(device=logits.device, dtype=torch.long)
    inference_only = not (torch.is_grad_enabled() and logits.requires_grad)
    if chunk_size > 0 and hasattr(mu, "ChunkedDistributedLogprob"):
        out = mu.ChunkedDistributedLogprob.apply(x, target, start, start + v_local, chunk_size, tp_group, inference_only)
    else:
        out = mu.DistributedLogprob.apply(x, target, start, start + v_local, tp_group, inference_only)
    return out.reshape(-1), None


def nemo_rl_packed(mu, logits, args, unconcat_tokens, total_lengths, response_lengths):
    """NeMo-RL's Megatron worker's packed log-probs at CP 1 (`from_parallel_logits_to_logprobs_packed_sequences`):
    the model's `[1, T, V_local]` output divided by the temperature (in place there, on its own tensor), the
    unrolled targets and sequence boundaries, this rank's vocabulary range, the chunk size where one is set;
    each sequence's response rows (row j: log p(token j + 1)). Needs torch and `mu`: `harness repro --script`
    embeds it."""
    from megatron.core import parallel_state as mpu

    v, chunk = logits.shape[-1], getattr(args, "log_probs_chunk_size", None) or -1
    cu = torch.tensor([0, *torch.tensor(total_lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    out = mu.from_parallel_logits_to_logprobs_packed_sequences(
        logits / (getattr(args, "rollout_temperature", None) or 1.0), torch.cat(unconcat_tokens).long()[None], cu,
        max(total_lengths), mpu.get_tensor_model_parallel_rank() * v, (mpu.get_tensor_model_parallel_rank() + 1) * v,
        mpu.get_tensor_model_parallel_group(), inference_only=False, chunk_size=chunk if chunk > 0 else None)
    return None, {"log_probs": [row[n - r - 1:n - 1] for row, n, r in zip(out, total_lengths, response_lengths, strict=True)]}


NEMO_RL_HOW = "git clone https://github.com/NVIDIA-NeMo/RL nemo-rl && export PYTHONPATH=$PWD/nemo-rl:$PYTHONPATH"
# `harness repro --script`: NeMo-RL's module, imported from the tree on PYTHONPATH, and the calls.
HARNESS = dataclasses.replace(HARNESS, script={"name": "NeMo-RL", "files": {"mu": "nemo_rl.distributed.model_utils"},
                                               "kernel": nemo_rl_kernel, "wrapper": nemo_rl_packed, "how": NEMO_RL_HOW})


def _padded(length: int, cp: int) -> int:
    """A sequence's length in NeMo-RL's packing: a multiple of 2 * cp under CP, as it is."""
    return length if cp == 1 else -(-length // (2 * cp)) * 2 * cp


def _zigzag_piece(row: torch.Tensor, first: int, end: int, padded: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's part of the response rows [first, end) of one sequence's whole log-probs `row`:
    the rows its chunk cp_rank holds, then those its chunk 2cp - 1 - cp_rank holds. Slices of `row`,
    so a rank without response rows still returns an empty piece on NeMo-RL's autograd graph."""
    if cp == 1:
        return row[first:end]
    size = padded // (2 * cp)
    parts = []
    for chunk in (cp_rank, 2 * cp - 1 - cp_rank):
        lo, hi = max(first, chunk * size), min(end, (chunk + 1) * size)
        parts.append(row[lo:max(lo, hi)])
    return torch.cat(parts)


def wrapper_call(logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy, top_p_token_ids,
                 top_p_token_offsets, sequence_rows: Callable[..., list[torch.Tensor]]):
    """The contract's wrapper over one of NeMo-RL's log-prob functions: TP and CP groups from
    megatron-core's `parallel_state`, as NeMo-RL's Megatron policy worker takes them.
    `sequence_rows(x, tokens, lengths, padded, call)` returns, per sequence, its log-probs `row`
    (`row[j]`: log p(token j + 1)), whole on every CP rank; `call` holds NeMo-RL's other arguments."""
    if with_entropy:
        raise NotImplementedError("NeMo-RL's log-probs compute no entropy (HARNESS_CAPABILITIES['entropy'] is False)")
    if top_p_token_ids is not None or top_p_token_offsets is not None:
        raise NotImplementedError("NeMo-RL has no top-p replay in slime's encoding "
                                  "(HARNESS_CAPABILITIES['keep_mask'] is False)")
    if getattr(args, "allgather_cp", False):
        raise NotImplementedError("NeMo-RL's context parallelism is load-balanced (zigzag) only "
                                  "(HARNESS_CAPABILITIES['allgather_cp'] is False)")
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must be [1, T, V_local], got {tuple(logits.shape)}")
    from megatron.core import parallel_state as mpu

    cp = mpu.get_context_parallel_world_size()
    lengths = [int(n) for n in total_lengths]
    padded = [_padded(n, cp) for n in lengths]
    temperature = getattr(args, "rollout_temperature", None)
    # NeMo-RL's worker divides its own model output in place (`logits.div_`); here the logits are
    # the caller's, which the contract keeps intact, so the division is out of place.
    x = logits if temperature is None or float(temperature) == 1.0 else logits / float(temperature)
    chunk = getattr(args, "log_probs_chunk_size", None)
    start = mpu.get_tensor_model_parallel_rank() * x.shape[-1]
    call = dict(vocab_start_index=start, vocab_end_index=start + x.shape[-1],
                inference_only=_inference_only(logits),
                cp_group=mpu.get_context_parallel_group() if cp > 1 else None,
                chunk_size=int(chunk) if chunk is not None and int(chunk) > 0 else None)
    tokens = [torch.as_tensor(t, device=logits.device).reshape(-1).to(torch.long) for t in unconcat_tokens]
    for toks, n in zip(tokens, lengths, strict=True):
        if toks.numel() != n:
            raise ValueError(f"sample has {toks.numel()} tokens, total_length says {n}")
    rows = sequence_rows(x, tokens, lengths, padded, call)
    pieces = []
    for row, n, r, p in zip(rows, lengths, response_lengths, padded, strict=True):
        first, end = (n - int(r) - 1, n - 1) if int(r) > 0 else (0, 0)  # the response's rows
        pieces.append(_zigzag_piece(row, first, end, p, cp, mpu.get_context_parallel_rank()))
    return torch.empty(0, device=logits.device), {"log_probs": pieces}


def as_taken(fn: Callable, call: dict) -> dict:
    """`call` as `fn` takes it: a commit from before NeMo-RL's chunked log-probs has no `chunk_size`
    parameter, and ignores chunking, as NeMo-RL then did."""
    if "chunk_size" in inspect.signature(fn).parameters:
        return call
    return {k: v for k, v in call.items() if k != "chunk_size"}


def _packed_rows(x: torch.Tensor, tokens: list[torch.Tensor], lengths: list[int], padded: list[int],
                 call: dict) -> list[torch.Tensor]:
    """One call of `from_parallel_logits_to_logprobs_packed_sequences` on the whole packed batch:
    targets unrolled, each sequence padded with 0 to its padded length (NeMo-RL rolls and CP-shards
    them itself), `cu_seqlens_padded` the padded boundaries."""
    # Imported from the user's NeMo-RL tree (docs/peers.md), not from an installed package.
    from nemo_rl.distributed.model_utils import from_parallel_logits_to_logprobs_packed_sequences  # pyright: ignore[reportMissingImports]

    target = torch.cat([torch.nn.functional.pad(t, (0, p - n)) for t, n, p in zip(tokens, lengths, padded, strict=True)]
                       or [torch.zeros(0, dtype=torch.long, device=x.device)]).unsqueeze(0)
    cu_seqlens_padded = torch.tensor([0, *torch.tensor(padded, dtype=torch.long).cumsum(0).tolist()],
                                     dtype=torch.int32, device=x.device)
    tp_group = parallel_state_group(None, "NeMo-RL's Megatron policy worker")
    out = from_parallel_logits_to_logprobs_packed_sequences(x, target, cu_seqlens_padded, max(lengths, default=1),
                                                            group=tp_group,
                                                            **as_taken(from_parallel_logits_to_logprobs_packed_sequences, call))
    return list(out)  # out[i, j]: log p(token j + 1 of sequence i)


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                              top_p_token_offsets=None):
    """Level 2 wrapper over `from_parallel_logits_to_logprobs_packed_sequences`."""
    return wrapper_call(logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                        top_p_token_ids, top_p_token_offsets, _packed_rows)


if defines("nemo_rl.distributed.model_utils", "from_parallel_logits_to_logprobs_packed_sequences") is False:
    del get_log_probs_and_entropy  # a commit before sequence packing: no packed wrapper to check
