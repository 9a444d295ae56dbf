"""A routine that declares it computes no entropy and takes no keep mask, and raises if it is asked
for either: any case-making path that ignores a declared capability shows up as a crash."""
from harness.targets import fused

HARNESS_CAPABILITIES = {"entropy": False, "keep_mask": False}


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    if with_entropy or log_prob_keep_mask is not None:
        raise NotImplementedError("this routine computes no entropy and takes no keep mask")
    return fused.calculate_log_probs_and_entropy(logits, tokens, tp_group, chunk_size=chunk_size)


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None):
    if with_entropy or top_p_token_ids is not None:
        raise NotImplementedError("this routine computes no entropy and takes no top-p replay")
    return fused.get_log_probs_and_entropy(logits, args=args, unconcat_tokens=unconcat_tokens,
                                           total_lengths=total_lengths, response_lengths=response_lengths)
