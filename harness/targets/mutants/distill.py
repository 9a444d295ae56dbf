"""Distillation defects (docs/distill.md): each class overrides one step of the built-in distillation
routine (`harness/targets/fused_distill.py`) and is checked at the distillation level only.

Named for its level, as `reference/distill.py` is its oracle and `checks/distill.py` checks it: a
level keeps one module name across the layers."""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness.targets.fused_distill import FusedDistill
from harness.targets.mutants import mutant

DISTILL = ("distill",)
TP_ONLY = (2, 4)  # a sharding or collective defect is invisible on a single rank


@mutant("distill-grad-sum-not-reduced", "the backward's sum over the vocabulary left local (a reduction autograd "
        "does not see)", ("gradients",), "ms-swift's vocab_parallel_log_softmax: torch.distributed.all_reduce of "
        "the sum of exponentials, which autograd does not differentiate", tp=TP_ONLY, levels=DISTILL)
class GradSumNotReduced(FusedDistill):
    def reduce_grad_sum(self, sums, group):
        return sums  # each rank's own shard's share of the normaliser's gradient only


@mutant("distill-topk-id-off-by-a-shard", "top-k candidates of rank r labelled with rank r-1's global ids",
        ("values",), tp=TP_ONLY, levels=DISTILL)
class TopkIdOffByAShard(FusedDistill):
    def local_topk(self, z, k, start):
        return super().local_topk(z, k, start - z.shape[-1] if start else start)


@mutant("distill-topk-ties-by-rank", "the top-k merge puts each rank's own candidates first, so ties across "
        "shards break differently on each rank", ("values",), tp=TP_ONLY, levels=DISTILL)
class TopkTiesByRank(FusedDistill):
    def topk_ids(self, z, k, start, vocab, group):
        values, ids = self.local_topk(z, k, start)
        values, ids = self.all_gather(values, group, "topk_values"), self.all_gather(ids, group, "topk_ids")
        shift = dist.get_rank(group) * min(k, z.shape[-1]) if dist.is_initialized() else 0
        values, ids = values.roll(-shift, dims=-1), ids.roll(-shift, dims=-1)  # this rank's block first
        return self.merge_topk(values, ids, min(k, vocab))[1]


@mutant("distill-renormalized-on-own-shard", "a top-k support renormalized over the entries this rank's shard "
        "holds, not over the whole support", ("values",), tp=TP_ONLY, levels=DISTILL)
class RenormalizedOnOwnShard(FusedDistill):
    def support_log_softmax(self, values, ids, start, v_local):
        own, _ = self.owned(ids, start, v_local)
        return values.masked_fill(~own, float("-inf")).log_softmax(dim=-1)


@mutant("distill-bf16-sum-exp", "the sum of exponentials accumulated in bf16", ("values",), levels=DISTILL)
class Bf16SumExp(FusedDistill):
    def sum_exp(self, z, m):
        return (z - m.unsqueeze(-1)).exp().to(torch.bfloat16).sum(dim=-1, dtype=torch.bfloat16).float()


@mutant("distill-divergence-detached", "the divergence returned detached from the student's logits",
        ("grad-flags", "gradients"), levels=DISTILL)
class DivergenceDetached(FusedDistill):
    def distill_divergence(self, student_logits, tp_group, **kw):
        return super().distill_divergence(student_logits, tp_group, **kw).detach()


@mutant("distill-teacher-grad-dropped", "no gradient for a differentiable teacher's logits", ("gradients",),
        levels=DISTILL)
class TeacherGradDropped(FusedDistill):
    def divergence_backward(self, ctx, grad):
        return super().divergence_backward(ctx, grad)[0], None


@mutant("distill-vocab-gathered", "the logits all-gathered to the whole vocabulary for the normaliser",
        ("memory-no-vocab-gather",), tp=TP_ONLY, levels=DISTILL)
class VocabGathered(FusedDistill):
    def normalisers(self, zs, group):
        return [torch.logsumexp(self.all_gather(z, group, "logits"), dim=-1) for z in zs]


