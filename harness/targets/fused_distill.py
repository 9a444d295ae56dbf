"""Built-in vocab-parallel distillation routines (docs/distill.md), the default target's `distill` level:

    distill_log_softmax(logits, tp_group, temperature=1.0, chunk_size=-1)
    distill_topk(logits, k, tp_group, temperature=1.0, chunk_size=-1)
    distill_gather(logits, indices, tp_group, temperature=1.0, chunk_size=-1, renormalize=False)
    distill_divergence(student_logits, tp_group, *, teacher_logits=None, teacher_topk_log_probs=None,
                       teacher_topk_indices=None, k=0, kind="forward_kl", beta=0.5, temperature=1.0,
                       renormalize=True, chunk_size=-1)

Per row chunk, all float32, every rank issuing the same collectives (none without rows):

* **normalisers** `lse = m + log Σ exp(z - m)` of one or more row sets (student and teacher stacked):
  one all-reduce MAX of the local maxima (stat ``"max"``), one all-reduce SUM of the local sums of
  exponentials (``"sumexp"``);
* **gather at global ids**: each rank puts its own entries of the ids, 0 elsewhere, and one
  all-reduce SUM (``"gathered"``) gives every rank the values;
* **top-k**: each rank sorts its shard (stable: ties toward the lower id), all-gathers its first
  ``min(k, V_local)`` values and ids (``"topk_values"``, ``"topk_ids"``) in rank order, and every rank
  merges the same list with the same stable sort: the result is identical on every rank and breaks
  ties toward the lower global id, at any TP size;
* **divergence over the whole vocabulary**: the local sum of its terms, all-reduced (``"terms"``).

Backward recomputes from the caller's logits and the saved O(T) normalisers (nothing ``[T, V_local]``
is saved but the log-softmax's own output), and works in float32 a chunk at a time: each chunk's
gradient is written into a buffer in the logits' own dtype (`grad_buffer`), so a bf16 caller never
holds a float32 gradient of all its logits (NeMo-RL #2872, `memory-logits-dtype`). A sharded
output's gradient needs the sum over every rank of the upstream gradient (one all-reduce SUM,
``"grad_sum"``), as does the whole-vocabulary divergence's (``"grad_sum"``); a replicated output's
(gather, a top-k support) needs none: each rank's upstream gradient is already the whole loss's.

Every concern is a method, so a mutant overrides exactly one (`harness/targets/mutants/distill.py`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["DISTILL_ROUTINE", "FusedDistill"]


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, routine, group, temperature, chunk_size):
        return routine.log_softmax_forward(ctx, logits, group, temperature, chunk_size)

    @staticmethod
    def backward(ctx, grad):
        return ctx.routine.log_softmax_backward(ctx, grad), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, routine, group, temperature, chunk_size, renormalize):
        return routine.gather_forward(ctx, logits, ids, group, temperature, chunk_size, renormalize)

    @staticmethod
    def backward(ctx, grad):
        return ctx.routine.gather_backward(ctx, grad), None, None, None, None, None, None


class _Divergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, teacher_log_probs, ids, routine, group, k, kind, beta, temperature,
                renormalize, chunk_size):
        return routine.divergence_forward(ctx, student, teacher, teacher_log_probs, ids, group, k, kind, beta,
                                          temperature, renormalize, chunk_size)

    @staticmethod
    def backward(ctx, grad):
        g_student, g_teacher = ctx.routine.divergence_backward(ctx, grad)
        return (g_student, g_teacher) + (None,) * 10


class FusedDistill:
    """Vocab-parallel distillation routines, one overridable method per concern."""

    # ------------------------------------------------------------------ collectives / sharding
    def group_info(self, tp_group) -> tuple[Any, int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        return tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group)

    def all_reduce(self, tensor: torch.Tensor, op, group, stat: str) -> torch.Tensor:
        """Every all-reduce goes through here (in place on a tensor of the routine's own);
        ``stat`` names what is reduced."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return tensor
        dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group, stat: str) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the last dimension, in rank order."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    def reduce_grad_sum(self, sums: torch.Tensor, group) -> torch.Tensor:
        """The backward's sum over the whole vocabulary of a gradient the forward's normaliser mixed:
        each rank's local sums, reduced over the group."""
        return self.all_reduce(sums, dist.ReduceOp.SUM, group, "grad_sum")

    def shard_start(self, rank: int, v_local: int) -> int:
        return rank * v_local

    def chunk_bounds(self, num_rows: int, chunk_size: int) -> list[tuple[int, int]]:
        step = chunk_size if chunk_size > 0 else max(num_rows, 1)
        return [(s, min(s + step, num_rows)) for s in range(0, num_rows, step)]

    def rows_of(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """A per-row input's rows of the chunk ``[a, b)`` (ids, a teacher pass's log-probs)."""
        return t[a:b]

    def concat(self, parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
        """The chunks' results joined, or `empty` when there are no rows (T == 0)."""
        return torch.cat(parts) if parts else empty

    # ------------------------------------------------------------------ float32 arithmetic
    def chunk_source(self, logits: torch.Tensor) -> torch.Tensor:
        """What a forward's chunks read their rows from: the caller's logits as they are, in their
        dtype, so that float32 exists a chunk at a time (`scaled`), never for all the rows at once."""
        return logits

    def scaled(self, rows: torch.Tensor, temperature: float) -> torch.Tensor:
        """``z = x / temperature`` in float32, never in place (``.float()`` of float32 is the input)."""
        z = rows.to(torch.float32)
        return z / temperature if temperature != 1.0 else z

    def row_max(self, z: torch.Tensor) -> torch.Tensor:
        return z.amax(dim=-1) if z.shape[-1] else z.new_full(z.shape[:-1], float("-inf"))

    def finite_shift(self, m: torch.Tensor) -> torch.Tensor:
        """The global row max, or 0 for a row with no finite entry (no -inf - -inf)."""
        return torch.where(torch.isfinite(m), m, torch.zeros_like(m))

    def sum_exp(self, z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return (z - m.unsqueeze(-1)).exp().sum(dim=-1)

    def normalisers(self, zs: list[torch.Tensor], group) -> list[torch.Tensor]:
        """``lse`` `[rows]` of each row set (their whole vocabulary: every rank's shard), stacked into
        one all-reduce MAX and one all-reduce SUM."""
        m = self.all_reduce(torch.stack([self.row_max(z) for z in zs]), dist.ReduceOp.MAX, group, "max")
        m = self.finite_shift(m)
        s = self.all_reduce(torch.stack([self.sum_exp(z, mi) for z, mi in zip(zs, m, strict=True)]),
                            dist.ReduceOp.SUM, group, "sumexp")
        return list(m + s.log())

    def owned(self, ids: torch.Tensor, start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(which global ids this shard holds, their local index, 0 where not held)."""
        own = (ids >= start) & (ids < start + v_local)
        return own, torch.where(own, ids - start, torch.zeros_like(ids))

    def gather_values(self, zs: list[torch.Tensor], ids: torch.Tensor, start: int, group) -> list[torch.Tensor]:
        """The values of each row set at the global ids `[rows, K]`, on every rank: this shard's own
        entries, 0 elsewhere, summed over the group (one all-reduce SUM)."""
        own, local = self.owned(ids, start, zs[0].shape[-1])
        parts = [torch.where(own, z.gather(-1, local), torch.zeros((), dtype=z.dtype)) for z in zs]
        return list(self.all_reduce(torch.stack(parts), dist.ReduceOp.SUM, group, "gathered"))

    def local_topk(self, z: torch.Tensor, k: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's first ``min(k, V_local)`` values by a stable descending sort, global ids."""
        kl = min(k, z.shape[-1])
        values, local = torch.sort(z, dim=-1, descending=True, stable=True)
        return values[:, :kl], local[:, :kl] + start

    def merge_topk(self, values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``k`` of every rank's candidates (concatenated in rank order) by a stable sort."""
        order = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
        return values.gather(-1, order), ids.gather(-1, order)

    def topk_ids(self, z: torch.Tensor, k: int, start: int, vocab: int, group) -> torch.Tensor:
        """The global ids of one top-k of every row `[rows, min(k, V)]`, identical on every rank."""
        values, ids = self.local_topk(z, k, start)
        values = self.all_gather(values, group, "topk_values")
        ids = self.all_gather(ids, group, "topk_ids")
        return self.merge_topk(values, ids, min(k, vocab))[1]

    # ------------------------------------------------------------------ divergence terms
    def terms(self, ls: torch.Tensor, lt: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
        """The contract's per-entry terms f(p_s, p_t) (0 where both are 0)."""
        return self._terms(ls, lt, kind, beta)[0]

    def partials(self, ls: torch.Tensor, lt: torch.Tensor, kind: str, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(df/dlog p_s, df/dlog p_t) per entry."""
        _, a, b = self._terms(ls, lt, kind, beta)
        return a, b

    def _terms(self, ls: torch.Tensor, lt: torch.Tensor, kind: str, beta: float) -> tuple[torch.Tensor, ...]:
        s, t = ls.exp(), lt.exp()
        zero = torch.zeros((), dtype=ls.dtype)
        # Log-probabilities where their probability is 0 are replaced before any product.
        ls0, lt0 = torch.where(s > 0, ls, zero), torch.where(t > 0, lt, zero)
        if kind == "jsd":
            m = beta * t + (1.0 - beta) * s
            lm = torch.where(m > 0, m, torch.ones_like(m)).log()
            a = (1.0 - beta) * s * (ls0 - lm)
            b = beta * t * (lt0 - lm)
            return a + b, a, b
        ls_t, lt_s = torch.where(t > 0, ls, zero), torch.where(s > 0, lt, zero)  # ls where t lives, ...
        fwd = (t * (lt0 - ls_t), -t, t * (lt0 - ls_t + 1.0))
        rev = (s * (ls0 - lt_s), s * (ls0 - lt_s + 1.0), -s)
        if kind == "forward_kl":
            return fwd
        if kind == "reverse_kl":
            return rev
        if kind == "mixed":
            return tuple(beta * f + (1.0 - beta) * r for f, r in zip(fwd, rev, strict=True))
        if kind == "soft_ce":
            return -t * ls_t, -t, -t * ls_t
        raise ValueError(f"unknown divergence kind {kind!r}")

    # ------------------------------------------------------------------ log-softmax (sharded output)
    def log_softmax_forward(self, ctx, logits, group, temperature, chunk_size):
        group, _, _ = self.group_info(group)
        out, source = [], self.chunk_source(logits)
        for a, b in self.chunk_bounds(logits.shape[0], chunk_size):
            z = self.scaled(source[a:b], temperature)
            (lse,) = self.normalisers([z], group)
            out.append(z - lse.unsqueeze(-1))
        # The T == 0 answer has zero rows: shaped like the logits, it would be a float32 [T, V_local] every call.
        result = self.concat(out, logits.new_zeros((0, logits.shape[-1]), dtype=torch.float32))
        ctx.routine, ctx.group, ctx.temperature, ctx.chunk_size = self, group, temperature, chunk_size
        ctx.dtype = logits.dtype
        ctx.save_for_backward(result)
        return result

    def grad_buffer(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The gradient of logits shaped like `like`, in their own `dtype`: every chunk writes its rows."""
        return torch.empty(like.shape, dtype=dtype, device=like.device)

    def log_softmax_backward(self, ctx, grad):
        (out,) = ctx.saved_tensors
        grad_logits = self.grad_buffer(out, ctx.dtype)
        for a, b in self.chunk_bounds(out.shape[0], ctx.chunk_size):
            g = grad[a:b].to(torch.float32)
            total = self.reduce_grad_sum(g.sum(dim=-1), ctx.group)  # the loss is every rank's shards' sum
            grad_logits[a:b] = (g - out[a:b].exp() * total.unsqueeze(-1)) / ctx.temperature
        return grad_logits

    # ------------------------------------------------------------------ gather at global ids
    def gather_forward(self, ctx, logits, ids, group, temperature, chunk_size, renormalize):
        group, _, rank = self.group_info(group)
        start = self.shard_start(rank, logits.shape[-1])
        out, lses, source = [], [], self.chunk_source(logits)
        for a, b in self.chunk_bounds(logits.shape[0], chunk_size):
            z = self.scaled(source[a:b], temperature)
            rows = self.rows_of(ids, a, b)
            (values,) = self.gather_values([z], rows, start, group)
            if renormalize:
                out.append(self.support_log_softmax(values, rows, start, z.shape[-1]))
            else:
                (lse,) = self.normalisers([z], group)
                lses.append(lse)
                out.append(values - lse.unsqueeze(-1))
        result = self.concat(out, logits.new_zeros((0, ids.shape[-1]), dtype=torch.float32))
        lse = torch.cat(lses) if lses else logits.new_zeros(0, dtype=torch.float32)
        ctx.routine, ctx.temperature, ctx.chunk_size, ctx.renormalize = self, temperature, chunk_size, renormalize
        ctx.start, ctx.dtype = start, logits.dtype
        ctx.save_for_backward(logits, ids, result, lse)
        return result

    def support_log_softmax(self, values: torch.Tensor, ids: torch.Tensor, start: int, v_local: int) -> torch.Tensor:
        """The log-softmax over a row's K gathered values (each rank holds all of them)."""
        return values.log_softmax(dim=-1)

    def gather_backward(self, ctx, grad):
        logits, ids, out, lse = ctx.saved_tensors
        grad_logits = self.grad_buffer(logits, ctx.dtype)
        for a, b in self.chunk_bounds(logits.shape[0], ctx.chunk_size):
            g = grad[a:b].to(torch.float32)
            if ctx.renormalize:  # d log q_j / d z_i over the support: [i == j] - q_i
                part = torch.zeros((b - a, logits.shape[-1]), dtype=torch.float32, device=logits.device)
                self.scatter_owned(part, ids[a:b], g - out[a:b].exp() * g.sum(-1, keepdim=True), ctx.start)
            else:  # d (z_j - lse) / d z_u = [u == id_j] - p_u
                z = self.scaled(logits[a:b], ctx.temperature)
                part = -((z - lse[a:b].unsqueeze(-1)).exp() * g.sum(-1, keepdim=True))
                self.scatter_owned(part, ids[a:b], g, ctx.start)
            grad_logits[a:b] = part / ctx.temperature
        return grad_logits

    def scatter_owned(self, out: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Add `values` at the global ids this shard holds (in place on the routine's own buffer)."""
        own, local = self.owned(ids, start, out.shape[-1])
        out.scatter_add_(-1, local, torch.where(own, values, torch.zeros((), dtype=values.dtype)))

    # ------------------------------------------------------------------ top-k (the teacher's pass)
    @torch.no_grad()
    def topk(self, logits, k, group, temperature, chunk_size) -> tuple[torch.Tensor, torch.Tensor]:
        group, world, rank = self.group_info(group)
        v_local = logits.shape[-1]
        start, vocab = self.shard_start(rank, v_local), v_local * world
        width = min(k, vocab)
        values, ids, source = [], [], self.chunk_source(logits)
        for a, b in self.chunk_bounds(logits.shape[0], chunk_size):
            z = self.scaled(source[a:b], temperature)
            top = self.topk_ids(z, k, start, vocab, group)
            (gathered,) = self.gather_values([z], top, start, group)
            (lse,) = self.normalisers([z], group)
            values.append(gathered - lse.unsqueeze(-1))
            ids.append(top)
        return (self.concat(values, logits.new_zeros((0, width), dtype=torch.float32)),
                self.concat(ids, torch.zeros((0, width), dtype=torch.int64, device=logits.device)))

    # ------------------------------------------------------------------ divergence
    def divergence_forward(self, ctx, student, teacher, teacher_log_probs, ids, group, k, kind, beta, temperature,
                           renormalize, chunk_size):
        group, world, rank = self.group_info(group)
        v_local = student.shape[-1]
        start = self.shard_start(rank, v_local)
        whole = teacher is not None and k <= 0
        out, lses, supports, on_support = [], [], [], []
        source_s = self.chunk_source(student)
        source_t = self.chunk_source(teacher) if teacher is not None else None
        for a, b in self.chunk_bounds(student.shape[0], chunk_size):
            zs = self.scaled(source_s[a:b], temperature)
            zt = self.scaled(source_t[a:b], temperature) if source_t is not None else None
            if whole:
                assert zt is not None
                lse_s, lse_t = self.normalisers([zs, zt], group)
                lses.append(torch.stack([lse_s, lse_t]))
                local = self.terms(zs - lse_s.unsqueeze(-1), zt - lse_t.unsqueeze(-1), kind, beta).sum(dim=-1)
                out.append(self.all_reduce(local, dist.ReduceOp.SUM, group, "terms"))
                continue
            sup = self.topk_ids(zt, k, start, v_local * world, group) if zt is not None else self.rows_of(ids, a, b)
            given = None if zt is not None else self.rows_of(teacher_log_probs, a, b)
            ls, lt, lse = self.support_log_probs(zs, zt, given, sup,
                                                 start, group, temperature, renormalize)
            supports.append(sup)
            on_support.append(torch.stack([ls, lt]))
            lses.append(lse)
            out.append(self.terms(ls, lt, kind, beta).sum(dim=-1))
        rows = student.shape[0]
        result = self.concat(out, student.new_zeros(rows, dtype=torch.float32))
        ctx.routine, ctx.group, ctx.kind, ctx.beta, ctx.temperature = self, group, kind, beta, temperature
        ctx.renormalize, ctx.chunk_size, ctx.start, ctx.whole = renormalize, chunk_size, start, whole
        ctx.dtypes = (student.dtype, teacher.dtype if teacher is not None else None)
        lse = torch.cat(lses, dim=-1) if lses else student.new_zeros((2, 0), dtype=torch.float32)
        sup = torch.cat(supports) if supports else None
        logp = torch.cat(on_support, dim=1) if on_support else None  # [2, T, K]: O(T K), never [T, V_local]
        ctx.save_for_backward(student, teacher, sup, logp, lse)
        return result

    def support_log_probs(self, zs, zt, teacher_log_probs, sup, start, group, temperature, renormalize):
        """(log p_s, log p_t) on the support `[rows, K]` (every rank holds them), and the whole
        vocabulary's normalisers `[2, rows]` they used (0 where renormalized over the support)."""
        if zt is not None:
            vs, vt = self.gather_values([zs, zt], sup, start, group)
        else:
            (vs,) = self.gather_values([zs], sup, start, group)
            vt = teacher_log_probs.to(torch.float32)
        if renormalize:
            vt = vt if zt is not None else self.scaled(vt, temperature)
            lse = torch.zeros((2, zs.shape[0]), dtype=torch.float32, device=zs.device)
            return (self.support_log_softmax(vs, sup, start, zs.shape[-1]),
                    self.support_log_softmax(vt, sup, start, zs.shape[-1]), lse)
        if zt is not None:
            lse_s, lse_t = self.normalisers([zs, zt], group)
            return vs - lse_s.unsqueeze(-1), vt - lse_t.unsqueeze(-1), torch.stack([lse_s, lse_t])
        (lse_s,) = self.normalisers([zs], group)
        return vs - lse_s.unsqueeze(-1), vt, torch.stack([lse_s, torch.zeros_like(lse_s)])

    def divergence_backward(self, ctx, grad):
        student, teacher, sup, logp, lse = ctx.saved_tensors
        want_s, want_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and teacher is not None
        dtype_s, dtype_t = ctx.dtypes
        gs = self.grad_buffer(student, dtype_s) if want_s else None
        gt = self.grad_buffer(teacher, dtype_t) if want_t and teacher is not None else None
        for a, b in self.chunk_bounds(student.shape[0], ctx.chunk_size):
            g = grad[a:b].to(torch.float32).unsqueeze(-1)
            zs = self.scaled(student[a:b], ctx.temperature)
            zt = self.scaled(teacher[a:b], ctx.temperature) if teacher is not None else None
            if ctx.whole:
                assert zt is not None
                ls, lt = zs - lse[0, a:b].unsqueeze(-1), zt - lse[1, a:b].unsqueeze(-1)
                da, db = self.partials(ls, lt, ctx.kind, ctx.beta)
                sums = self.reduce_grad_sum(torch.stack([da.sum(-1), db.sum(-1)]), ctx.group)
                if gs is not None:
                    gs[a:b] = g * (da - ls.exp() * sums[0].unsqueeze(-1)) / ctx.temperature
                if gt is not None:
                    gt[a:b] = g * (db - lt.exp() * sums[1].unsqueeze(-1)) / ctx.temperature
                continue
            ids, ls, lt = sup[a:b], logp[0, a:b], logp[1, a:b]
            da, db = self.partials(ls, lt, ctx.kind, ctx.beta)
            for out, d, z, l, row_lse in ((gs, da, zs, ls, lse[0, a:b]), (gt, db, zt, lt, lse[1, a:b])):
                if out is None or z is None:
                    continue
                if ctx.renormalize:  # the support's softmax: d log q_j / d z_i = [i == j] - q_i
                    part = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
                    self.scatter_owned(part, ids, g * (d - l.exp() * d.sum(-1, keepdim=True)), ctx.start)
                else:  # the whole vocabulary's: d log p_j / d z_u = [u == id_j] - p_u
                    part = -(g * (z - row_lse.unsqueeze(-1)).exp() * d.sum(-1, keepdim=True))
                    self.scatter_owned(part, ids, g * d, ctx.start)
                out[a:b] = part / ctx.temperature
        return gs, gt

    # ------------------------------------------------------------------ the contract's functions
    def distill_log_softmax(self, logits, tp_group, temperature=1.0, chunk_size=-1):
        return _LogSoftmax.apply(logits, self, tp_group, temperature, chunk_size)

    def distill_topk(self, logits, k, tp_group, temperature=1.0, chunk_size=-1):
        return self.topk(logits, k, tp_group, temperature, chunk_size)

    def distill_gather(self, logits, indices, tp_group, temperature=1.0, chunk_size=-1, renormalize=False):
        return _Gather.apply(logits, indices.to(torch.int64), self, tp_group, temperature, chunk_size, renormalize)

    def distill_divergence(self, student_logits, tp_group, *, teacher_logits: Optional[torch.Tensor] = None,
                           teacher_topk_log_probs: Optional[torch.Tensor] = None,
                           teacher_topk_indices: Optional[torch.Tensor] = None, k=0, kind="forward_kl", beta=0.5,
                           temperature=1.0, renormalize=True, chunk_size=-1):
        if (teacher_logits is None) == (teacher_topk_log_probs is None):
            raise ValueError("give the teacher's logits or its top-k log-probs and ids, not both or neither")
        ids = teacher_topk_indices.to(torch.int64) if teacher_topk_indices is not None else None
        return _Divergence.apply(student_logits, teacher_logits, teacher_topk_log_probs, ids, self, tp_group, k, kind,
                                 beta, temperature, renormalize, chunk_size)


DISTILL_ROUTINE = FusedDistill()
