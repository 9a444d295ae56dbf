"""Level-1 defects: each class overrides exactly one step of the built-in routine.

Named for the level it breaks, as `reference/kernel.py` computes that level and `checks/kernel.py`
checks it: a level keeps one module name across the layers."""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant

TP_ONLY = (2, 4)  # a collective or sharding defect is invisible on a single rank


def _skip_stat(stat_name: str) -> type[Fused]:
    class SkipsOneReduction(Fused):
        def reduce_stats(self, stats, op, group):
            # Left out of the stacked reduction: this shard's value is used as if it were the global one.
            reduced = super().reduce_stats({k: v for k, v in stats.items() if k != stat_name}, op, group)
            return {**stats, **reduced}
    return SkipsOneReduction


for _stat in ("max", "sumexp", "target_logit", "entropy_term"):
    mutant(f"missing-allreduce-{_stat.replace('_', '-')}", "missing all-reduce",
           ("values",), "ms-swift #9947 (a reduction missing across vocab shards)", tp=TP_ONLY)(_skip_stat(_stat))


@mutant("wrong-shard-offset", "wrong shard offsets", ("values", "gradients", "tp-invariance"), tp=TP_ONLY)
class WrongShardOffset(Fused):
    def shard_start(self, rank, v_local):
        return 0  # every rank believes it owns the first shard


@mutant("shard-boundary-off-by-one", "off-by-one shard boundary", ("values",),
        "Megatron-LM #1754 (shard boundaries)", tp=TP_ONLY)
class ShardBoundaryOffByOne(Fused):
    def owned(self, local_ids, v_local):
        return (local_ids >= 0) & (local_ids <= v_local)


@mutant("chunk-dropped", "chunks dropped", ("chunk-invariance", "shapes-dtypes"))
class ChunkDropped(Fused):
    def chunk_bounds(self, num_rows, chunk_size):
        bounds = super().chunk_bounds(num_rows, chunk_size)
        return bounds[:-1] if len(bounds) > 1 else bounds


@mutant("chunks-reordered", "chunks reordered", ("chunk-invariance", "values"))
class ChunksReordered(Fused):
    def concat(self, parts, empty_like):
        return super().concat(list(reversed(parts)), empty_like)


@mutant("mask-applied-to-entropy", "keep mask applied to the entropy", ("values", "wrapper-entropy"))
class MaskAppliedToEntropy(Fused):
    def entropy_inputs(self, unmasked, masked):
        return masked


@mutant("target-not-restored", "target not restored under the keep mask", ("values", "finite"))
class TargetNotRestored(Fused):
    def restore_target(self, keep_local, rows, cols):
        return keep_local.clone()


@mutant("entropy-always-differentiable", "entropy always differentiable", ("grad-flags",),
        "slime #2153 (metric-only entropy kept its gradient)")
class EntropyAlwaysDifferentiable(Fused):
    def entropy_differentiable(self, with_entropy, with_entropy_grad, requires_grad):
        return bool(with_entropy and requires_grad)


@mutant("entropy-never-differentiable", "entropy never differentiable", ("grad-flags", "gradients"))
class EntropyNeverDifferentiable(Fused):
    def entropy_differentiable(self, with_entropy, with_entropy_grad, requires_grad):
        return False


@mutant("input-modified-in-place", "input modified in place", ("input-integrity",),
        "Megatron-LM #1594, verl #1672/#2484 (.float() aliases float32 logits)")
class InputModifiedInPlace(Fused):
    def masked_logits(self, x, keep):
        return x.masked_fill_(~keep, float("-inf"))  # x aliases the caller's float32 logits


@mutant("gradient-quantized-bf16", "gradient quantized to bf16", ("gradients",),
        "slime #2152 (log-prob gradient cast to bfloat16)")
class GradientQuantizedBf16(Fused):
    def cast_grad(self, grad, dtype):
        return grad.to(torch.bfloat16).to(dtype)


@mutant("low-precision-math", "math in the input's low precision", ("values",))
class LowPrecisionMath(Fused):
    def compute_dtype(self, logits):
        return logits.dtype


@mutant("entropy-grad-sign", "entropy-gradient sign error", ("gradients", "wrapper-gradients"))
class EntropyGradSign(Fused):
    def entropy_grad_term(self, p, log_p, entropy):
        return -super().entropy_grad_term(p, log_p, entropy)