@mutant("distill-masked-shard-skips-sum", "a rank whose chunk has a row with no finite logit skips the sum's "
        "all-reduce: its next collective meets the others' sum, whose size differs, and gloo aborts the process "
        "(or, with none after it, the others wait in theirs)",
        ("crash", "hang", "collectives"), tp=TP_ONLY, levels=DISTILL)
class MaskedShardSkipsSum(FusedDistill):
    def normalisers(self, zs, group):
        if any(bool((~torch.isfinite(z)).all(-1).any()) for z in zs):
            return [torch.logsumexp(z, dim=-1) for z in zs]  # "nothing to add from this shard"
        return super().normalisers(zs, group)


@mutant("distill-logits-float32-before-chunks", "the whole logits cast to float32 in front of the chunked top-k, "
        "divergence, gather and log-softmax, the copy freed when the forward returns", ("memory-logits-dtype",),
        "NeMo-RL #2872 (a caller's .to(torch.float32) of the whole logits in front of the chunked routine)",
        levels=DISTILL)
class LogitsFloat32BeforeChunks(FusedDistill):
    def chunk_source(self, logits):
        # "One cast, then cheap chunks": the same values, and a float32 copy of all the rows at the
        # forward's peak. The backward still recomputes from the caller's logits, in their dtype.
        return logits.float()


@mutant("distill-temperature-student-only", "the teacher's logits not divided by the temperature",
        ("divergence-self-zero", "values"), levels=DISTILL)
class TemperatureStudentOnly(FusedDistill):
    def distill_divergence(self, student_logits, tp_group, **kw):
        teacher, temperature = kw.get("teacher_logits"), kw.get("temperature", 1.0)
        if teacher is not None and temperature != 1.0:
            kw["teacher_logits"] = teacher * temperature  # undone by the routine's division: the raw logits
        return super().distill_divergence(student_logits, tp_group, **kw)


@mutant("distill-logits-scaled-in-place", "the temperature applied in place to the caller's logits",
        ("input-integrity",), "Megatron-LM #1594 (.float() aliases float32 inputs)", levels=DISTILL)
class LogitsScaledInPlace(FusedDistill):
    def scaled(self, rows, temperature):
        z = rows.to(torch.float32)  # the caller's own rows for float32 logits
        return z.mul_(1.0 / temperature)  # values kept at temperature 1, but the caller's version bumped


@mutant("distill-chunk-first-rows", "every chunk reads the first chunk's ids and teacher log-probs",
        ("chunk-invariance", "values"), levels=DISTILL)
class ChunkFirstRows(FusedDistill):
    def rows_of(self, t, a, b):
        return t[:b - a]


@mutant("distill-empty-batch-raises", "T == 0 joins an empty list of chunks", ("empty-input",), levels=DISTILL)
class EmptyBatchRaises(FusedDistill):
    def concat(self, parts, empty):
        return torch.cat(parts)


@mutant("distill-output-in-input-dtype", "the output returned in the logits' dtype", ("shapes-dtypes",),
        levels=DISTILL)
class OutputInInputDtype(FusedDistill):
    def distill_divergence(self, student_logits, tp_group, **kw):
        return super().distill_divergence(student_logits, tp_group, **kw).to(student_logits.dtype)


@mutant("distill-nan-at-masked-vocab", "divergence terms without the zero-probability guard: 0 (log 0 - log 0) "
        "is NaN at a masked vocabulary entry", ("finite",), levels=DISTILL)
class NanAtMaskedVocab(FusedDistill):
    def terms(self, ls, lt, kind, beta):
        s, t = ls.exp(), lt.exp()
        fwd, rev = t * (lt - ls), s * (ls - lt)
        if kind == "jsd":
            lm = (beta * t + (1.0 - beta) * s).log()
            return beta * t * (lt - lm) + (1.0 - beta) * s * (ls - lm)
        return {"forward_kl": fwd, "reverse_kl": rev, "mixed": beta * fwd + (1.0 - beta) * rev, "soft_ce": -t * ls}[kind]


