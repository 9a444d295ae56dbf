"""A routine that never returns from its first call, on every rank, outside any collective: the
verdict must come from what the ranks are doing (their stacks), not from the start-up deadline."""
import time


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    while True:
        time.sleep(1.0)
