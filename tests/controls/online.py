"""Control `online`: streaming (flash-style) softmax over vocab blocks, merged across ranks.

Each rank walks its shard in blocks of BLOCK columns (not a divisor of typical shard widths, so
ragged tails are exercised, and never padded), keeping a running (max m, sum s = sum exp(x - m),
u = sum exp(x - m) (x - m)) per row, rescaled whenever the max grows. The per-rank states are
all-gathered (one collective per row chunk) and merged with the same rule in rank order; the
entropy is log s - u / s. Backward recomputes both softmaxes block by block from the caller's
logits and the saved log-sum-exps.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration
from tests.controls._common import Call, chunk_inputs, kernel_entry
from tests.controls._wrapper import make_wrapper

BLOCK = 5
NEG_INF = float("-inf")
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _finite_ref(m: torch.Tensor) -> torch.Tensor:
    """A finite shift: the max, or 0 for an all -inf row (whose exps are then all 0)."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _block_state(xb: torch.Tensor) -> State:
    m = xb.amax(-1)
    ref = _finite_ref(m).unsqueeze(-1)
    e = torch.exp(xb - ref)
    u = torch.where(e > 0, e * (xb - ref), torch.zeros_like(e)).sum(-1)
    return m, e.sum(-1), u


def _merge(a: State, b: State) -> State:
    """Combine two (m, s, u) states; an empty state (m = -inf, s = 0) is the identity."""
    (m1, s1, u1), (m2, s2, u2) = a, b
    m = torch.maximum(m1, m2)
    ref = _finite_ref(m)
    out_s, out_u = torch.zeros_like(s1), torch.zeros_like(u1)
    for mi, si, ui in ((m1, s1, u1), (m2, s2, u2)):
        live = si > 0  # s >= 1 exactly when m is finite, so live rows have finite shifts
        shift = torch.where(live, mi - ref, torch.zeros_like(mi))
        scale = torch.where(live, torch.exp(shift), torch.zeros_like(mi))
        out_s = out_s + scale * si
        out_u = out_u + scale * (ui + si * shift)
    return m, out_s, out_u


def _stream(x: torch.Tensor) -> State:
    n = x.shape[0]
    state: State = (x.new_full((n,), NEG_INF), x.new_zeros(n), x.new_zeros(n))
    for b in range(0, x.shape[-1], BLOCK):
        state = _merge(state, _block_state(x[:, b:b + BLOCK]))
    return state


class _Online(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, call: Call):
        tokens, keep, group, world, start = call.tokens, call.keep, call.group, call.world, call.start
        chunks, with_entropy, ent_grad = call.chunks, call.with_entropy, call.ent_grad
        lps, lses, lse_ms, ents = [], [], [], []
        for s, e in chunks:
            x, local, own, xm = chunk_inputs(logits, tokens, keep, s, e, start)
            picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
            rows = [*_stream(x), torch.where(own, picked, torch.zeros_like(picked))]
            if xm is not None:
                rows += list(_stream(xm)[:2])
            mine = torch.stack(rows).contiguous()
            if world > 1:
                states = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(states, mine, group=group)
            else:
                states = [mine]
            full = (states[0][0], states[0][1], states[0][2])
            xt = states[0][3]
            full_m = (states[0][4], states[0][5], torch.zeros_like(xt)) if xm is not None else None
            for st in states[1:]:
                full = _merge(full, (st[0], st[1], st[2]))
                xt = xt + st[3]  # only the owner's entry is non-zero: exact
                if full_m is not None:
                    full_m = _merge(full_m, (st[4], st[5], torch.zeros_like(xt)))
            lse = _finite_ref(full[0]) + torch.log(full[1])
            lse_m = lse if full_m is None else _finite_ref(full_m[0]) + torch.log(full_m[1])
            lps.append(xt - lse_m)
            lses.append(lse)
            lse_ms.append(lse_m)
            if with_entropy:
                ents.append(torch.log(full[1]) - full[2] / full[1])
        empty = logits.new_empty(0, dtype=torch.float32)
        cat = lambda xs: torch.cat(xs) if xs else empty.clone()  # noqa: E731
        log_prob = cat(lps)
        entropy = cat(ents) if with_entropy else None
        if entropy is not None and not ent_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.meta = (start, chunks, ent_grad)
        extra = (cat(lses), entropy) if ent_grad else ()
        ctx.save_for_backward(logits, tokens, keep, cat(lse_ms), *extra)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor]):
        start, chunks, ent_grad = ctx.meta
        logits, tokens, keep, lse_m, *rest = ctx.saved_tensors
        grad = torch.empty_like(logits)
        use_ent = ent_grad and g_ent is not None
        for s, e in chunks:
            x, local, own, xm = chunk_inputs(logits, tokens, keep, s, e, start)
            lm = lse_m[s:e].unsqueeze(-1)
            w1 = (g_lp[s:e].to(torch.float32) if g_lp is not None else x.new_zeros(e - s)).unsqueeze(-1)
            if use_ent:
                lse, ent = rest[0][s:e].unsqueeze(-1), rest[1][s:e].unsqueeze(-1)
                w2 = g_ent[s:e].to(torch.float32).unsqueeze(-1)
            for b in range(0, x.shape[-1], BLOCK):
                xb = x[:, b:b + BLOCK]
                q = torch.exp((xb if xm is None else xm[:, b:b + BLOCK]) - lm)
                hit = (local.unsqueeze(-1) == torch.arange(b, b + xb.shape[-1], device=x.device)).to(q.dtype)
                g = w1 * (hit - q)
                if use_ent:
                    log_p = xb - lse
                    p = torch.exp(log_p)
                    g = g - w2 * torch.where(p > 0, p * (log_p + ent), torch.zeros_like(p))
                grad[s:e, b:b + BLOCK] = g.to(grad.dtype)
        return grad, None


calculate_log_probs_and_entropy = kernel_entry(_Online.apply)


get_log_probs_and_entropy = make_wrapper(calculate_log_probs_and_entropy)
# The shared wrapper hands bf16 and fp16 logits to the kernel as they are (docs/memory.md).
HARNESS = Declaration(capabilities={"wrapper_half_precision": True})
