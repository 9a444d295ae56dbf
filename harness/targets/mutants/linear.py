"""Fused-linear defects (docs/fused-linear.md): each class overrides one step of the built-in
fused-linear routine, and is checked at the linear level only.

Named for the level it breaks, as `reference/linear.py` computes that level: a level keeps one module
name across the layers."""
from __future__ import annotations

import torch

from harness.targets.fused import FusedLinearLogProbEntropy as Linear
from harness.targets.mutants import mutant

LINEAR = ("linear",)
TP_ONLY = (2, 4)  # a collective or sharding defect is invisible on a single rank


@mutant("linear-grad-hidden-not-reduced", "hidden-state gradient not all-reduced over TP", ("gradients",),
        "Megatron's column-parallel backward: each rank's G W is a partial sum over its vocab shard",
        tp=TP_ONLY, levels=LINEAR)
class GradHiddenNotReduced(Linear):
    def reduce_grad_hidden(self, grad_hidden, group):
        return grad_hidden  # the local shard's partial sum only


@mutant("linear-weight-grad-wrong-shard", "weight gradient with the targets of shard 0", ("gradients",),
        "ms-swift #9947 (non-owner shards' gradients)", tp=TP_ONLY, levels=LINEAR)
class WeightGradWrongShard(Linear):
    def grad_targets(self, tokens, start):
        return tokens  # every rank places the target's one-hot as if it owned the first shard


@mutant("linear-logits-saved", "the [T, V_local] logits kept for backward", ("memory-linear-retained",),
        "the O(T*V) memory fusing the LM head exists to avoid", levels=LINEAR)
class LogitsSaved(Linear):
    def linear_forward(self, ctx, hidden, weight, tokens, tp_group, with_entropy, chunk_size, needs_grad,
                       entropy_grad):
        out = super().linear_forward(ctx, hidden, weight, tokens, tp_group, with_entropy, chunk_size,
                                     needs_grad, entropy_grad)
        if needs_grad:
            # "Saves a recompute": the float32 logits of every row, alive until backward.
            ctx.logits = self.chunk_logits(hidden, self.upcast(weight))
        return out


@mutant("linear-entropy-grad-kept", "entropy differentiable although with_entropy_grad=False", ("grad-flags",),
        "slime #2153 (metric-only entropy kept its gradient)", levels=LINEAR)
class EntropyGradKept(Linear):
    def entropy_differentiable(self, with_entropy, with_entropy_grad, requires_grad):
        return bool(with_entropy and requires_grad)


@mutant("linear-bf16-matmul", "logits from a bf16 matmul (bf16 rounding of the products' sum)", ("values",),
        levels=LINEAR)
class Bf16Matmul(Linear):
    def chunk_logits(self, hidden_rows, weight32):
        return (hidden_rows.to(torch.bfloat16) @ weight32.to(torch.bfloat16).T).float()


@mutant("linear-weight-grad-last-chunk", "weight gradient of the last row chunk only (overwritten, not summed)",
        ("chunk-invariance", "gradients"), levels=LINEAR)
class WeightGradLastChunk(Linear):
    def accumulate_weight_grad(self, grad_weight, g, h):
        grad_weight.copy_(g.T @ h)


@mutant("linear-hidden-modified-in-place", "hidden states scaled in place", ("input-integrity",),
        "Megatron-LM #1594 (.float() aliases float32 inputs, so in-place ops reach the caller's tensor)",
        levels=LINEAR)
class HiddenModifiedInPlace(Linear):
    def chunk_logits(self, hidden_rows, weight32):
        h = self.upcast(hidden_rows)  # the caller's rows themselves for float32 hidden states
        return h.mul_(1.0) @ weight32.T  # a "temperature" of 1 applied in place: values kept, version bumped
