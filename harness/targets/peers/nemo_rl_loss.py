"""NeMo-RL's own loss-side caller (`LossPostProcessor`, `nemo_rl/models/megatron/train.py`), as its Megatron policy worker runs it on a packed micro-batch.

The wrapper level only, and NeMo-RL's code all the way: the worker's temperature scaling of the
model's output (`apply_temperature_scaling`), then a `LossPostProcessor` built from the policy
configuration the case makes (`sequence_packing.enabled`, `sequence_packing.fuse_loss`,
`logprob_chunk_size` from `args.log_probs_chunk_size`, `TrainingSamplingParams` with the rollout
temperature), called with megatron-core's `PackedSeqParams` and handed the logits. From there
NeMo-RL decides everything: its sequence-packing wrapper slices each sequence
(`SequencePackingLossWrapper`, the default) or computes the packed batch at once
(`SequencePackingFusionLossWrapper`, `fuse_loss`: the `nemo_rl_loss_fused` adapter), its
`prepare_loss_input` / `prepare_packed_loss_input` decide the dtype the logits reach the kernel in
and whether the chunk size reaches it, and `model_utils.py` computes the log-probs. The loss
function handed to it is the one piece of the adapter's own: a `LossFunction` of input type
`LOGPROB` that keeps the `next_token_logprobs` NeMo-RL prepared for it, from which the adapter
takes each sample's response rows (row j: log p(token j + 1)). Log-probs only, as NeMo-RL's
policy loss takes them (no entropy, no keep mask).

The worker divides its model's output by the temperature in place; a model's output is the
worker's own tensor, the harness's logits are the caller's, so the division gets a copy of them
in their dtype when it divides (a temperature other than 1; before NeMo-RL #2053, whenever the
configuration has its `generation` section): NeMo-RL's code divides the copy, as it would the
model's output. Before #2053 the temperature is read from the configuration
(`generation.temperature`), after it from `TrainingSamplingParams`; the adapter builds whichever
the commit's functions take. The logits reach the caller in bf16 when the configuration chunks
(`nemo_rl/models/megatron/setup.py:1236-1245` asserts `defer_fp32_logits` with
`logprob_chunk_size`), in float32 otherwise.

Every name is found in NeMo-RL's own files (`PeerSource.find`), each resolved from its file's top
level: megatron-core and torch only. Commits before `LossPostProcessor` (the worker's loss was a
closure inside `megatron_policy_worker.py`) define none: `harness history` marks them untestable.
Context parallelism is not driven here (NeMo-RL's CP backward needs CUDA; the CP forward is the
`nemo_rl` adapter's).
"""
from __future__ import annotations

from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import GPT_LOGITS_CONTIGUOUS, NONCONTIGUOUS
from harness.targets.peers._source import PeerSource, RoutineMissing

HOW = ("git clone https://github.com/NVIDIA-NeMo/RL nemo-rl && export PYTHONPATH=$PWD/nemo-rl:$PYTHONPATH "
       "(its loss-side files need torch and megatron-core only)")
SOURCE = PeerSource("NeMo-RL", files=("nemo_rl/models/megatron/train.py",), markers=("nemo_rl",), how=HOW)

HARNESS = Declaration(
    capabilities={"entropy": False, "keep_mask": False, "context_parallel": False, "wrapper_half_precision": True},
    peer=PeerInfo(requires=("megatron.core", "nemo_rl"), install=HOW, upstream=(
        "nemo_rl.models.megatron.train.LossPostProcessor",
        "nemo_rl.models.megatron.train.apply_temperature_scaling",
        "nemo_rl.algorithms.loss.utils.prepare_loss_input",
        "nemo_rl.algorithms.loss.wrapper.SequencePackingLossWrapper")),
    script={"none": "NeMo-RL's post-processor spans several of its files (train.py, algorithms/loss/, the packing "
                    "wrappers) whose imports need pydantic and the rest of NeMo-RL's stack, which the adapter avoids by "
                    "compiling each definition alone (harness.targets.peers._source); the `nemo_rl` and `nemo_rl_unpacked` "
                    "adapters' scripts call its log-prob functions as this post-processor does"},
    use=[
        {"where": {"layout": NONCONTIGUOUS},
         "why": "nemo_rl/models/megatron/train.py:287-336: `output_tensor` is the model's output, scaled in place and handed to "
                f"the post-processor as it comes; {GPT_LOGITS_CONTIGUOUS}"},
        {"where": {"dtype": ["bf16", "fp16"], "chunk_size": [-1, 0]},
         "why": "nemo_rl/models/megatron/setup.py:1236-1245: `defer_fp32_logits` (bf16 logits into the loss) is asserted only "
                "with `logprob_chunk_size`; without it Megatron's Float16Module hands the loss float32 logits"},
    ],
)

FUSE_LOSS = False  # `sequence_packing.fuse_loss`: `nemo_rl_loss_fused` sets True