@mutant("distill-no-grad-path-differs", "under no_grad the divergence takes another path, which rounds it once "
        "more", ("inference-path",), levels=DISTILL)
class NoGradPathDiffers(FusedDistill):
    def distill_divergence(self, student_logits, tp_group, **kw):
        out = super().distill_divergence(student_logits, tp_group, **kw)
        return out if torch.is_grad_enabled() else out * (1.0 + 2.0 ** -23)


# The far tail (the `fartail` regime: the teacher's top entries 50 to 110 below the student's others).
@mutant("distill-student-log-eps", "the student's log-probs in the divergence as log(p + eps), eps 1e-10: floored "
        "at -23", ("values",), "a routine that takes the log of a softmax with an epsilon against log(0)", levels=DISTILL)
class StudentLogEps(FusedDistill):
    def terms(self, ls, lt, kind, beta):
        return super().terms((ls.exp() + 1e-10).log(), lt, kind, beta)


@mutant("distill-gather-log-eps", "the gathered log-probs as log(p + eps), eps 1e-20: floored at -46", ("values",),
        "a routine that takes the log of a softmax with an epsilon against log(0)", levels=DISTILL)
class GatherLogEps(FusedDistill):
    def gather_forward(self, ctx, logits, ids, group, temperature, chunk_size, renormalize):
        out = super().gather_forward(ctx, logits, ids, group, temperature, chunk_size, renormalize)
        return (out.exp() + 1e-20).log()


@mutant("distill-logits-clamped", "the logits clamped at 30 below their shard's largest before the softmax",
        ("values",), "a routine that clamps logits to keep exp and log finite", levels=DISTILL)
class LogitsClamped(FusedDistill):
    def scaled(self, rows, temperature):
        z = super().scaled(rows, temperature)
        top = z.amax(dim=-1, keepdim=True) if z.shape[-1] else z.new_zeros(z.shape[:-1] + (1,))
        return torch.maximum(z, torch.where(torch.isfinite(top), top, torch.zeros_like(top)) - 30.0)


# Defects of one combination of the contract (docs/distill.md: every combination is drawn, `distill_cover`).
@mutant("distill-mixed-weights-swapped", "the mixed divergence's weights swapped: beta on the reverse KL",
        ("values",), "a routine written from the docs: beta read as the reverse KL's weight", levels=DISTILL)
class MixedWeightsSwapped(FusedDistill):
    def _terms(self, ls, lt, kind, beta):
        return super()._terms(ls, lt, kind, 1.0 - beta if kind == "mixed" else beta)


@mutant("distill-given-temperature-ignored", "a teacher pass's top-k log-probs not divided by the temperature "
        "before they are renormalized", ("values",), "a routine written from the docs: the temperature applied "
        "to logits only", levels=DISTILL)
class GivenTemperatureIgnored(FusedDistill):
    def support_log_probs(self, zs, zt, teacher_log_probs, sup, start, group, temperature, renormalize):
        return super().support_log_probs(zs, zt, teacher_log_probs, sup, start, group,
                                         temperature if zt is not None else 1.0, renormalize)


@mutant("distill-soft-ce-teacher-unnormalized", "the soft cross-entropy over a renormalized top-k support with "
        "the teacher's log-probs of the whole vocabulary (or as given), not renormalized", ("values",),
        "a routine written from the docs: only the student's side renormalized", levels=DISTILL)
class SoftCeTeacherUnnormalized(FusedDistill):
    soft_ce = False

    def distill_divergence(self, student_logits, tp_group, **kw):
        self.soft_ce = kw.get("kind") == "soft_ce"  # the call's kind, for the support step below
        return super().distill_divergence(student_logits, tp_group, **kw)

    def support_log_probs(self, zs, zt, teacher_log_probs, sup, start, group, temperature, renormalize):
        ls, lt, lse = super().support_log_probs(zs, zt, teacher_log_probs, sup, start, group, temperature,
                                                renormalize)
        if renormalize and self.soft_ce:
            lt = super().support_log_probs(zs, zt, teacher_log_probs, sup, start, group, temperature, False)[1]
        return ls, lt, lse
