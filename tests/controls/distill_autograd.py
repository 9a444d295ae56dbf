"""Control `distill_autograd`: the distillation level (docs/distill.md) by plain autograd, a second
algorithm next to the built-in routine's (harness/targets/fused_distill.py: custom backwards that
recompute from saved normalisers, a stable-sort top-k that breaks ties toward the lower id).

- No custom math backward: autograd runs through two differentiable all-reduces, one that sums the
  gradient over the ranks in backward (the sum of exponentials under a *sharded* result: the
  log-softmax shard, the whole-vocabulary divergence's terms, whose losses are the ranks' sum) and
  one whose backward is the identity (a *replicated* result: every rank computes the same loss).
- The max shift is detached and all-reduced (MAX); the log-sum-exp is `m + log Σ exp(z - m)`.
- The top-k is torch.topk (ties in whatever order it leaves them) on each shard, the candidates
  all-gathered and merged with torch.topk again: identical on every rank, as the contract asks.
- The divergence's terms are `p (log p - log q)`, the log-probs of a zero probability replaced by 0
  before the product.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_NEG_INF = float("-inf")


class _Replicated(torch.autograd.Function):
    """All-reduce SUM forward, identity backward: each rank's partial enters the replicated result
    once, and every rank's loss is the same, so its gradient is already the whole loss's."""

    @staticmethod
    def forward(ctx, t, group):
        out = t.clone()
        if _world(group) > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


class _Sharded(torch.autograd.Function):
    """All-reduce SUM forward and backward: the result enters every rank's own part of a loss that
    is the ranks' sum, so each rank's partial gets the gradient of all of them."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def _sharded_sum(t: torch.Tensor, group) -> torch.Tensor:
    return _Sharded.apply(t, group) if _world(group) > 1 else t


