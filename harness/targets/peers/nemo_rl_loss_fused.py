"""NeMo-RL's loss-side caller with `sequence_packing.fuse_loss` on: `LossPostProcessor` through `SequencePackingFusionLossWrapper` and `prepare_packed_loss_input`, one packed call for the micro-batch.

Everything else as `nemo_rl_loss` (its docstring says what NeMo-RL's code decides and what the
adapter supplies): the same configuration built from the case, with `fuse_loss` set, so that
`prepare_packed_loss_input` decides the dtype the packed logits reach
`from_parallel_logits_to_logprobs_packed_sequences` in, and whether the chunk size reaches it.
"""
from __future__ import annotations

import dataclasses

from harness.targets.declaration import PeerInfo
from harness.targets.peers import bound_names, nemo_rl_loss
from harness.targets.peers._source import RoutineMissing
from harness.targets.peers.nemo_rl_loss import SOURCE, caller_call

HARNESS = dataclasses.replace(nemo_rl_loss.HARNESS, peer=PeerInfo(
    requires=("megatron.core", "nemo_rl"), install=nemo_rl_loss.HOW, upstream=(
        "nemo_rl.models.megatron.train.LossPostProcessor",
        "nemo_rl.algorithms.loss.utils.prepare_packed_loss_input",
        "nemo_rl.algorithms.loss.wrapper.SequencePackingFusionLossWrapper")))


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                              top_p_token_offsets=None):
    """Level 2: NeMo-RL's `LossPostProcessor` on a packed micro-batch, `fuse_loss` on."""
    return caller_call(logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                       top_p_token_ids, top_p_token_offsets, fuse_loss=True)


_ROOTS = SOURCE.roots()
if _ROOTS and (_ROOTS[0] / SOURCE.files[0]).is_file() and "SequencePackingFusionLossWrapper" not in bound_names(
        (_ROOTS[0] / SOURCE.files[0]).read_text(encoding="utf-8", errors="replace")):  # a commit before fuse_loss
    raise RoutineMissing(f"NeMo-RL's {SOURCE.files[0]} imports no SequencePackingFusionLossWrapper: a commit before "
                         "sequence packing's fuse_loss")
