"""Control `inplace_grad`: log-space merge of per-rank logsumexps; the saved softmax becomes the
gradient in place (the memory optimisation of slime #2144, written independently).

Forward per row chunk: each rank's `torch.logsumexp` of its shard (unmasked and masked), merged
across ranks in log space (all-reduce MAX of the local lses, then all-reduce SUM of
exp(local lse - max) with the target logit); the masked softmax exp(x - lse) is written into one
saved float32 [T, V_local] buffer; the entropy is -sum p (x - lse) (one more all-reduce SUM).
Backward scales, negates and adds the one-hot into that saved buffer in place and returns it
(cast only if the logits are not float32): no second [T, V_local] allocation.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration
from tests.controls._common import Call, effective_keep, kernel_entry
from tests.controls._wrapper import make_wrapper

NEG_INF = float("-inf")


def _reduce(t: torch.Tensor, op, group, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _global_lse(local_lses: torch.Tensor, extra: torch.Tensor, group, world: int):
    """log sum_r exp(lse_r) per row (rows of `local_lses`), plus `extra` summed over ranks."""
    top = _reduce(local_lses.clone(), dist.ReduceOp.MAX, group, world)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    summed = _reduce(torch.cat([torch.exp(local_lses - top), extra.unsqueeze(0)]), dist.ReduceOp.SUM,
                     group, world)
    return top + torch.log(summed[:-1]), summed[-1]


class _InplaceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, call: Call):
        tokens, keep, group, world, start = call.tokens, call.keep, call.group, call.world, call.start
        chunks, with_entropy, needs, ent_grad = call.chunks, call.with_entropy, call.needs, call.ent_grad
        num_rows, v_local = logits.shape
        q_all = torch.empty(num_rows, v_local, dtype=torch.float32, device=logits.device) if needs else None
        lps, lses, ents = [], [], []
        for s, e in chunks:
            x = logits[s:e].to(torch.float32)  # may alias a float32 input: out-of-place ops only
            local = tokens[s:e] - start
            own = (local >= 0) & (local < v_local)
            xm = None if keep is None else x.masked_fill(~effective_keep(keep[s:e], local, own), NEG_INF)
            picked = x.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
            local_lses = torch.stack([torch.logsumexp(t, dim=-1) for t in ([x] if xm is None else [x, xm])])
            lse2, xt = _global_lse(local_lses, torch.where(own, picked, torch.zeros_like(picked)), group, world)
            lse, lse_m = lse2[0], lse2[-1]
            lps.append(xt - lse_m)
            lses.append(lse)
            if q_all is not None:
                torch.exp((x if xm is None else xm) - lse_m.unsqueeze(-1), out=q_all[s:e])
            if with_entropy:
                log_p = x - lse.unsqueeze(-1)
                p = q_all[s:e] if q_all is not None and xm is None else torch.exp(log_p)
                plogp = torch.where(p > 0, p * log_p, torch.zeros_like(p)).sum(-1)
                ents.append(-_reduce(plogp, dist.ReduceOp.SUM, group, world))
        empty = logits.new_empty(0, dtype=torch.float32)
        cat = lambda xs: torch.cat(xs) if xs else empty.clone()  # noqa: E731
        log_prob = cat(lps)
        entropy = cat(ents) if with_entropy else None
        if entropy is not None and not ent_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.meta = (start, chunks, needs, ent_grad, keep is not None, logits.dtype)
        if ent_grad:
            ctx.save_for_backward(tokens, q_all, logits, cat(lses), entropy)
        else:
            ctx.save_for_backward(tokens, q_all)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor]):
        start, chunks, needs, ent_grad, masked, dtype = ctx.meta
        if not needs:
            return None, None
        tokens, q_all, *rest = ctx.saved_tensors
        v_local = q_all.shape[-1]
        for s, e in chunks:
            q = q_all[s:e]
            term = None
            if ent_grad and g_ent is not None:
                # Needs the softmax before q is overwritten below.
                logits, lse, ent = rest
                log_p = logits[s:e].to(torch.float32) - lse[s:e].unsqueeze(-1)
                p = torch.exp(log_p) if masked else q
                term = torch.where(p > 0, p * (log_p + ent[s:e].unsqueeze(-1)), torch.zeros_like(p))
                term.mul_(g_ent[s:e].to(torch.float32).unsqueeze(-1))
            if g_lp is None:
                q.zero_()
            else:
                w1 = g_lp[s:e].to(torch.float32)
                q.mul_(-w1.unsqueeze(-1))
                local = tokens[s:e] - start
                rows = ((local >= 0) & (local < v_local)).nonzero(as_tuple=True)[0]
                q.index_put_((rows, local[rows]), w1[rows], accumulate=True)
            if term is not None:
                q.sub_(term)
        return q_all.to(dtype), None


calculate_log_probs_and_entropy = kernel_entry(_InplaceGrad.apply)


get_log_probs_and_entropy = make_wrapper(calculate_log_probs_and_entropy)
# The shared wrapper hands bf16 and fp16 logits to the kernel as they are (docs/memory.md).
HARNESS = Declaration(capabilities={"wrapper_half_precision": True})