def _max(z: torch.Tensor, group) -> torch.Tensor:
    m = z.detach().amax(-1) if z.shape[-1] else z.new_full(z.shape[:-1], _NEG_INF)
    if _world(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _lse(z: torch.Tensor, group, sharded: bool) -> torch.Tensor:
    m = _max(z, group)
    s = (z - m.unsqueeze(-1)).exp().sum(-1)
    s = _sharded_sum(s, group) if sharded else _Replicated.apply(s, group)
    return m + s.log()


def _chunks(n: int, chunk_size: int) -> list[slice]:
    step = chunk_size if chunk_size > 0 else max(n, 1)
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


def _gathered(z: torch.Tensor, ids: torch.Tensor, group) -> torch.Tensor:
    """The values of z at global ids on every rank: the owner's, summed over the ranks."""
    start = _rank(group) * z.shape[-1]
    own = (ids >= start) & (ids < start + z.shape[-1])
    local = torch.where(own, ids - start, torch.zeros_like(ids))
    return _Replicated.apply(torch.where(own, z.gather(-1, local), torch.zeros((), dtype=z.dtype)), group)


def _topk_ids(z: torch.Tensor, k: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    world, start = _world(group), _rank(group) * z.shape[-1]
    values, ids = torch.topk(z.detach(), min(k, z.shape[-1]), dim=-1)
    ids = ids + start
    if world > 1:
        vs, iz = [torch.empty_like(values) for _ in range(world)], [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(vs, values.contiguous(), group=group)
        dist.all_gather(iz, ids.contiguous(), group=group)
        values, ids = torch.cat(vs, -1), torch.cat(iz, -1)
    top = torch.topk(values, min(k, z.shape[-1] * world), dim=-1)
    return top.values, ids.gather(-1, top.indices)


def _xlogx_terms(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    p = lp.exp()
    live = p > 0
    zero = torch.zeros((), dtype=lp.dtype)
    return torch.where(live, p, zero) * (torch.where(live, lp, zero) - torch.where(live, lq, zero))


def _terms(ls: torch.Tensor, lt: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    if kind == "forward_kl":
        return _xlogx_terms(lt, ls)
    if kind == "reverse_kl":
        return _xlogx_terms(ls, lt)
    if kind == "mixed":
        return beta * _xlogx_terms(lt, ls) + (1 - beta) * _xlogx_terms(ls, lt)
    if kind == "soft_ce":
        t = lt.exp()
        return -torch.where(t > 0, t, torch.zeros((), dtype=t.dtype)) * torch.where(t > 0, ls, torch.zeros((), dtype=t.dtype))
    m = beta * lt.exp() + (1 - beta) * ls.exp()
    lm = torch.where(m > 0, m, torch.ones_like(m)).log()
    return beta * _xlogx_terms(lt, lm) + (1 - beta) * _xlogx_terms(ls, lm)


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    return x.float() / temperature


def distill_log_softmax(logits, tp_group, temperature=1.0, chunk_size=-1):
    out = [z - _lse(z, tp_group, sharded=True).unsqueeze(-1)
           for z in (_scaled(logits[rows], temperature) for rows in _chunks(logits.shape[0], chunk_size))]
    return torch.cat(out) if out else _scaled(logits, temperature) * 0


@torch.no_grad()
def distill_topk(logits, k, tp_group, temperature=1.0, chunk_size=-1):
    values, ids = [], []
    for rows in _chunks(logits.shape[0], chunk_size):
        z = _scaled(logits[rows], temperature)
        top, top_ids = _topk_ids(z, k, tp_group)
        values.append(top - _lse(z, tp_group, sharded=False).unsqueeze(-1))
        ids.append(top_ids)
    width = min(k, logits.shape[-1] * _world(tp_group))
    if not values:
        return logits.new_zeros((0, width), dtype=torch.float32), torch.zeros((0, width), dtype=torch.int64)
    return torch.cat(values), torch.cat(ids)


def distill_gather(logits, indices, tp_group, temperature=1.0, chunk_size=-1, renormalize=False):
    out = []
    for rows in _chunks(logits.shape[0], chunk_size):
        z = _scaled(logits[rows], temperature)
        values = _gathered(z, indices[rows].long(), tp_group)
        out.append(values.log_softmax(-1) if renormalize else values - _lse(z, tp_group, sharded=False).unsqueeze(-1))
    return torch.cat(out) if out else logits.new_zeros(indices.shape, dtype=torch.float32) + 0 * logits.float().sum()


def distill_divergence(student_logits, tp_group, *, teacher_logits: Optional[torch.Tensor] = None,
                       teacher_topk_log_probs: Optional[torch.Tensor] = None,
                       teacher_topk_indices: Optional[torch.Tensor] = None, k=0, kind="forward_kl", beta=0.5,
                       temperature=1.0, renormalize=True, chunk_size=-1):
    out = []
    for rows in _chunks(student_logits.shape[0], chunk_size):
        zs = _scaled(student_logits[rows], temperature)
        zt = _scaled(teacher_logits[rows], temperature) if teacher_logits is not None else None
        if zt is not None and k <= 0:  # the whole vocabulary: each rank's terms, summed
            ls = zs - _lse(zs, tp_group, sharded=True).unsqueeze(-1)
            lt = zt - _lse(zt, tp_group, sharded=True).unsqueeze(-1)
            out.append(_Replicated.apply(_terms(ls, lt, kind, beta).sum(-1), tp_group))
            continue
        if zt is not None:
            ids = _topk_ids(zt, k, tp_group)[1]
            vt = _gathered(zt, ids, tp_group)
        else:
            assert teacher_topk_indices is not None and teacher_topk_log_probs is not None
            ids = teacher_topk_indices[rows].long()
            vt = teacher_topk_log_probs[rows].float()
        vs = _gathered(zs, ids, tp_group)
        if renormalize:
            ls, lt = vs.log_softmax(-1), (vt if zt is not None else vt / temperature).log_softmax(-1)
        else:
            ls = vs - _lse(zs, tp_group, sharded=False).unsqueeze(-1)
            lt = vt - _lse(zt, tp_group, sharded=False).unsqueeze(-1) if zt is not None else vt
        out.append(_terms(ls, lt, kind, beta).sum(-1))
    if out:
        return torch.cat(out)
    return student_logits.new_zeros(0, dtype=torch.float32) + 0 * student_logits.float().sum()
