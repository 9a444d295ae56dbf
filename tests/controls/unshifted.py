"""Control `unshifted`: entropy as lse - sum(p * x) on the unshifted logits.

Forward per row chunk: one MAX all-reduce of the stacked (max, masked max) rows, one SUM
all-reduce of the stacked (sum e, sum e*x, target logit, masked sum e) partials, with
e = exp(x - max). The entropy is lse - (sum e*x) / (sum e): the max only stabilises exp, it is
never subtracted from x in the entropy sum. Nothing [T, V_local]-sized is saved: backward
recomputes both softmaxes from the caller's logits and the saved log-sum-exps.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration
from tests.controls._common import Call, chunk_inputs, kernel_entry
from tests.controls._wrapper import make_wrapper

NEG_INF = float("-inf")


def _reduce(t: torch.Tensor, op, group, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _Unshifted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, call: Call):
        tokens, keep, group, world, start = call.tokens, call.keep, call.group, call.world, call.start
        chunks, with_entropy, ent_grad = call.chunks, call.with_entropy, call.ent_grad
        lps, lses, lse_ms, ents = [], [], [], []
        for s, e in chunks:
            x, local, own, xm = chunk_inputs(logits, tokens, keep, s, e, start)
            picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
            xt = torch.where(own, picked, torch.zeros_like(picked))
            maxes = torch.stack([x.amax(-1)] + ([] if xm is None else [xm.amax(-1)]))
            maxes = _reduce(maxes, dist.ReduceOp.MAX, group, world)
            m = torch.where(torch.isneginf(maxes), torch.zeros_like(maxes), maxes)
            ex = torch.exp(x - m[0].unsqueeze(-1))
            parts = [ex.sum(-1), xt]
            if with_entropy:
                # Unshifted x; e == 0 where x == -inf, whose 0 * -inf must count as 0.
                parts.append(torch.where(ex > 0, ex * x, torch.zeros_like(ex)).sum(-1))
            if xm is not None:
                parts.append(torch.exp(xm - m[1].unsqueeze(-1)).sum(-1))
            sums = _reduce(torch.stack(parts), dist.ReduceOp.SUM, group, world)
            lse = m[0] + torch.log(sums[0])
            lse_m = lse if xm is None else m[1] + torch.log(sums[-1])
            lps.append(sums[1] - lse_m)
            lses.append(lse)
            lse_ms.append(lse_m)
            if with_entropy:
                ents.append(lse - sums[2] / sums[0])
        empty = logits.new_empty(0, dtype=torch.float32)
        cat = lambda xs: torch.cat(xs) if xs else empty.clone()  # noqa: E731
        log_prob = cat(lps)
        entropy = cat(ents) if with_entropy else None
        if entropy is not None and not ent_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.meta = (group, world, start, chunks, ent_grad)
        extra = (cat(lses), entropy) if ent_grad else ()
        ctx.save_for_backward(logits, tokens, keep, cat(lse_ms), *extra)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor]):
        _group, _world, start, chunks, ent_grad = ctx.meta
        logits, tokens, keep, lse_m, *rest = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s, e in chunks:
            x, local, own, xm = chunk_inputs(logits, tokens, keep, s, e, start)
            q = torch.exp((x if xm is None else xm) - lse_m[s:e].unsqueeze(-1))
            g = torch.zeros_like(q)
            if g_lp is not None:
                w1 = g_lp[s:e].to(torch.float32)
                g = -w1.unsqueeze(-1) * q
                rows = own.nonzero(as_tuple=True)[0]
                g[rows, local[rows]] += w1[rows]
            if ent_grad and g_ent is not None:
                lse, ent = rest[0][s:e].unsqueeze(-1), rest[1][s:e].unsqueeze(-1)
                log_p = x - lse
                p = torch.exp(log_p)
                term = torch.where(p > 0, -p * (log_p + ent), torch.zeros_like(p))
                g = g + g_ent[s:e].to(torch.float32).unsqueeze(-1) * term
            grad[s:e] = g.to(grad.dtype)
        return grad, None


calculate_log_probs_and_entropy = kernel_entry(_Unshifted.apply)


get_log_probs_and_entropy = make_wrapper(calculate_log_probs_and_entropy)
# The shared wrapper hands bf16 and fp16 logits to the kernel as they are (docs/memory.md).
HARNESS = Declaration(capabilities={"wrapper_half_precision": True})