def _found() -> dict[str, Any] | None:
    """NeMo-RL's pieces, each from its own file, resolved once at import (a megatron-core import
    warns: outside any call, so the `warning` check sees only the routine's own)."""
    post = SOURCE.find("LossPostProcessor")
    if post is None:
        return None
    names = post.__call__.__globals__
    if "prepare_loss_input" not in post.__call__.__code__.co_names:
        raise RoutineMissing("NeMo-RL's LossPostProcessor of this commit calls no prepare_loss_input: before #1920 "
                             "the loss function computed its own log-probs from the logits")
    prepare = names["prepare_loss_input"]
    try:  # NeMo-RL #2053 on: the temperature and top-k/top-p as `TrainingSamplingParams`
        sampling = names["TrainingSamplingParams"]
    except KeyError:  # before it: the policy configuration's `generation.temperature`
        sampling = None
    return {"LossPostProcessor": post, "apply_temperature_scaling": SOURCE.find("apply_temperature_scaling"),
            "BatchedDataDict": names["BatchedDataDict"], "TrainingSamplingParams": sampling,
            "PackedSeqParams": names["PackedSeqParams"], "LOGPROB": prepare.__globals__["LossInputType"].LOGPROB}


_NEMO = _found()


class _KeepLogprobs:
    """The loss function NeMo-RL's post-processor wraps: it keeps what NeMo-RL prepared for it."""

    def __init__(self, input_type: Any):
        self.input_type = input_type
        self.seen: list[torch.Tensor] = []

    def __call__(self, next_token_logprobs: torch.Tensor, data: Any, global_valid_seqs: Any, global_valid_toks: Any,
                 **_: Any) -> tuple[torch.Tensor, dict]:
        self.seen.append(next_token_logprobs)
        return next_token_logprobs.new_zeros(()), {}


def _config(args: Any, fuse_loss: bool, temperature: float) -> dict:
    """The policy configuration NeMo-RL's worker hands `LossPostProcessor` (the keys it reads)."""
    chunk = getattr(args, "log_probs_chunk_size", None)
    return {"sequence_packing": {"enabled": True, "fuse_loss": fuse_loss}, "generation": {"temperature": temperature},
            "logprob_chunk_size": int(chunk) if chunk is not None and int(chunk) > 0 else None}


def caller_call(logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy, top_p_token_ids,
                top_p_token_offsets, fuse_loss: bool):
    """The contract's wrapper over NeMo-RL's post-processor, with sequence packing's `fuse_loss` as given."""
    if with_entropy:
        raise NotImplementedError("NeMo-RL's policy loss takes log-probs only (HARNESS_CAPABILITIES['entropy'] is False)")
    if top_p_token_ids is not None or top_p_token_offsets is not None:
        raise NotImplementedError("NeMo-RL has no top-p replay in slime's encoding (HARNESS_CAPABILITIES['keep_mask'] is False)")
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must be [1, T, V_local], got {tuple(logits.shape)}")
    nemo = SOURCE.require(_NEMO)
    lengths = [int(n) for n in total_lengths]
    tokens = [torch.as_tensor(t, device=logits.device).reshape(-1).to(torch.long) for t in unconcat_tokens]
    input_ids = torch.zeros(len(lengths), max(lengths, default=1), dtype=torch.long, device=logits.device)
    for i, (toks, n) in enumerate(zip(tokens, lengths, strict=True)):
        if toks.numel() != n:
            raise ValueError(f"sample has {toks.numel()} tokens, total_length says {n}")
        input_ids[i, :n] = toks
    token_mask = (torch.arange(input_ids.shape[1], device=logits.device) < torch.tensor(lengths, device=logits.device)
                  .unsqueeze(1)).to(torch.float32)
    data = nemo["BatchedDataDict"]({"input_ids": input_ids, "token_mask": token_mask,
                                    "sample_mask": torch.ones(len(lengths), device=logits.device)})
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32,
                      device=logits.device)
    packed = nemo["PackedSeqParams"](qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                     cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths, default=1),
                                     max_seqlen_kv=max(lengths, default=1))
    given = getattr(args, "rollout_temperature", None)
    temperature = 1.0 if given is None else float(given)
    cfg = _config(args, fuse_loss, temperature)
    # The sampling parameters where this commit's worker has them (#2053 on), else its configuration.
    sampling = nemo["TrainingSamplingParams"](temperature=temperature) if nemo["TrainingSamplingParams"] else None
    # The worker's model output is its own: NeMo-RL scales a copy of the caller's logits in place (before
    # #2053 it divides whenever the configuration has a `generation` section, as a policy's always has).
    output = logits.clone() if temperature != 1.0 or sampling is None else logits
    output = nemo["apply_temperature_scaling"](output, sampling if sampling is not None else cfg)
    keep = _KeepLogprobs(nemo["LOGPROB"])
    post = nemo["LossPostProcessor"](loss_fn=keep, cfg=cfg, num_microbatches=1,
                                     **({"sampling_params": sampling} if sampling is not None else {}))
    post(data_dict=data, packed_seq_params=packed, global_valid_seqs=torch.tensor(float(len(lengths))),
         global_valid_toks=torch.tensor(float(sum(lengths))))(output)
    # One [1, L - 1] tensor per sequence, or (fused) one [B, S - 1] for the whole micro-batch.
    rows = list(keep.seen[0]) if fuse_loss else [lp.reshape(-1) for lp in keep.seen]
    pieces = []
    for row, n, r in zip(rows, lengths, response_lengths, strict=True):
        first, end = (n - int(r) - 1, n - 1) if int(r) > 0 else (0, 0)
        pieces.append(row[first:end])
    return torch.empty(0, device=logits.device), {"log_probs": pieces}


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                              top_p_token_offsets=None):
    """Level 2: NeMo-RL's `LossPostProcessor` on a packed micro-batch, `fuse_loss` off (its default)."""
    return caller_call(logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                       top_p_token_ids, top_p_token_offsets, FUSE_LOSS)
