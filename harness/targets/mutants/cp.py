"""Context-parallel defects of the wrapper (docs/contract.md, "Context parallelism") and the TP-rank
mistake that only a TP group off world rank 0 shows: each class overrides exactly one step.

Named for what it breaks, as `reference/cp.py` computes the CP layouts: one module name across the
layers."""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness.targets.fused import CPLayout
from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant


@mutant("cp-absent-piece-requires-grad", "all-gather CP: a rank without response rows builds its piece as a "
        "fresh requires_grad=True tensor", ("entropy-coef-rule", "hang"),
        "slime #2123 (training stuck on all-gather CP)", tp=(1, 2))
class AbsentPieceRequiresGrad(Fused):
    def cp_absent_piece(self, response_length, like):
        return torch.zeros(response_length, dtype=like.dtype, device=like.device, requires_grad=True)


@mutant("zigzag-offset-off-by-one", "zigzag CP: the second chunk's rows start one row late",
        ("wrapper-extraction", "cp-invariance"), "slime #73 (a zigzag context-parallel offset)", tp=(1, 2))
class ZigzagOffsetOffByOne(Fused):
    def zigzag_bounds(self, length, cp_size, chunk):
        s, e = super().zigzag_bounds(length, cp_size, chunk)
        return (s + 1, e + 1) if chunk >= cp_size else (s, e)


@mutant("cp-reduce-over-tp-group", "all-gather CP: the response pieces are summed over the TP group, not the "
        "CP group", ("wrapper-extraction",), tp=(1, 2))
class ReduceOverTPGroup(Fused):
    def cp_reduce_group(self, cp_group, tp_group):
        return tp_group


@mutant("cp-reduce-over-world", "all-gather CP: the response pieces are summed over the world, not the CP group",
        ("wrapper-extraction",), tp=(1, 2))
class ReduceOverWorld(Fused):
    def cp_reduce_group(self, cp_group, tp_group):
        return dist.group.WORLD


@mutant("top-p-mask-wrong-cp-layout", "CP: the top-p keep mask is built for the other CP layout's rows",
        ("top-p-replay",), tp=(1, 2))
class TopPMaskWrongLayout(Fused):
    def cp_keep_mask(self, num_rows, v_local, rank, sample, k, top_p_token_ids, top_p_token_offsets, device,
                     layout: CPLayout):
        other = layout._replace(allgather=not layout.allgather)
        s, pos = self.cp_rows(num_rows, other.total_lengths, other.size, other.rank, other.allgather, device)
        s, pos = s[:num_rows], pos[:num_rows]  # the other layout may hold more rows: cut to the logits'
        pad = num_rows - s.numel()
        s = torch.cat([s, s.new_full((pad,), -1)])
        pos = torch.cat([pos, pos.new_zeros(pad)])
        k = self.cp_response_index(s, pos, other.total_lengths, other.response_lengths)
        return super().cp_keep_mask(num_rows, v_local, rank, s, k, top_p_token_ids, top_p_token_offsets, device,
                                    other)


@mutant("world-rank-as-tp-rank", "the world rank taken for the TP rank (dist.get_rank() instead of "
        "dist.get_rank(group=tp_group)): a wrong vocab shard offset in every TP group off world rank 0",
        ("values", "wrapper-extraction"), tp=(2,))
class WorldRankAsTPRank(Fused):
    def group_info(self, tp_group):
        group, world, _rank = super().group_info(tp_group)
        if not (dist.is_available() and dist.is_initialized()):
            return group, world, _rank
        return group, world, dist.get_rank()


class _GatherRows(torch.autograd.Function):
    """Every CP rank's rows of `x`, in CP rank order. Backward: this rank's rows of the gradient, for
    no other rank keeps a result computed from them."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        ctx.rows, ctx.rank = x.shape[0], rank
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None, None, None


@mutant("cp-gathered-logits", "CP: the logits are gathered over the CP group and every rank computes every "
        "rank's rows, keeping its own rows' results: right values, CP times the memory of its rows",
        ("memory-budget",), tp=(1, 2))
class GatheredLogits(Fused):
    def calculate_log_probs_and_entropy(self, logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                        log_prob_keep_mask=None, with_entropy_grad=True):
        size, rank, group = self.cp_info()
        if size == 1:
            return super().calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy, chunk_size,
                                                           log_prob_keep_mask, with_entropy_grad)
        rows = logits.shape[0]
        mine = slice(rank * rows, (rank + 1) * rows)
        tokens = tokens.reshape(-1).to(torch.long)
        every = lambda t: _GatherRows.apply(t, group, rank, size)  # noqa: E731
        with torch.no_grad():
            all_tokens = every(tokens)
            keep = None if log_prob_keep_mask is None else every(log_prob_keep_mask.to(torch.uint8)).bool()
        log_prob, entropy = super().calculate_log_probs_and_entropy(
            every(logits), all_tokens, tp_group, with_entropy, chunk_size, keep, with_entropy_grad)
        return log_prob[mine], None if entropy is None else entropy[mine]
