"""A correct `calculate_logsumexp` for the fifth level of `logsumexp.py` (importing it registers the
level wherever this target loads), and `BROKEN`, the same without the all-reduce of the shards' sums."""
import torch
import torch.distributed as dist

import tests.levels.logsumexp  # noqa: F401  (the level this routine belongs to)


def _lse(logits: torch.Tensor, tp_group, chunk_size: int, reduce: bool) -> torch.Tensor:
    """The value is the all-reduced log-sum-exp; the gradient on this rank's shard is the global
    softmax's columns, the derivative of sum(exp(x - lse)) on the shard (0 in value)."""
    parallel = reduce and tp_group is not None and dist.get_world_size(tp_group) > 1
    rows = []
    step = chunk_size if chunk_size > 0 else max(logits.shape[0], 1)
    for chunk in logits.float().split(step):
        top = chunk.detach().amax(-1, keepdim=True)
        if parallel:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
        total = (chunk.detach() - top).exp().sum(-1, keepdim=True)
        if parallel:
            dist.all_reduce(total, group=tp_group)
        lse = total.log() + top
        local = (chunk - lse).exp().sum(-1, keepdim=True)
        rows.append((lse + local - local.detach()).squeeze(-1))
    return torch.cat(rows) if rows else logits.new_zeros(0, dtype=torch.float32)


def calculate_logsumexp(logits: torch.Tensor, tp_group, chunk_size: int = -1) -> torch.Tensor:
    return _lse(logits, tp_group, chunk_size, reduce=True)
