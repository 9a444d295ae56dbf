"""Control `gather`: all-gather each row chunk's full vocab, then plain float32 autograd.

The only custom autograd piece is the gather itself (backward hands back this rank's columns,
no reduction: the loss is replicated on every rank). The log-prob is `log_softmax` of the masked
full row (the masked shard is gathered, not the mask); the entropy is -sum(softmax * log_softmax)
of the unmasked full row. A metric-only entropy is computed under no_grad from a detached
gather, so it keeps no graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration
from tests.controls._common import Call, effective_keep, kernel_entry
from tests.controls._wrapper import make_wrapper


class _AllGatherCols(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group, world, start):
        ctx.cols = (start, shard.shape[-1])
        shard = shard.contiguous()
        out = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(out, shard, group=group)
        return torch.cat(out, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        a, n = ctx.cols
        return grad.narrow(-1, a, n).contiguous(), None, None, None


def _entropy(full: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(full, dim=-1)
    # log p is -inf where p == 0; zero it before the product so neither value nor grad is NaN.
    safe = torch.where(torch.isneginf(log_p), torch.zeros_like(log_p), log_p)
    return -(torch.softmax(full, dim=-1) * safe).sum(-1)


def _gathered(logits: torch.Tensor, call: Call) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    tokens, keep, group, world, start = call.tokens, call.keep, call.group, call.world, call.start
    with_entropy, ent_grad = call.with_entropy, call.ent_grad
    v_local = logits.shape[-1]

    def full_of(shard: torch.Tensor) -> torch.Tensor:
        return shard if world == 1 else _AllGatherCols.apply(shard, group, world, start)

    lps, ents = [], []
    for s, e in call.chunks:
        # Each chunk upcast on its own (may alias a float32 input: out-of-place ops only); a float32
        # copy of all the bf16 logits in front of the chunks is what memory-logits-dtype reports.
        x = logits[s:e].to(torch.float32)
        tgt = tokens[s:e]
        local = tgt - start
        own = (local >= 0) & (local < v_local)
        full = None
        if keep is None:
            full = full_of(x)
            lp_in = full
        else:
            lp_in = full_of(x.masked_fill(~effective_keep(keep[s:e], local, own), float("-inf")))
        lps.append(torch.log_softmax(lp_in, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1))
        if with_entropy and ent_grad:
            ents.append(_entropy(full if full is not None else full_of(x)))
        elif with_entropy:
            with torch.no_grad():
                ents.append(_entropy((full if full is not None else full_of(x)).detach()))
    # T == 0: no chunk, no collective on any rank; empties still follow the logits' autograd state.
    empty = lambda: logits.to(torch.float32).sum(-1)  # noqa: E731 - float32 empties, only when T == 0
    log_prob = torch.cat(lps) if lps else empty()
    entropy = None
    if with_entropy:
        entropy = torch.cat(ents) if ents else (empty() if ent_grad else empty().detach())
    return log_prob, entropy


calculate_log_probs_and_entropy = kernel_entry(_gathered)
get_log_probs_and_entropy = make_wrapper(calculate_log_probs_and_entropy)
# The shared wrapper hands bf16 and fp16 logits to the kernel as they are (docs/memory.md).
HARNESS = Declaration(capabilities={"wrapper_half_precision": True})
