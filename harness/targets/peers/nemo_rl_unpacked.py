"""NeMo-RL's unpacked TP x CP log-probs, `from_parallel_logits_to_logprobs`, one sequence per call.

As the `nemo_rl` adapter (same groups, layout, capabilities and pieces), through the function
NeMo-RL's Megatron worker calls when sequence packing is off: `[batch, seq // cp, V_local]` logits
in the load-balanced CP layout, unshifted `[batch, seq]` targets that it rolls, pads to
`seq // cp * cp` and CP-shards itself, and the whole `[batch, seq - 1]` log-probs on every CP rank.
NeMo-RL pads every sequence of a batch to one length; the contract's rows are each sequence padded
to its own multiple of 2 * cp, so the adapter calls it once per sequence (a batch of one) on that
sequence's rows, a view of the caller's logits. It has no kernel level of its own: the functions
it dispatches to are the `nemo_rl` adapter's kernel.

`harness peers` checks it at the `smoke` profile: below its wrapper it runs the same functions as
`nemo_rl`, which the matrix checks at `ci`; the corpus's wrapper and CP cases run at every profile.
"""
from __future__ import annotations

import dataclasses

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers import nemo_rl as packed
from harness.targets.peers._mpu import parallel_state_group

HARNESS = Declaration(
    capabilities=packed.HARNESS.capabilities,
    peer=PeerInfo(
        requires=("nemo_rl.distributed.model_utils",),
        install="put a NeMo-RL source tree on PYTHONPATH: git clone https://github.com/NVIDIA-NeMo/RL nemo-rl "
                "&& export PYTHONPATH=$PWD/nemo-rl:$PYTHONPATH (torch alone runs its model_utils on CPU)",
        upstream=("nemo_rl.distributed.model_utils.from_parallel_logits_to_logprobs",), profile="smoke"),
    # NeMo-RL's Megatron trainer hands this function the model's output as it hands it to `nemo_rl`'s.
    use=packed.HARNESS.use,
)



def nemo_rl_unpacked(mu, logits, args, unconcat_tokens, total_lengths, response_lengths):
    """NeMo-RL's Megatron worker without sequence packing, at CP 1 (`from_parallel_logits_to_logprobs`), one
    sequence a call: its rows of the model's output divided by the temperature, its unrolled tokens, this
    rank's vocabulary range, the chunk size where one is set; its response rows (row j: log p(token j + 1)).
    Needs torch and `mu`: `harness repro --script` embeds it."""
    from megatron.core import parallel_state as mpu

    v, chunk = logits.shape[-1], getattr(args, "log_probs_chunk_size", None) or -1
    x, rank, rows, start = logits / (getattr(args, "rollout_temperature", None) or 1.0), mpu.get_tensor_model_parallel_rank(), [], 0
    for toks, n, r in zip(unconcat_tokens, total_lengths, response_lengths, strict=True):
        out = mu.from_parallel_logits_to_logprobs(x[:, start:start + n], toks.long()[None], rank * v, (rank + 1) * v,
                                                  mpu.get_tensor_model_parallel_group(), inference_only=False,
                                                  chunk_size=chunk if chunk > 0 else None)
        rows, start = rows + [out[0, n - r - 1:n - 1]], start + n
    return None, {"log_probs": rows}


# `harness repro --script`: NeMo-RL's module, imported from the tree on PYTHONPATH, and the call.
HARNESS = dataclasses.replace(HARNESS, script={"name": "NeMo-RL", "files": {"mu": "nemo_rl.distributed.model_utils"},
                                               "wrapper": nemo_rl_unpacked, "how": packed.NEMO_RL_HOW})

def _per_sequence_rows(x: torch.Tensor, tokens: list[torch.Tensor], lengths: list[int], padded: list[int],
                       call: dict) -> list[torch.Tensor]:
    from megatron.core import parallel_state as mpu

    # Imported from the user's NeMo-RL tree (docs/peers.md), not from an installed package.
    from nemo_rl.distributed.model_utils import from_parallel_logits_to_logprobs  # pyright: ignore[reportMissingImports]

    cp = mpu.get_context_parallel_world_size()
    tp_group = parallel_state_group(None, "NeMo-RL's Megatron policy worker")
    rows, offset = [], 0
    for toks, p in zip(tokens, padded, strict=True):
        local = p // cp  # this rank's rows of the sequence: its two chunks under CP
        out = from_parallel_logits_to_logprobs(x[:, offset:offset + local], toks.unsqueeze(0), tp_group=tp_group,
                                               **packed.as_taken(from_parallel_logits_to_logprobs, call))
        rows.append(out[0])  # out[0, j]: log p(token j + 1)
        offset += local
    return rows


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                              top_p_token_offsets=None):
    """Level 2 wrapper over `from_parallel_logits_to_logprobs`, a batch of one sequence per call."""
    return packed.wrapper_call(logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                        top_p_token_ids, top_p_token_offsets, _per_sequence_rows)
