"""A routine that declares it computes no entropy, takes no keep mask and no context parallelism,
and raises if it is asked for any (or, declaring nothing about it, for half-precision wrapper logits):
a case-making path that ignores a capability shows up as a crash."""
import torch

from harness.targets import fused
from harness.targets.declaration import Declaration

HARNESS = Declaration(capabilities={"entropy": False, "keep_mask": False, "context_parallel": False})


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    if with_entropy or log_prob_keep_mask is not None:
        raise NotImplementedError("this routine computes no entropy and takes no keep mask")
    return fused.calculate_log_probs_and_entropy(logits, tokens, tp_group, chunk_size=chunk_size)


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None):
    if with_entropy or top_p_token_ids is not None or getattr(args, "allgather_cp", False) \
            or fused.ROUTINE.cp_info()[0] > 1 or logits.dtype != torch.float32:
        raise NotImplementedError("this routine computes no entropy and takes no top-p replay, no CP and "
                                  "float32 logits only")
    return fused.get_log_probs_and_entropy(logits, args=args, unconcat_tokens=unconcat_tokens,
                                           total_lengths=total_lengths, response_lengths=response_lengths)
