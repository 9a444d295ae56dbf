"""Built-in fused vocab-parallel log-prob / entropy routine (the harness's reference target).

Written from ``docs/contract.md`` (Level 1 kernel, Level 2 wrapper; the fused-linear level is
``FusedLinearLogProbEntropy`` at the end, its steps in ``fused_linear.py``).  The algorithm lives in
:class:`FusedLogProbEntropy` and is split into small *step* methods, one concern each, so that a
mutation catalog can build a defective variant by subclassing and overriding exactly one step.
The autograd Function below receives the routine instance as a non-tensor argument and calls its
steps in forward and backward; it holds no algorithm of its own.

Forward, per row chunk ``[s, e)`` (all arithmetic float32), two collectives whatever the options:

* local row maxima of ``x`` (and, under a keep mask, of the masked logits ``xm``, target restored),
  stacked into **one all-reduce MAX** (stat ``"max"``, masked ``"max+masked_max"``); ``m`` (``mm``)
  = the global max, 0 for an all ``-inf`` row
* local sums that need only the global maxima: ``sum exp(x - m)``, the target logit on the owning
  shard (0 elsewhere), ``sum exp(xm - mm)`` when masked, ``sum e (x - m)`` when the entropy is
  asked for, stacked into **one all-reduce SUM** (stat ``"sumexp+target_logit"``, then
  ``+masked_sumexp``, ``+entropy_term``)
* ``lse = m + log S``, ``log_prob = x_t - lse_(masked)``, entropy ``= log S - sum(e (x - m)) / S``

Stacking changes no arithmetic: every statistic is the same float32 value on each rank, reduced
elementwise over the ranks. Every rank, in every grad mode, issues the same two collectives per
chunk (slime #1822); no rows, no chunk, no collective.

Saved for backward (only when the logits require grad): one ``[T, V_local]`` float32 buffer ``q``
(the masked softmax), the targets and, when the entropy is differentiable, the caller's logits
themselves plus the O(T) vectors ``lse`` and ``entropy``.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration
from harness.targets.fused_distill import DISTILL_ROUTINE
from harness.targets.fused_kl import KL_ROUTINE
from harness.targets.fused_linear import FusedLinearSteps
from harness.targets.fused_linear_distill import LINEAR_DISTILL_ROUTINE

__all__ = [
    "LINEAR_ROUTINE",
    "FusedLinearLogProbEntropy",
    "FusedLogProbEntropy",
    "ROUTINE",
    "calculate_linear_log_probs_and_entropy",
    "calculate_log_probs_and_entropy",
    "distill_divergence",
    "distill_gather",
    "distill_log_softmax",
    "distill_topk",
    "get_log_probs_and_entropy",
    "kl_estimate",
    "linear_distill_loss",
]


class _FusedFunction(torch.autograd.Function):
    """Thin autograd shell: every step is a method of the routine passed in."""

    @staticmethod
    def forward(ctx, logits, tokens, keep_mask, routine, tp_group, with_entropy, chunk_size,
                needs_grad, entropy_grad):
        return routine.forward(ctx, logits, tokens, keep_mask, tp_group, with_entropy,
                               chunk_size, needs_grad, entropy_grad)

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        grad_logits = ctx.routine.backward(ctx, grad_log_prob, grad_entropy)
        return grad_logits, None, None, None, None, None, None, None, None


class _SumOverGroup(torch.autograd.Function):
    """A differentiable all-reduce SUM: the gradient of every rank's input is the sum of every
    rank's output gradient (each rank's output is the sum of every rank's input)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class CPLayout(NamedTuple):
    """A wrapper call's context-parallel setting, as the CP steps see it."""
    total_lengths: Sequence[int]
    response_lengths: Sequence[int]
    size: int
    rank: int
    allgather: bool


