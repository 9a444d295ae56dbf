"""Unfused "before fusion" baseline: gather the full vocab, then plain float32 autograd.

Same two entry points as :mod:`harness.targets.fused`.  The Level 2 wrapper and its steps are
inherited from :class:`~harness.targets.fused.FusedLogProbEntropy`; only the kernel entry point
is replaced.  The vocab shards are all-gathered into ``[T, V]`` (an autograd Function whose
backward hands each rank the slice of the gradient for its own shard, with no reduction: the
loss is replicated on every rank), then ``torch.log_softmax`` / softmax run on the full rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration
from harness.targets.fused import FusedLogProbEntropy

__all__ = [
    "NaiveLogProbEntropy",
    "ROUTINE",
    "calculate_log_probs_and_entropy",
    "get_log_probs_and_entropy",
]


class _GatherVocab(torch.autograd.Function):
    """All-gather along the vocab (last) dim; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group, world, rank):
        ctx.rank, ctx.v_local = rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        a = ctx.rank * ctx.v_local
        return grad[..., a:a + ctx.v_local].contiguous(), None, None, None


class NaiveLogProbEntropy(FusedLogProbEntropy):
    """Unfused baseline: full-vocab float32 log_softmax with autograd."""

    def gather_vocab(self, x: torch.Tensor, group, world: int, rank: int) -> torch.Tensor:
        """The full ``[T, V]`` rows (differentiable w.r.t. the local shard)."""
        if world == 1:
            return x
        return _GatherVocab.apply(x, group, world, rank)

    def gather_mask(self, keep: torch.Tensor, group, world: int) -> torch.Tensor:
        """The full ``[T, V]`` keep mask (no gradient)."""
        if world == 1:
            return keep
        k = keep.to(torch.uint8).contiguous()
        parts = [torch.empty_like(k) for _ in range(world)]
        dist.all_gather(parts, k, group=group)
        return torch.cat(parts, dim=-1).bool()

    def full_entropy(self, full: torch.Tensor) -> torch.Tensor:
        """-sum p log p on full rows; p == 0 entries contribute 0 (and no NaN gradient)."""
        log_p = torch.log_softmax(full, dim=-1)
        p = log_p.exp()
        return -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(dim=-1)

    def calculate_log_probs_and_entropy(self, logits, tokens, tp_group, with_entropy=False,
                                        chunk_size=-1, log_prob_keep_mask=None,
                                        with_entropy_grad=True):
        if logits.dim() != 2:
            raise ValueError(f"logits must be [T, V_local], got {tuple(logits.shape)}")
        group, world, rank = self.group_info(tp_group)
        tokens = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
        num_rows = logits.shape[0]
        if num_rows == 0:
            world = 1  # nothing to gather: no collective, on every rank alike
        needs_grad = bool(logits.requires_grad and torch.is_grad_enabled())
        entropy_grad = self.entropy_differentiable(with_entropy, with_entropy_grad, needs_grad)

        x = logits.to(torch.float32)  # may alias float32 input: out-of-place ops only
        full = self.gather_vocab(x, group, world, rank)
        target = tokens.unsqueeze(-1)
        if log_prob_keep_mask is not None:
            keep = self.gather_mask(log_prob_keep_mask.to(device=logits.device, dtype=torch.bool),
                                    group, world)
            keep = keep.scatter(-1, target, True)  # out of place: the target is always kept
            lp_in = full.masked_fill(~keep, float("-inf"))
        else:
            lp_in = full
        log_prob = torch.log_softmax(lp_in, dim=-1).gather(-1, target).squeeze(-1)

        entropy = None
        if with_entropy:
            if entropy_grad:
                entropy = self.full_entropy(full)
            else:
                with torch.no_grad():
                    entropy = self.full_entropy(full.detach())
        return log_prob, entropy


# The "before fusion" design computes every row at once: its wrapper takes no chunk size to be held
# to (`memory-chunk-effect`), so its wrapper cases run unchunked; its kernel still gets every chunk
# size, a knob the contract lets it ignore.
HARNESS = Declaration(capabilities={"chunk_size": False})

ROUTINE = NaiveLogProbEntropy()
calculate_log_probs_and_entropy = ROUTINE.calculate_log_probs_and_entropy
get_log_probs_and_entropy = ROUTINE.get_log_probs_and_entropy
