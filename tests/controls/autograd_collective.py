"""Control `autograd_collective`: no custom math backward; autograd runs through a
differentiable all-reduce SUM.

Per row chunk: the row max is all-reduced (MAX) on detached values, so it is a constant; the
per-rank partials (sum exp(x - max), masked sum, target logit) go through one differentiable
all-reduce SUM whose backward is the identity (every rank computes the same replicated loss, so
each rank's partial enters it exactly once: no reduction of the gradient). The entropy
-sum p log p takes a second differentiable all-reduce, and the replicated lse it reads enters
through the converse (identity forward, all-reduce SUM backward); a metric-only entropy is
computed under no_grad from detached values.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration
from tests.controls._common import Call, effective_keep, kernel_entry
from tests.controls._wrapper import make_wrapper

NEG_INF = float("-inf")


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group, world):
        out = t.clone()
        if world > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ReplicatedIntoShards(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ranks. A replicated value (the lse) that
    enters every rank's shard-local partials gets gradient from all of them, but each rank only
    sees its own: without this sum the entropy gradient misses the other shards' terms at TP > 1."""

    @staticmethod
    def forward(ctx, t, group, world):
        ctx.comm = (group, world)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        group, world = ctx.comm
        grad = grad.clone()
        if world > 1:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return grad, None, None


def _entropy(x: torch.Tensor, lse: torch.Tensor, group, world: int) -> torch.Tensor:
    if torch.is_grad_enabled() and lse.requires_grad:
        lse = _ReplicatedIntoShards.apply(lse, group, world)
    log_p = x - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    # Zero log p where p == 0 before multiplying: 0 * -inf would poison value and gradient.
    safe = torch.where(p > 0, log_p, torch.zeros_like(log_p))
    return -_SumOverRanks.apply((p * safe).sum(-1), group, world)


def _through_autograd(logits: torch.Tensor, call: Call) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    tokens, keep, group, world, start = call.tokens, call.keep, call.group, call.world, call.start
    with_entropy, ent_grad = call.with_entropy, call.ent_grad
    v_local = logits.shape[-1]
    lps, ents = [], []
    for s, e in call.chunks:
        # Each chunk upcast on its own (may alias a float32 input: out-of-place ops only); a float32
        # copy of all the bf16 logits in front of the chunks is what memory-logits-dtype reports.
        x = logits[s:e].to(torch.float32)
        local = tokens[s:e] - start
        own = (local >= 0) & (local < v_local)
        xm = None if keep is None else x.masked_fill(~effective_keep(keep[s:e], local, own), NEG_INF)
        both = [x] if xm is None else [x, xm]
        with torch.no_grad():
            m = torch.stack([t.amax(-1) for t in both])
            if world > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        picked = x.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
        parts = [torch.exp(t - m[i].unsqueeze(-1)).sum(-1) for i, t in enumerate(both)]
        parts.append(torch.where(own, picked, torch.zeros_like(picked)))
        sums = _SumOverRanks.apply(torch.stack(parts), group, world)
        lse = m[0] + torch.log(sums[0])
        lse_m = m[-1] + torch.log(sums[-2])
        lps.append(sums[-1] - lse_m)
        if with_entropy and ent_grad:
            ents.append(_entropy(x, lse, group, world))
        elif with_entropy:
            with torch.no_grad():
                ents.append(_entropy(x.detach(), lse.detach(), group, world))
    # T == 0: no chunk, no collective on any rank; empties still follow the logits' autograd state.
    empty = lambda: logits.to(torch.float32).sum(-1)  # noqa: E731 - float32 empties, only when T == 0
    log_prob = torch.cat(lps) if lps else empty()
    entropy = None
    if with_entropy:
        entropy = torch.cat(ents) if ents else (empty() if ent_grad else empty().detach())
    return log_prob, entropy


calculate_log_probs_and_entropy = kernel_entry(_through_autograd)
get_log_probs_and_entropy = make_wrapper(calculate_log_probs_and_entropy)
# The shared wrapper hands bf16 and fp16 logits to the kernel as they are (docs/memory.md).
HARNESS = Declaration(capabilities={"wrapper_half_precision": True})