class FusedLogProbEntropy:
    """Fused vocab-parallel log-prob and entropy, one overridable method per concern."""

    function = _FusedFunction

    # ------------------------------------------------------------------ collectives / sharding
    def group_info(self, tp_group) -> tuple[Any, int, int]:
        """(group, world size, rank) of the TP group; ``None`` group = default or single rank."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        return tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group)

    def all_reduce(self, tensor: torch.Tensor, op, group, stat: str) -> torch.Tensor:
        """Every collective goes through here; ``stat`` names the reduced statistic(s)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return tensor
        dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def reduce_stats(self, stats: dict[str, torch.Tensor], op, group) -> dict[str, torch.Tensor]:
        """The named ``[rows]`` statistics reduced with ``op`` over the group by one collective
        (stacked, reduced, split back; ``stat`` names them all, joined by ``+``). An empty dict
        makes no collective."""
        if not stats:
            return {}
        # Reduced elementwise over the ranks, as one collective per statistic would. From 3 ranks on,
        # gloo's ring adds an element's ranks in an order that follows its place in the buffer
        # (docs/bitwise.md), so there the last bit can differ from a collective of its own.
        stacked = self.all_reduce(torch.stack(list(stats.values())), op, group, "+".join(stats))
        return dict(zip(stats, stacked.unbind(0), strict=True))

    def shard_start(self, rank: int, v_local: int) -> int:
        """First global vocab id owned by ``rank``."""
        return rank * v_local

    def owned(self, local_ids: torch.Tensor, v_local: int) -> torch.Tensor:
        """Which (shard-local) ids fall inside this shard."""
        return (local_ids >= 0) & (local_ids < v_local)

    # ------------------------------------------------------------------ chunking / dtypes
    def chunk_bounds(self, num_rows: int, chunk_size: int) -> list[tuple[int, int]]:
        """Row ranges ``[s, e)`` covering ``num_rows``; no chunk at all when there are no rows."""
        if num_rows <= 0:
            return []
        step = num_rows if chunk_size is None or chunk_size <= 0 else int(chunk_size)
        return [(s, min(s + step, num_rows)) for s in range(0, num_rows, step)]

    def compute_dtype(self, logits: torch.Tensor) -> torch.dtype:
        """The arithmetic dtype: float32 whatever the input dtype."""
        return torch.float32

    def upcast(self, chunk: torch.Tensor) -> torch.Tensor:
        """Chunk in the compute dtype (may alias the caller's tensor: never edit it in place)."""
        return chunk.to(self.compute_dtype(chunk))

    def concat(self, parts: Sequence[torch.Tensor], empty_like: torch.Tensor) -> torch.Tensor:
        """Join per-chunk outputs; ``empty_like`` is returned when there were no chunks."""
        return torch.cat(list(parts)) if len(parts) else empty_like

    def cast_grad(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The gradient in the caller's logits dtype."""
        return grad.to(dtype)

    # ------------------------------------------------------------------ forward statistics
    def row_max(self, x: torch.Tensor) -> torch.Tensor:
        """This shard's row max."""
        return x.max(dim=-1).values

    def finite_shift(self, m: torch.Tensor) -> torch.Tensor:
        """The global row max as the exponentials' shift; 0 for an all ``-inf`` row, whose
        ``x - m`` would otherwise be NaN."""
        return torch.where(torch.isneginf(m), torch.zeros_like(m), m)

    def sum_exp(self, x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp(x - m), this shard's sum of it over the vocab)."""
        e = torch.exp(x - m.unsqueeze(-1))
        return e, e.sum(dim=-1)

    def target_logit(self, x: torch.Tensor, local_ids: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """x[target] on the shard that owns the target, 0 on the others (their sum is x[target])."""
        v_local = x.shape[-1]
        idx = local_ids.clamp(0, max(v_local - 1, 0)).unsqueeze(-1)
        picked = x.gather(-1, idx).squeeze(-1)
        return torch.where(own, picked, torch.zeros_like(picked))

    def restore_target(self, keep_local: torch.Tensor, rows: torch.Tensor,
                       cols: torch.Tensor) -> torch.Tensor:
        """A copy of the keep mask with the target entries kept (the caller's mask is untouched)."""
        keep = keep_local.clone()
        keep[rows, cols] = True
        return keep

    def masked_logits(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Dropped entries set to -inf, out of place."""
        return x.masked_fill(~keep, float("-inf"))

    def log_prob(self, target_logit: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """log p(target) = x_t - lse: an ordinary float32 number however far in the tail, where the
        log of the probability itself would underflow (below -87, and to -inf below -103)."""
        return target_logit - lse

    def entropy_term(self, x: torch.Tensor, e: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """This shard's sum(e (x - m)), with p == 0 entries contributing 0 (not 0 * -inf)."""
        ex = torch.where(e > 0, e * (x - m.unsqueeze(-1)), torch.zeros_like(e))
        return ex.sum(dim=-1)

    def entropy(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """H = log S - sum(e (x - m)) / S, from the global sums."""
        return torch.log(s) - t / s

    def entropy_inputs(self, unmasked: tuple, masked: tuple) -> tuple:
        """The softmax the entropy is computed from, as (logits, exponentials, shift, name of the
        sum of exponentials): the unmasked one, always."""
        return unmasked

    def softmax_into(self, out: Optional[torch.Tensor], e: torch.Tensor,
                     s: torch.Tensor) -> None:
        """Write e / S into the preallocated q rows (no-op when no gradient is needed)."""
        if out is not None:
            torch.div(e, s.unsqueeze(-1), out=out)

    def entropy_differentiable(self, with_entropy: bool, with_entropy_grad: bool,
                               requires_grad: bool) -> bool:
        """The contract's rule for ``entropy.requires_grad``."""
        return bool(with_entropy and with_entropy_grad and requires_grad)

    # ------------------------------------------------------------------ backward terms
    def logprob_grad(self, q: torch.Tensor, local_ids: torch.Tensor, own: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
        """w * (onehot_local - q) for one chunk."""
        g = -w.unsqueeze(-1) * q
        rows = own.nonzero(as_tuple=True)[0]
        g[rows, local_ids[rows]] += w[rows]
        return g

    def recompute_p(self, x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """The unmasked softmax of a chunk, from the logits and the saved lse."""
        return torch.exp(x - lse.unsqueeze(-1))

    def entropy_grad_term(self, p: torch.Tensor, log_p: torch.Tensor,
                          entropy: torch.Tensor) -> torch.Tensor:
        """dH/dx = -p (log p + H), 0 where p == 0."""
        term = -p * (log_p + entropy.unsqueeze(-1))
        return torch.where(p > 0, term, torch.zeros_like(term))

    # ------------------------------------------------------------------ orchestration
    def forward(self, ctx, logits, tokens, keep_mask, tp_group, with_entropy, chunk_size,
                needs_grad, entropy_grad):
        group, _world, rank = self.group_info(tp_group)
        num_rows, v_local = logits.shape
        start = self.shard_start(rank, v_local)
        dev = logits.device
        f32 = self.compute_dtype(logits)
        q_buf = torch.empty(num_rows, v_local, dtype=f32, device=dev) if needs_grad else None
        lps, ents, lses = [], [], []
        for s, e in self.chunk_bounds(num_rows, chunk_size):
            x = self.upcast(logits[s:e])
            local = tokens[s:e] - start
            own = self.owned(local, v_local)
            maxima = {"max": self.row_max(x)}
            if keep_mask is not None:
                rows = own.nonzero(as_tuple=True)[0]
                xm = self.masked_logits(x, self.restore_target(keep_mask[s:e], rows, local[rows]))
                maxima["masked_max"] = self.row_max(xm)
            # Every local sum needs the global maxima and nothing else global: one MAX collective,
            # then one SUM collective, whatever the options.
            maxima = self.reduce_stats(maxima, dist.ReduceOp.MAX, group)
            m = self.finite_shift(maxima["max"])
            ex, local_sum = self.sum_exp(x, m)
            sums = {"sumexp": local_sum, "target_logit": self.target_logit(x, local, own)}
            ent_in = (x, ex, m, "sumexp")
            if keep_mask is not None:
                mm = self.finite_shift(maxima["masked_max"])
                exm, sums["masked_sumexp"] = self.sum_exp(xm, mm)
                ent_in = self.entropy_inputs(ent_in, (xm, exm, mm, "masked_sumexp"))
            ent_x, ent_e, ent_m, ent_sum = ent_in
            if with_entropy:
                sums["entropy_term"] = self.entropy_term(ent_x, ent_e, ent_m)
            sums = self.reduce_stats(sums, dist.ReduceOp.SUM, group)
            lse = m + torch.log(sums["sumexp"])
            q_rows = q_buf[s:e] if q_buf is not None else None
            if keep_mask is None:
                lps.append(self.log_prob(sums["target_logit"], lse))
                self.softmax_into(q_rows, ex, sums["sumexp"])
            else:
                lps.append(self.log_prob(sums["target_logit"], mm + torch.log(sums["masked_sumexp"])))
                self.softmax_into(q_rows, exm, sums["masked_sumexp"])
            if with_entropy:
                ents.append(self.entropy(sums[ent_sum], sums["entropy_term"]))
            lses.append(lse)
        empty = torch.empty(0, dtype=f32, device=dev)
        log_prob = self.concat(lps, empty)
        entropy = self.concat(ents, empty.clone()) if with_entropy else None

        ctx.routine = self
        ctx.saved_any = needs_grad
        ctx.entropy_grad = bool(entropy_grad)
        ctx.masked = keep_mask is not None
        ctx.chunk_size = chunk_size
        ctx.group = group
        ctx.start = start
        ctx.shape = (num_rows, v_local)
        ctx.dtype = logits.dtype
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        if needs_grad and entropy_grad:
            ctx.save_for_backward(logits, tokens, q_buf, self.concat(lses, empty.clone()), entropy)
        elif needs_grad:
            ctx.save_for_backward(tokens, q_buf)
        return log_prob, entropy

    def backward(self, ctx, grad_log_prob, grad_entropy):
        if not ctx.saved_any:
            return None
        if ctx.entropy_grad:
            logits, tokens, q_buf, lse, ent = ctx.saved_tensors
        else:
            (tokens, q_buf), logits = ctx.saved_tensors, None
        num_rows, v_local = ctx.shape
        grad = torch.empty(num_rows, v_local, dtype=ctx.dtype, device=q_buf.device)
        w1 = grad_log_prob.reshape(-1).to(q_buf.dtype)
        for s, e in self.chunk_bounds(num_rows, ctx.chunk_size):
            local = tokens[s:e] - ctx.start
            own = self.owned(local, v_local)
            g = self.logprob_grad(q_buf[s:e], local, own, w1[s:e])
            if ctx.entropy_grad and grad_entropy is not None:
                assert logits is not None  # saved whenever the entropy has a gradient
                x = self.upcast(logits[s:e])
                log_p = x - lse[s:e].unsqueeze(-1)
                p = self.recompute_p(x, lse[s:e]) if ctx.masked else q_buf[s:e]
                w2 = grad_entropy[s:e].to(q_buf.dtype).unsqueeze(-1)
                g = g + w2 * self.entropy_grad_term(p, log_p, ent[s:e])
            grad[s:e] = self.cast_grad(g, ctx.dtype)
        return grad

    # ------------------------------------------------------------------ Level 1 entry point
    def calculate_log_probs_and_entropy(self, logits, tokens, tp_group, with_entropy=False,
                                        chunk_size=-1, log_prob_keep_mask=None,
                                        with_entropy_grad=True):
        """Level 1 kernel: ``(log_prob [T] float32, entropy [T] float32 or None)``."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [T, V_local], got {tuple(logits.shape)}")
        tokens = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
        needs_grad = bool(logits.requires_grad and torch.is_grad_enabled())
        entropy_grad = self.entropy_differentiable(with_entropy, with_entropy_grad, needs_grad)
        if log_prob_keep_mask is not None:
            log_prob_keep_mask = log_prob_keep_mask.to(device=logits.device, dtype=torch.bool)
        return self.function.apply(logits, tokens, log_prob_keep_mask, self, tp_group,
                                   bool(with_entropy), chunk_size, needs_grad, entropy_grad)

    # ------------------------------------------------------------------ Level 2 wrapper steps
    def entropy_grad_flag(self, with_entropy: bool, args) -> bool:
        """The rule of slime PR #2153: differentiable entropy iff a non-zero coefficient."""
        return bool(with_entropy and getattr(args, "entropy_coef", 0.0) != 0)

    def temperature(self, args) -> float:
        """Rollout temperature the logits are divided by (absent: 1.0)."""
        t = getattr(args, "rollout_temperature", None)
        return 1.0 if t is None else float(t)

    def chunk_size(self, args) -> int:
        """Row chunk size for the kernel (absent: -1, all rows at once)."""
        c = getattr(args, "log_probs_chunk_size", None)
        return -1 if c is None else int(c)

    def tp_group(self):
        """The Megatron TP group, or None when parallel_state is not initialised."""
        if "megatron.core.parallel_state" not in sys.modules:
            return None  # never imported, hence never initialised
        from megatron.core import parallel_state as mpu

        if not mpu.model_parallel_is_initialized():
            return None
        return mpu.get_tensor_model_parallel_group()

    def shifted_tokens(self, unconcat_tokens, total_lengths, device) -> torch.Tensor:
        """Per sample, row j predicts token j+1; the last row of a sample gets target 0."""
        parts = []
        for toks, length in zip(unconcat_tokens, total_lengths, strict=True):
            toks = torch.as_tensor(toks, device=device).reshape(-1).to(torch.long)
            assert toks.numel() == int(length), "token count differs from total_lengths"
            parts.append(torch.cat([toks[1:], toks.new_zeros(min(1, toks.numel()))]))
        return self.concat(parts, torch.empty(0, dtype=torch.long, device=device))

    def response_rows(self, offset: int, total_length: int, response_length: int) -> tuple[int, int]:
        """Packed rows ``[a, b)`` predicting the response of one sample."""
        a = offset + total_length - response_length - 1
        if response_length > 0 and a < offset:
            raise ValueError("response_length must be < total_length")
        return a, a + response_length

    def recorded_rows(self, n_offsets: int, response_length: int) -> int:
        """How many leading response rows have a recorded nucleus: row r has one iff
        r + 1 < len(offsets) (slime's encoding of a missing nucleus is a short offsets list)."""
        return max(0, min(response_length, n_offsets - 1))

    def masked_rows(self, counts: torch.Tensor) -> torch.Tensor:
        """Which recorded rows are masked to their nucleus: all of them, an empty one included
        (it keeps only the target, which the kernel restores: log-prob 0)."""
        return torch.ones_like(counts, dtype=torch.bool)

    def top_p_keep_mask(self, num_rows, v_local, rank, total_lengths, response_lengths,
                        top_p_token_ids, top_p_token_offsets, device) -> Optional[torch.Tensor]:
        """Local ``[T, V_local]`` keep mask for the log-prob softmax, or None if nothing is masked.
        Per sample, ids and offsets are tensors or lists of global ids and row offsets."""
        if top_p_token_ids is None or top_p_token_offsets is None:
            return None
        start = self.shard_start(rank, v_local)
        mask = None
        offset = 0
        for length, resp, ids, offs in zip(total_lengths, response_lengths, top_p_token_ids, top_p_token_offsets,
                                           strict=True):
            a, _b = self.response_rows(offset, int(length), int(resp))
            offset += int(length)
            ids = torch.as_tensor(ids, device=device).reshape(-1).to(torch.long)
            offs = torch.as_tensor(offs, device=device).reshape(-1).to(torch.long)
            n = self.recorded_rows(offs.numel(), int(resp))
            if n == 0:
                continue
            if offs.numel() < n + 1:  # rows treated as recorded past the offsets have an empty range
                offs = torch.cat([offs, offs[-1:].expand(n + 1 - offs.numel())]) if offs.numel() else \
                    torch.zeros(n + 1, dtype=torch.long, device=device)
            counts = offs[1:n + 1] - offs[:n]
            rows = a + torch.arange(n, device=device)
            selected = self.masked_rows(counts)
            if not bool(selected.any()):
                continue
            if mask is None:
                mask = torch.ones(num_rows, v_local, dtype=torch.bool, device=device)
            mask[rows[selected]] = False
            seg = ids[int(offs[0]):int(offs[n])]
            id_rows = torch.repeat_interleave(rows, counts)
            keep = torch.repeat_interleave(selected, counts)
            local = seg - start
            own = self.owned(local, v_local) & keep
            mask[id_rows[own], local[own]] = True
        return mask

    # ------------------------------------------------------------------ Level 2: context parallelism
    def cp_info(self) -> tuple[int, int, Any]:
        """(CP size, CP rank, CP group) from megatron's parallel_state; (1, 0, None) without it."""
        mpu = sys.modules.get("megatron.core.parallel_state")
        if mpu is None or not mpu.model_parallel_is_initialized():
            return 1, 0, None
        return (mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(),
                mpu.get_context_parallel_group())

    def zigzag_bounds(self, length: int, cp_size: int, chunk: int) -> tuple[int, int]:
        """Rows ``[s, e)`` of a sample in zigzag chunk ``chunk`` of ``2 * cp_size`` (may run past it: padding)."""
        size = (length + 2 * cp_size - 1) // (2 * cp_size)
        return chunk * size, (chunk + 1) * size

    def cp_rows(self, num_rows: int, total_lengths, cp_size: int, cp_rank: int, allgather: bool, device):
        """Per local row, ``(sample, position in the sample)``; sample -1 on padding rows."""
        sample, pos = [], []
        if allgather:
            starts = [0]
            for n in total_lengths:
                starts.append(starts[-1] + int(n))
            for g in range(cp_rank * num_rows, (cp_rank + 1) * num_rows):
                i = next((k for k in range(len(total_lengths)) if starts[k] <= g < starts[k + 1]), -1)
                sample.append(i)
                pos.append(g - starts[i] if i >= 0 else 0)
        else:
            for i, n in enumerate(total_lengths):
                for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
                    s, e = self.zigzag_bounds(int(n), cp_size, chunk)
                    sample += [i if j < int(n) else -1 for j in range(s, e)]
                    pos += [j if j < int(n) else 0 for j in range(s, e)]
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return as_long(sample), as_long(pos)

    def cp_targets(self, unconcat_tokens, sample: torch.Tensor, pos: torch.Tensor, total_lengths) -> torch.Tensor:
        """The target of each local row: the sample's next token, 0 on its last row and on padding."""
        out = torch.zeros(sample.numel(), dtype=torch.long, device=sample.device)
        for i, (toks, n) in enumerate(zip(unconcat_tokens, total_lengths, strict=True)):
            toks = torch.as_tensor(toks, device=sample.device).reshape(-1).to(torch.long)
            rows = ((sample == i) & (pos + 1 < int(n))).nonzero(as_tuple=True)[0]
            out[rows] = toks[pos[rows] + 1]
        return out

    def cp_response_index(self, sample: torch.Tensor, pos: torch.Tensor, total_lengths,
                          response_lengths) -> torch.Tensor:
        """Per local row, the response position it predicts (row P-1+k predicts response token k), or -1."""
        k = torch.full_like(pos, -1)
        for i, (n, r) in enumerate(zip(total_lengths, response_lengths, strict=True)):
            rows = (sample == i).nonzero(as_tuple=True)[0]
            idx = pos[rows] - (int(n) - int(r) - 1)
            ok = (idx >= 0) & (idx < int(r))
            k[rows[ok]] = idx[ok]
        return k

    def cp_keep_mask(self, num_rows: int, v_local: int, rank: int, sample: torch.Tensor, k: torch.Tensor,
                     top_p_token_ids, top_p_token_offsets, device, layout: CPLayout) -> Optional[torch.Tensor]:
        """The local keep mask at CP: each local response row (sample, response position k, from
        `layout`'s rows) masked to its recorded nucleus."""
        if top_p_token_ids is None or top_p_token_offsets is None:
            return None
        start, mask = self.shard_start(rank, v_local), None
        for i, (ids, offs) in enumerate(zip(top_p_token_ids, top_p_token_offsets, strict=True)):
            ids = torch.as_tensor(ids, device=device).reshape(-1).to(torch.long)
            offs = torch.as_tensor(offs, device=device).reshape(-1).to(torch.long)
            for row in ((sample == i) & (k >= 0) & (k + 1 < offs.numel())).nonzero(as_tuple=True)[0].tolist():
                if mask is None:
                    mask = torch.ones(num_rows, v_local, dtype=torch.bool, device=device)
                r = int(k[row])
                local = ids[int(offs[r]):int(offs[r + 1])] - start
                mask[row] = False
                mask[row, local[self.owned(local, v_local)]] = True
        return mask

    def zigzag_positions(self, length: int, response_length: int, cp_size: int, cp_rank: int) -> list[int]:
        """The response positions a CP rank returns: those its chunk r predicts, then chunk 2c-1-r's."""
        first = length - response_length - 1
        out = []
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            s, e = self.zigzag_bounds(length, cp_size, chunk)
            out += [j - first for j in range(max(s, first), min(e, length - 1))]
        return out

    def cp_reduce_group(self, cp_group, tp_group):
        """The group the all-gather CP pieces are summed over."""
        return cp_group

    def cp_absent_piece(self, response_length: int, like: torch.Tensor) -> torch.Tensor:
        """A sample's response on a rank holding none of it: zeros whose autograd state follows the
        other pieces' (slime #2123: a fresh requires_grad=True tensor here hung training)."""
        return torch.zeros(response_length, dtype=like.dtype, device=like.device, requires_grad=like.requires_grad)

    def cp_redistribute(self, values: torch.Tensor, sample: torch.Tensor, k: torch.Tensor, total_lengths,
                        response_lengths, cp_size: int, cp_rank: int, group) -> list[torch.Tensor]:
        """All-gather CP: every sample's whole response summed (differentiably) over the CP group from
        each rank's rows, then this rank's zigzag positions of it."""
        full = []
        for i, r in enumerate(response_lengths):
            rows = ((sample == i) & (k >= 0)).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                full.append(self.cp_absent_piece(int(r), values))
            else:
                full.append(values.new_zeros(int(r)).index_add(0, k[rows], values[rows]))
        summed = _SumOverGroup.apply(torch.cat(full), group)
        return [part[self.zigzag_positions(int(n), int(r), cp_size, cp_rank)] for part, n, r in
                zip(summed.split([int(r) for r in response_lengths]), total_lengths, response_lengths, strict=True)]

    def cp_wrapper(self, x, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                   top_p_token_ids, top_p_token_offsets, cp: tuple[int, int, Any]) -> dict:
        """The wrapper's steps at CP > 1: this rank's rows of the zigzag or all-gather layout."""
        cp_size, cp_rank, cp_group = cp
        allgather = bool(getattr(args, "allgather_cp", False))
        layout = CPLayout(total_lengths, response_lengths, cp_size, cp_rank, allgather)
        num_rows, v_local = x.shape
        sample, pos = self.cp_rows(num_rows, total_lengths, cp_size, cp_rank, allgather, x.device)
        k = self.cp_response_index(sample, pos, total_lengths, response_lengths)
        group = self.tp_group()
        _group, _world, rank = self.group_info(group)
        keep = self.cp_keep_mask(num_rows, v_local, rank, sample, k, top_p_token_ids, top_p_token_offsets, x.device,
                                 layout)
        log_prob, entropy = self.calculate_log_probs_and_entropy(
            x, self.cp_targets(unconcat_tokens, sample, pos, total_lengths), group, with_entropy=with_entropy,
            chunk_size=self.chunk_size(args), log_prob_keep_mask=keep,
            with_entropy_grad=self.entropy_grad_flag(with_entropy, args))
        outputs = {"log_probs": log_prob.reshape(-1)}
        if with_entropy:
            outputs["entropy"] = entropy
        res = {}
        for key, values in outputs.items():
            if allgather:
                res[key] = self.cp_redistribute(values, sample, k, total_lengths, response_lengths, cp_size,
                                                cp_rank, self.cp_reduce_group(cp_group, group))
            else:  # local order is chunk r then chunk 2c-1-r: the zigzag order already
                res[key] = [values[((sample == i) & (k >= 0)).nonzero(as_tuple=True)[0]]
                            for i in range(len(total_lengths))]
        return res

    def get_log_probs_and_entropy(self, logits, *, args, unconcat_tokens, total_lengths,
                                  response_lengths, with_entropy=False, non_loss_data=True,
                                  top_p_token_ids=None, top_p_token_offsets=None):
        """Level 2 wrapper: ``(empty tensor, {"log_probs": [...], "entropy": [...]})``."""
        assert logits.dim() == 3 and logits.size(0) == 1, "logits must be [1, T, V_local]"
        x = logits.squeeze(0)
        temp = self.temperature(args)
        if temp != 1.0:
            x = x / temp
        cp = self.cp_info()
        if cp[0] > 1:
            res = self.cp_wrapper(x, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                                  top_p_token_ids, top_p_token_offsets, cp)
            return torch.empty(0, device=logits.device), res
        tokens = self.shifted_tokens(unconcat_tokens, total_lengths, x.device)
        group = self.tp_group()
        _group, _world, rank = self.group_info(group)
        keep = self.top_p_keep_mask(x.shape[0], x.shape[1], rank, total_lengths,
                                    response_lengths, top_p_token_ids, top_p_token_offsets,
                                    x.device)
        log_prob, entropy = self.calculate_log_probs_and_entropy(
            x, tokens, group, with_entropy=with_entropy, chunk_size=self.chunk_size(args),
            log_prob_keep_mask=keep, with_entropy_grad=self.entropy_grad_flag(with_entropy, args))
        log_prob = log_prob.reshape(-1)
        res: dict[str, list[torch.Tensor]] = {"log_probs": []}
        if with_entropy:
            res["entropy"] = []
        offset = 0
        for length, resp in zip(total_lengths, response_lengths, strict=True):
            a, b = self.response_rows(offset, int(length), int(resp))
            offset += int(length)
            res["log_probs"].append(log_prob[a:b])
            if with_entropy:
                res["entropy"].append(entropy[a:b])
        return torch.empty(0, device=logits.device), res


HARNESS = Declaration(
    # What the memory checks hold this routine to (docs/memory.md), in units of T * V_local * 4 bytes
    # plus O(T): one saved float32 softmax, and the eager temporaries of an unchunked call.
    memory_budget={"retained": 1.0, "peak_forward": 9.0, "peak_backward": 9.0},
    # Its wrapper takes bf16 and fp16 logits too: the kernel upcasts them a chunk at a time.
    capabilities={"wrapper_half_precision": True},
)

ROUTINE = FusedLogProbEntropy()
calculate_log_probs_and_entropy = ROUTINE.calculate_log_probs_and_entropy
get_log_probs_and_entropy = ROUTINE.get_log_probs_and_entropy



class FusedLinearLogProbEntropy(FusedLinearSteps, FusedLogProbEntropy):
    """The fused-linear level's built-in routine (harness/targets/fused_linear.py): its steps on
    this routine's vocab-parallel statistics and collectives."""


# The default target provides all three levels (docs/fused-linear.md).
LINEAR_ROUTINE = FusedLinearLogProbEntropy()
calculate_linear_log_probs_and_entropy = LINEAR_ROUTINE.calculate_linear_log_probs_and_entropy

# And the distillation level (docs/distill.md), its steps in fused_distill.py.
distill_log_softmax = DISTILL_ROUTINE.distill_log_softmax
distill_topk = DISTILL_ROUTINE.distill_topk
distill_gather = DISTILL_ROUTINE.distill_gather
distill_divergence = DISTILL_ROUTINE.distill_divergence

# And the KL-estimator level (docs/kl.md), its steps in fused_kl.py.
kl_estimate = KL_ROUTINE.kl_estimate

# And the fused-linear distillation level (docs/linear-distill.md), its steps in fused_linear_distill.py.
linear_distill_loss = LINEAR_DISTILL_ROUTINE.linear_distill_loss
