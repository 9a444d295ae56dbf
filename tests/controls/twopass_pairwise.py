"""Control `twopass_pairwise`: two passes, every vocab sum an explicit pairwise tree in float32.

Pass 1: row max (all-reduce MAX of the stacked unmasked / masked maxima). Pass 2: per-rank tree
sums of exp(x - max) and the target logit (one all-reduce SUM), giving the log-softmax
x - lse; the entropy is then -tree_sum(exp(lsm) * lsm) (one more all-reduce SUM). What backward
needs is the masked log-softmax itself (saved, float32 [T, V_local]), not the softmax; the
unmasked one is recomputed from the logits only when the entropy is differentiable and a mask
made the two differ.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration
from tests.controls._common import Call, effective_keep, kernel_entry
from tests.controls._wrapper import make_wrapper

NEG_INF = float("-inf")


def tree_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by pairwise halving (odd widths carry their last column up)."""
    while t.shape[-1] > 1:
        half = t.shape[-1] // 2
        paired = t[..., :half] + t[..., half:2 * half]
        t = torch.cat([paired, t[..., 2 * half:]], dim=-1) if t.shape[-1] % 2 else paired
    return t[..., 0] if t.shape[-1] else t.new_zeros(t.shape[:-1])


def _reduce(t: torch.Tensor, op, group, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _finite(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _plogp(lsm: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(lsm), torch.zeros_like(lsm), torch.exp(lsm) * lsm)


class _TwoPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, call: Call):
        tokens, keep, group, world, start = call.tokens, call.keep, call.group, call.world, call.start
        chunks, with_entropy, needs, ent_grad = call.chunks, call.with_entropy, call.needs, call.ent_grad
        num_rows, v_local = logits.shape
        saved = torch.empty(num_rows, v_local, dtype=torch.float32, device=logits.device) if needs else None
        lps, lses, ents = [], [], []
        for s, e in chunks:
            x = logits[s:e].to(torch.float32)  # may alias a float32 input: out-of-place ops only
            local = tokens[s:e] - start
            own = (local >= 0) & (local < v_local)
            xm = None if keep is None else x.masked_fill(~effective_keep(keep[s:e], local, own), NEG_INF)
            both = [x] if xm is None else [x, xm]
            m = _finite(_reduce(torch.stack([t.amax(-1) for t in both]), dist.ReduceOp.MAX, group, world))
            picked = x.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
            sums = [tree_sum(torch.exp(t - m[i].unsqueeze(-1))) for i, t in enumerate(both)]
            sums.append(torch.where(own, picked, torch.zeros_like(picked)))
            sums = _reduce(torch.stack(sums), dist.ReduceOp.SUM, group, world)
            lse = m[0] + torch.log(sums[0])
            lse_m = lse if xm is None else m[1] + torch.log(sums[1])
            lps.append(sums[-1] - lse_m)
            lses.append(lse)
            if saved is not None:
                torch.sub(x if xm is None else xm, lse_m.unsqueeze(-1), out=saved[s:e])
            if with_entropy:
                lsm = saved[s:e] if saved is not None and xm is None else x - lse.unsqueeze(-1)
                ents.append(-_reduce(tree_sum(_plogp(lsm)), dist.ReduceOp.SUM, group, world))
        empty = logits.new_empty(0, dtype=torch.float32)
        cat = lambda xs: torch.cat(xs) if xs else empty.clone()  # noqa: E731
        log_prob = cat(lps)
        entropy = cat(ents) if with_entropy else None
        if entropy is not None and not ent_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.meta = (start, chunks, needs, ent_grad, keep is not None)
        ctx.logits_dtype = logits.dtype
        if ent_grad:
            ctx.save_for_backward(tokens, saved, logits, cat(lses), entropy)
        else:
            ctx.save_for_backward(tokens, saved)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor]):
        start, chunks, needs, ent_grad, masked = ctx.meta
        if not needs:
            return None, None
        tokens, saved, *rest = ctx.saved_tensors
        grad = torch.empty(saved.shape, dtype=ctx.logits_dtype, device=saved.device)
        v_local = saved.shape[-1]
        for s, e in chunks:
            lsm_m = saved[s:e]
            local = tokens[s:e] - start
            own = (local >= 0) & (local < v_local)
            g = torch.zeros_like(lsm_m)
            if g_lp is not None:
                w1 = g_lp[s:e].to(torch.float32)
                g = -w1.unsqueeze(-1) * torch.exp(lsm_m)
                rows = own.nonzero(as_tuple=True)[0]
                g[rows, local[rows]] += w1[rows]
            if ent_grad and g_ent is not None:
                logits, lse, ent = rest
                log_p = logits[s:e].to(torch.float32) - lse[s:e].unsqueeze(-1) if masked else lsm_m
                term = torch.where(torch.isneginf(log_p), torch.zeros_like(log_p),
                                   torch.exp(log_p) * (log_p + ent[s:e].unsqueeze(-1)))
                g = g - g_ent[s:e].to(torch.float32).unsqueeze(-1) * term
            grad[s:e] = g.to(grad.dtype)
        return grad, None


calculate_log_probs_and_entropy = kernel_entry(_TwoPass.apply)


get_log_probs_and_entropy = make_wrapper(calculate_log_probs_and_entropy)
# The shared wrapper hands bf16 and fp16 logits to the kernel as they are (docs/memory.md).
HARNESS = Declaration(capabilities={"wrapper_half_precision": True})