@mutant("entropy-grad-scale", "entropy-gradient scale error", ("gradients",))
class EntropyGradScale(Fused):
    def entropy_grad_term(self, p, log_p, entropy):
        return 2.0 * super().entropy_grad_term(p, log_p, entropy)


@mutant("empty-input-crash", "empty input crashing", ("empty-input",))
class EmptyInputCrash(Fused):
    def concat(self, parts, empty_like):
        return torch.cat(list(parts))  # torch.cat([]) raises when there were no chunks


@mutant("rank-divergent-collective", "rank-divergent collective", ("collectives",),
        "slime #1822 (metric-only entropy left collectives unmatched: comm stuck)", tp=TP_ONLY)
class RankDivergentCollective(Fused):
    def reduce_stats(self, stats, op, group):
        reduced = super().reduce_stats(stats, op, group)
        odd_chunk = "entropy_term" in stats and stats["entropy_term"].shape[0] % 2
        if odd_chunk and dist.is_initialized() and dist.get_rank(group) == 0:
            # Rank 0 alone issues one more all-reduce after the entropy's, on odd-sized chunks only.
            self.all_reduce(torch.zeros(1), dist.ReduceOp.SUM, group, "entropy_term")
        return reduced


@mutant("fp16-rejected", "a supported input dtype rejected", ("crash",))
class Fp16Rejected(Fused):
    def upcast(self, chunk):
        if chunk.dtype == torch.float16:
            raise TypeError("float16 logits are not supported")
        return super().upcast(chunk)


@mutant("entropy-nan-at-neginf", "0 * -inf in the entropy: NaN where a logit is -inf", ("finite", "values"),
        "found in slime's current main: NaN entropy and gradients when a logit is -inf")
class EntropyNanAtNegInf(Fused):
    def entropy_term(self, x, e, m):
        return (e * (x - m.unsqueeze(-1))).sum(dim=-1)


@mutant("extra-allreduce-rank0-metric-only", "one more collective on rank 0 when the entropy is metric-only",
        ("hang", "collectives"), "slime #1822 (metric-only entropy left collectives unmatched: comm stuck)",
        tp=TP_ONLY)
class ExtraAllReduceRank0MetricOnly(Fused):
    def calculate_log_probs_and_entropy(self, logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                        log_prob_keep_mask=None, with_entropy_grad=True):
        out = super().calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy, chunk_size,
                                                      log_prob_keep_mask, with_entropy_grad)
        needs_grad = bool(logits.requires_grad and torch.is_grad_enabled())
        metric_only = with_entropy and not self.entropy_differentiable(with_entropy, with_entropy_grad, needs_grad)
        group, world, rank = self.group_info(tp_group)
        if metric_only and world > 1 and rank == 0:
            # Rank 0 alone reduces a metric its peers never reduce: rank 1 returns, rank 0 waits.
            self.all_reduce(torch.zeros(1), dist.ReduceOp.SUM, group, "entropy_term")
        return out


@mutant("world-group-reduce", "reduction over the default (world) group instead of the TP group", ("values",),
        "a routine that ignores tp_group passes wherever the world is one TP group", tp=TP_ONLY)
class WorldGroupReduce(Fused):
    def all_reduce(self, tensor, op, group, stat):
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return tensor
        dist.all_reduce(tensor, op=op)  # no group: every rank of the world, other DP replicas included
        return tensor


# The far tail (the `fartail` regime): a log-prob of -50 to -110 is an ordinary float32 number, and an
# importance ratio exp(log p - log p_old) needs it. These floor or clamp it there.
@mutant("log-prob-eps-floor", "log(p + eps), eps 1e-20: the log-prob floored at -46", ("values",),
        "a routine that takes the log of a probability with an epsilon against log(0)")
class LogProbEpsFloor(Fused):
    def log_prob(self, target_logit, lse):
        return torch.log(torch.exp(super().log_prob(target_logit, lse)) + 1e-20)


@mutant("log-prob-clamped", "the log-prob clamped at -30", ("values",),
        "a routine that clamps log-probs (or logits) to keep a ratio or a loss finite")
class LogProbClamped(Fused):
    def log_prob(self, target_logit, lse):
        return super().log_prob(target_logit, lse).clamp_min(-30.0)
