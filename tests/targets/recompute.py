"""A correct routine of another design: it saves no `[T, V_local]` tensor and recomputes the
softmax in backward (row chunk by chunk), from the caller's logits and saved log-sum-exps.

It exists so that the memory checks are shown to hold for designs other than the built-in
routine's (which saves its softmax) and the naive one's (which gathers the full vocab). The Level 2
wrapper is inherited from the built-in routine; only the kernel differs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness.targets.fused import FusedLogProbEntropy


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _lse(x: torch.Tensor, group) -> torch.Tensor:
    m = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, group)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    s = _all_reduce(torch.exp(x - m.unsqueeze(-1)).sum(dim=-1), dist.ReduceOp.SUM, group)
    return m + torch.log(s)


def _masked(x: torch.Tensor, keep: torch.Tensor | None, local: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Dropped entries at -inf, the target entry always kept."""
    if keep is None:
        return x
    keep = keep.clone()
    rows = own.nonzero(as_tuple=True)[0]
    keep[rows, local[rows]] = True
    return x.masked_fill(~keep, float("-inf"))


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, keep, group, start, chunks, with_entropy, entropy_grad):
        v_local = logits.shape[-1]
        lps, lse_lps, lses, ents = [], [], [], []
        for s, e in chunks:
            x = logits[s:e].float()
            local = tokens[s:e] - start
            own = (local >= 0) & (local < v_local)
            lse = _lse(x, group)
            picked = x.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
            xt = _all_reduce(torch.where(own, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
            lse_lp = lse if keep is None else _lse(_masked(x, keep[s:e], local, own), group)
            lps.append(xt - lse_lp)
            lse_lps.append(lse_lp)
            lses.append(lse)
            if with_entropy:
                p = torch.exp(x - lse.unsqueeze(-1))
                plogp = torch.where(p > 0, p * (x - lse.unsqueeze(-1)), torch.zeros_like(p)).sum(dim=-1)
                ents.append(-_all_reduce(plogp, dist.ReduceOp.SUM, group))
        empty = logits.new_empty(0, dtype=torch.float32)
        log_prob = torch.cat(lps) if lps else empty
        entropy = (torch.cat(ents) if ents else empty.clone()) if with_entropy else None
        ctx.chunks, ctx.start, ctx.entropy_grad = chunks, start, entropy_grad
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        cat = lambda parts: torch.cat(parts) if parts else empty.clone()  # noqa: E731
        ctx.save_for_backward(logits, tokens, keep, cat(lse_lps),
                              *((cat(lses), entropy) if entropy_grad else ()))
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, tokens, keep, lse_lp, *ent = ctx.saved_tensors
        v_local = logits.shape[-1]
        grad = torch.empty_like(logits)
        for s, e in ctx.chunks:
            x = logits[s:e].float()
            local = tokens[s:e] - ctx.start
            own = (local >= 0) & (local < v_local)
            q = torch.exp(_masked(x, None if keep is None else keep[s:e], local, own) - lse_lp[s:e].unsqueeze(-1))
            w1 = grad_log_prob[s:e].float()
            g = -w1.unsqueeze(-1) * q
            rows = own.nonzero(as_tuple=True)[0]
            g[rows, local[rows]] += w1[rows]
            if ctx.entropy_grad and grad_entropy is not None:
                lse, entropy = ent[0][s:e], ent[1][s:e]
                log_p = x - lse.unsqueeze(-1)
                p = torch.exp(log_p)
                term = torch.where(p > 0, -p * (log_p + entropy.unsqueeze(-1)), torch.zeros_like(p))
                g = g + grad_entropy[s:e].float().unsqueeze(-1) * term
            grad[s:e] = g.to(grad.dtype)
        return grad, None, None, None, None, None, None, None


class RecomputeLogProbEntropy(FusedLogProbEntropy):
    """Saves the logits, targets, keep mask and O(T) statistics; recomputes the softmax in backward."""

    def calculate_log_probs_and_entropy(self, logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                        log_prob_keep_mask=None, with_entropy_grad=True):
        if logits.dim() != 2:
            raise ValueError(f"logits must be [T, V_local], got {tuple(logits.shape)}")
        group, _world, rank = self.group_info(tp_group)
        tokens = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
        keep = None if log_prob_keep_mask is None else log_prob_keep_mask.to(device=logits.device, dtype=torch.bool)
        needs_grad = bool(logits.requires_grad and torch.is_grad_enabled())
        entropy_grad = self.entropy_differentiable(with_entropy, with_entropy_grad, needs_grad)
        chunks = self.chunk_bounds(logits.shape[0], chunk_size)
        return _Recompute.apply(logits, tokens, keep, group, rank * logits.shape[-1], chunks,
                                bool(with_entropy), entropy_grad)


ROUTINE = RecomputeLogProbEntropy()
calculate_log_probs_and_entropy = ROUTINE.calculate_log_probs_and_entropy
get_log_probs_and_entropy = ROUTINE.get_log_probs_and_entropy
