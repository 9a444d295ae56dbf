"""The regression corpus: one named case per real defect in docs/contract.md's history, always run.

Each entry is data: the case that would have exposed the defect and the check that sees it.
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.cases.case import Case, DistillCase, KernelCase, LinearCase, WrapperCase
from harness.cases.linear_distill import LinearDistillCase


@dataclass(frozen=True)
class Regression:
    name: str
    history: str
    check: str
    case: Case | LinearDistillCase


def _d(**kw) -> DistillCase:
    base = dict(tp=2, T=6, v_local=5, seed=45)
    return DistillCase(**{**base, **kw})


def _ld(**kw) -> LinearDistillCase:
    base = dict(tp=1, T=9, H=6, v_local=13, chunk_size=4, labels="random", seed=1885)
    return LinearDistillCase(**{**base, **kw})


def _w(**kw) -> WrapperCase:
    base = dict(tp=2, v_local=5, total_lengths=(6, 4), response_lengths=(3, 2), seed=2153)
    return WrapperCase(**{**base, **kw})


CORPUS: tuple[Regression, ...] = (
    Regression("coef-zero-metric-only", "slime #2153: entropy_coef == 0 must give a metric-only entropy",
               "entropy-coef-rule", _w(entropy_coef=0.0)),
    Regression("coef-absent-metric-only", "slime #2153: an absent entropy_coef means 0", "entropy-coef-rule",
               _w(entropy_coef=None)),
    Regression("coef-negative-differentiable", "slime #2153: a negative coefficient is still a coefficient",
               "entropy-coef-rule", _w(entropy_coef=-0.01)),
    Regression("coef-zero-memory-behind-temperature", "slime #2153: a metric-only entropy must not keep the "
               "graph built for its gradient, which holds the wrapper's temperature-scaled copy of the logits",
               "memory-coef-zero", _w(v_local=16, entropy_coef=0.0, temperature=0.5)),
    Regression("coef-nonzero-inverted", "slime #1185/#1189: the no-grad condition shipped inverted",
               "entropy-coef-rule", _w(entropy_coef=0.01)),
    Regression("metric-only-collectives", "slime #1822: metric-only entropy left collectives unmatched",
               "collectives", KernelCase(tp=2, T=6, v_local=5, with_entropy_grad=False, seed=1822)),
    Regression("fp32-grad-not-quantized", "slime #2152: the log-prob gradient was cast to bf16",
               "gradients", KernelCase(tp=2, T=9, v_local=7, with_entropy=False, seed=2152)),
    Regression("one-output-in-loss", "slime #2158: a missing upstream gradient silently dropped a term",
               "gradients", KernelCase(tp=2, T=7, v_local=6, loss_terms="log_prob", seed=2158)),
    Regression("fp32-logits-not-mutated", "Megatron-LM #1594: .float() is a no-op on float32, so in-place ops "
               "mutated the caller's logits", "input-integrity", KernelCase(tp=2, T=5, v_local=4, seed=1594)),
    Regression("inplace-logits-entropy", "verl #1672/#2484: in-place edits of logits gave a wrong entropy",
               "input-integrity", KernelCase(tp=1, T=5, v_local=8, chunk_size=2, seed=1672)),
    Regression("peaked-odd-vocab", "verl #2656: padding added exp(0) to the log-sum-exp; peaked inputs see it",
               "values", KernelCase(tp=2, T=8, v_local=13, regime="peaked", seed=2656)),
    Regression("wrapper-chunk-size", "NeMo-RL #2871/#2872: the chunk size was ignored on the training path",
               "memory-chunk-passthrough", _w(v_local=64, chunk_size=2, entropy_coef=0.01)),
    Regression("chunked-grad-float32-buffer", "NeMo-RL #2871/#2872: a chunked backward zeroed a float32 gradient "
               "buffer of the whole bf16 logits", "memory-logits-dtype",
               KernelCase(tp=2, T=16, v_local=64, dtype="bf16", chunk_size=4, with_entropy=False, seed=2872)),
    Regression("wrapper-logits-float32", "NeMo-RL #2871/#2872: the caller cast the whole bf16 logits to float32 in "
               "front of the chunked kernel", "memory-logits-dtype",
               _w(v_local=64, chunk_size=2, entropy_coef=0.01, dtype="bf16")),
    Regression("caller-chunk-size-dropped", "NeMo-RL: a policy's logprob_chunk_size that its loss-side caller does "
               "not hand to the log-prob call: the call's memory is its unchunked call's", "memory-chunk-effect",
               _w(v_local=64, total_lengths=(9, 7), response_lengths=(4, 3), chunk_size=4, dtype="bf16",
                  with_entropy=False)),
    Regression("metric-only-memory", "slime #2144/#2153: a metric-only entropy must not pay for an entropy "
               "gradient's [T, V_local] buffers", "memory-metric-only",
               KernelCase(tp=2, T=8, v_local=64, dtype="bf16", mask="random", with_entropy_grad=False, seed=2144)),
    Regression("non-owner-shard-grads", "ms-swift #9947: non-owner vocab shards got wrong gradients at TP > 1",
               "gradients", KernelCase(tp=4, T=8, v_local=3, with_entropy=False, seed=9947)),
    Regression("odd-vocab-tp2", "Megatron-LM #1754: a vocab not divisible by the kernel block diverged at TP 2",
               "values", KernelCase(tp=2, T=6, v_local=7, seed=1754)),
    Regression("neginf-entropy-finite", "slime main (found by this harness): 0 * -inf made the entropy and its "
               "gradient NaN where a logit is -inf", "finite",
               KernelCase(tp=2, T=6, v_local=5, regime="neginf", seed=1)),
    Regression("empty-batch-tp4", "contract: T == 0 returns empty outputs without error", "empty-input",
               KernelCase(tp=4, T=0, v_local=4)),
    Regression("tp-group-not-world", "in training world = DP x TP: a reduction over the default group mixes "
               "replicas, invisible wherever the world is one TP group", "values",
               KernelCase(tp=2, T=5, v_local=4, mask="random", dp=2, seed=4242)),
    # How real callers hand the routine its inputs and call it (not a shipped defect each; the
    # shapes every trainer produces, where a kernel that assumes a fresh contiguous leaf breaks).
    Regression("transposed-logits", "caller: Megatron's [s, b, v] output turned into [b, s, v] is a transposed "
               "view; a kernel reading it as row-major gets wrong values silently", "values",
               KernelCase(tp=2, T=6, v_local=5, chunk_size=4, layout="transposed", seed=14)),
    Regression("column-strided-logits", "caller: a column-strided view of the logits", "values",
               KernelCase(tp=2, T=5, v_local=6, mask="random", layout="col_strided", seed=141)),
    Regression("sliced-logits-and-tokens", "caller: the wrapper's per-sample slices: storage offsets in the logits "
               "and the tokens", "wrapper-extraction", _w(layout="offset", token_layout="offset", entropy_coef=0.01)),
    Regression("non-leaf-logits", "caller: logits that are an op's output, as in training, where an in-place "
               "write corrupts the graph instead of raising", "input-integrity",
               KernelCase(tp=2, T=5, v_local=4, chunk_size=2, mask="random", layout="nonleaf", seed=142)),
    Regression("no-grad-keep-mask", "caller: old-policy/reference log-probs recomputed under torch.no_grad() "
               "must equal the training path bit for bit, keep mask included", "inference-path",
               KernelCase(tp=2, T=6, v_local=5, mask="random", context="no_grad", seed=143)),
    Regression("inference-mode-top-p", "caller: the wrapper under torch.inference_mode() with top-p replay and a "
               "temperature", "inference-path", _w(top_p="nucleus", temperature=0.7, context="inference_mode")),
    Regression("two-calls-one-graph", "caller: policy and KL terms from two calls on the same logits, losses "
               "summed, one backward", "gradients",
               KernelCase(tp=2, T=6, v_local=5, context="two_calls", token_layout="strided", seed=144)),
    Regression("microbatch-accumulation", "caller: two microbatches accumulated into the same .grad",
               "wrapper-gradients", _w(entropy_coef=0.01, context="accumulate")),
    # Context parallelism (docs/context-parallel.md): a rank holds its CP layout's rows of the sequence.
    Regression("cp-absent-piece-autograd", "slime #2123: under all-gather CP a rank holding none of a sample's "
               "response built its piece with requires_grad=True; with a metric-only entropy that piece carries "
               "autograd history (and training hung)", "entropy-coef-rule",
               _w(entropy_coef=0.0, cp=2, cp_layout="allgather")),
    Regression("cp-zigzag-offsets", "slime #73/#1862: the zigzag offsets of a sample's two chunks and the length "
               "of each CP slice of the log-probs", "wrapper-extraction",
               _w(total_lengths=(8, 5), response_lengths=(6, 3), entropy_coef=0.01, cp=2)),
    Regression("cp-allgather-redistribution", "all-gather CP: the response pieces are summed over the CP group "
               "(not the TP group, not the world) and re-sliced to zigzag", "wrapper-extraction",
               _w(total_lengths=(7, 5), response_lengths=(5, 3), cp=2, cp_layout="allgather")),
    Regression("cp-top-p-zigzag", "CP: the top-p keep mask follows the zigzag rows", "top-p-replay",
               _w(total_lengths=(7, 5), response_lengths=(5, 3), top_p="nucleus", cp=2)),
    Regression("cp-top-p-allgather", "CP: the top-p keep mask follows the all-gather rows", "top-p-replay",
               _w(total_lengths=(7, 5), response_lengths=(5, 3), top_p="partial", cp=2, cp_layout="allgather")),
    Regression("cp-response-on-one-chunk", "CP: a response wholly on one rank's chunk; the other returns empty "
               "pieces", "wrapper-extraction", _w(total_lengths=(8,), response_lengths=(1,), entropy_coef=0.5, cp=2)),
    Regression("cp4-short-samples", "CP 4: samples shorter than 2 * cp, a prompt of 1, a response of 0",
               "wrapper-extraction", WrapperCase(tp=1, v_local=5, total_lengths=(1, 2, 3, 9),
                                                 response_lengths=(0, 1, 2, 8), entropy_coef=0.01, cp=4, seed=4)),
    Regression("cp-no-grad-chunked", "CP: old-policy log-probs under no_grad, chunked, all-gather CP, top-p",
               "inference-path", _w(top_p="partial", chunk_size=2, context="no_grad", cp=2, cp_layout="allgather")),
    Regression("cp-memory-per-rank", "CP: a rank's memory is that of its own rows (T_local x V_local), not the "
               "whole sequence's: a rank that gathers the logits over the CP group and computes every rank's "
               "rows spends CP times its budget", "memory-budget",
               _w(v_local=128, total_lengths=(40, 24), response_lengths=(20, 12), entropy_coef=0.01, cp=2,
                  cp_layout="allgather")),
    Regression("cp-wrapper-chunk-size", "NeMo-RL #2871/#2872 at CP: the chunk size reaches the kernel on a CP "
               "rank's rows, before the all-gather CP redistribution", "chunk-size-honoured",
               _w(total_lengths=(7, 5), response_lengths=(5, 3), chunk_size=2, entropy_coef=0.01, cp=2,
                  cp_layout="allgather")),
    # The fused-linear level (docs/fused-linear.md).
    Regression("linear-column-parallel-grad", "fused linear: the hidden states' gradient is a sum over every "
               "vocab shard, all-reduced so each rank holds all of it (Megatron's column-parallel backward)",
               "gradients", LinearCase(tp=2, T=6, H=8, v_local=5, chunk_size=4, seed=16)),
    Regression("linear-logits-not-retained", "fused linear: retained memory is O(T*H), never the [T, V_local] "
               "logits the fusion exists to avoid", "memory-linear-retained",
               LinearCase(tp=2, T=16, H=16, v_local=64, chunk_size=4, seed=17)),
    Regression("linear-metric-only-entropy", "slime #2153 at the fused-linear level: with_entropy_grad=False gives "
               "a metric-only entropy", "grad-flags",
               LinearCase(tp=2, T=5, H=12, v_local=6, with_entropy_grad=False, seed=18)),
    Regression("linear-peaked-bf16", "fused linear: bf16 inputs, float32 matmul accumulation; a peaked row",
               "values", LinearCase(tp=4, T=7, H=48, v_local=9, dtype="bf16", regime="peaked", seed=19)),
    # Cases real trainers make.
    Regression("linear-frozen-head", "caller: a frozen LM head (LoRA, adapters): the hidden states' gradient only, "
               "and no memory spent on the weight's", "memory-budget",
               LinearCase(tp=2, T=4, H=64, v_local=32, frozen="weight", seed=24)),
    Regression("linear-frozen-head-work", "prime-rl #3011: a frozen LM head's gradient computed and thrown away "
               "(a LoRA run, the entropy a metric)", "frozen-input-work",
               LinearCase(tp=1, T=4, H=64, v_local=32, frozen="weight", with_entropy_grad=False, seed=3011)),
    Regression("linear-frozen-trunk", "caller: frozen hidden states under a trained LM head: the weight's gradient "
               "must still come", "gradients", LinearCase(tp=2, T=6, H=8, v_local=5, frozen="hidden", seed=241)),
    Regression("linear-hidden-shifted", "caller: the hidden states are h[:, :-1] of a [1, T + 1, H] decoder output "
               "(a view with a spare row): the gradient must reach the caller's buffer", "gradients",
               LinearCase(tp=2, T=6, H=8, v_local=5, chunk_size=4, hidden_view="shifted", seed=331)),
    Regression("linear-hidden-seq-first", "caller: the hidden states are one batch element of Megatron's [T, B, H] "
               "activation (rows 2H apart)", "gradients",
               LinearCase(tp=1, T=5, H=12, v_local=7, dtype="bf16", hidden_view="seq_first", seed=332)),
    Regression("two-inputs-one-graph", "caller: two microbatches (or policy and reference rows) through two calls in "
               "one graph: state kept beside the routine instead of on ctx mixes them up", "gradients",
               KernelCase(tp=2, T=6, v_local=5, context="two_inputs", seed=242)),
    Regression("wrapper-two-inputs-one-graph", "caller: the wrapper on two batches in one graph", "wrapper-gradients",
               _w(entropy_coef=0.01, context="two_inputs")),
    Regression("linear-two-inputs-one-graph", "caller: two hidden-state batches through the fused head in one graph",
               "gradients", LinearCase(tp=2, T=6, H=8, v_local=5, context="two_inputs", seed=243)),
    Regression("linear-deep-accumulation", "verl's FusedLinearForPPO: dW summed over row chunks in bf16; 256 chunks "
               "of drifting data take it past the bound (scripts/studies/deep_accumulation.py)", "gradients",
               LinearCase(tp=1, T=256, H=8, v_local=16, dtype="bf16", regime="drift", chunk_size=1, with_entropy=False,
                          seed=244)),
    Regression("wrapper-transposed-contiguous-copy", "a false finding of the harness's own: a wrapper's contiguous copy of "
               "transposed logits, which the kernel saves, is the allowance memory-budget grants; "
               "memory-chunk-passthrough must grant it too", "memory-chunk-passthrough",
               WrapperCase(tp=1, v_local=7, total_lengths=(4,), response_lengths=(0,), chunk_size=1, with_entropy=False,
                           layout="transposed", seed=245)),
    Regression("wrapper-top-p-nucleus-copies", "a false finding (thorough, TP 8): the recorded nucleus is an "
               "input of its own size, up to T*V ids; a routine holds a few int64 copies of it, which "
               "memory-budget measured in units of T*V_local", "memory-budget",
               WrapperCase(tp=4, v_local=8, total_lengths=(8,), response_lengths=(5,), chunk_size=-1, with_entropy=False,
                           top_p="nucleus", seed=6)),
    # The distillation level (docs/distill.md): the failure modes of vocab-parallel softmaxes, top-k
    # and gathers at global ids, each as the case that shows it.
    Regression("distill-topk-shard-edge", "distillation: a row's top entry on the first or last id of a shard, "
               "where a top-k's global id is one off or one shard off", "values",
               _d(function="topk", k=3, requires_grad=False, chunk_size=4)),
    Regression("distill-topk-ties-across-shards", "distillation: equal logits on several shards at and inside the "
               "k-th place: any top-k is right, but every rank must return the same one", "values",
               _d(tp=4, T=5, v_local=4, function="topk", k=3, regime="ties", requires_grad=False)),
    Regression("distill-topk-k-beyond-shard", "distillation: k larger than a shard's V_local (a local "
               "torch.topk(k) raises; min(k, V_local) candidates per rank are enough)", "crash",
               _d(T=4, v_local=3, function="topk", k=5, requires_grad=False)),
    Regression("distill-gather-global-ids", "distillation: the student's log-probs at a teacher's global ids on "
               "every shard: the owner's value, everywhere, and its gradient on the owner only", "gradients",
               _d(tp=4, v_local=4, function="gather", k=6)),
    Regression("distill-log-softmax-shard-gradient", "distillation: a sharded log-softmax whose normaliser is "
               "all-reduced where autograd does not see it: at TP > 1 each shard's gradient misses the "
               "others' share", "gradients", _d(function="log_softmax", temperature=0.7)),
    Regression("distill-disjoint-topk", "distillation: teacher and student with disjoint top-k: the student's "
               "log-probs on the teacher's support are far down its tail", "values",
               _d(teacher="given", k=3, regime="disjoint", dtype="bf16")),
    Regression("distill-masked-vocab", "distillation: -inf logits (a masked vocabulary) in student and teacher, "
               "the padded tail a whole shard at TP 4: 0 log 0 terms are 0, not NaN, and a shard without a finite "
               "logit still joins every collective", "finite",
               _d(tp=4, v_local=4, kind="jsd", beta=0.3, regime="neginf", teacher_grad=True)),
    Regression("distill-topk-support-ties", "distillation: the teacher's top-k taken inside the routine, with "
               "ties inside it across shards: the ranks must agree on the support's order", "values",
               _d(tp=4, v_local=4, kind="soft_ce", teacher="topk", k=4, regime="ties")),
    Regression("distill-unnormalized-topk-kl", "distillation: forward KL on a teacher pass's top-k log-probs, "
               "neither side renormalized (verl's top-k KL)", "gradients",
               _d(teacher="given", k=4, renormalize=False, chunk_size=4)),
    Regression("distill-self-divergence", "distillation: KL(p, p) = 0 at a temperature, over the whole vocabulary",
               "divergence-self-zero", _d(kind="reverse_kl", temperature=2.0, self_teacher=True)),
    Regression("distill-no-grad-metric", "distillation: the divergence as a metric under torch.no_grad() (a "
               "validation pass) equals the training path's bit for bit", "inference-path",
               _d(kind="jsd", teacher="given", k=4, context="no_grad")),
    Regression("distill-empty-batch", "distillation: T == 0 (a rank without response tokens)", "empty-input",
               _d(tp=4, T=0, v_local=4, kind="jsd")),
    Regression("distill-no-vocab-gather", "distillation: a routine that all-gathers the vocabulary to call "
               "torch.log_softmax holds T x V floats per rank", "memory-no-vocab-gather",
               _d(T=8, v_local=64, kind="mixed", beta=0.5)),
    Regression("distill-tp-group-not-world", "distillation in a world of DP x TP ranks: a reduction over the "
               "default group mixes replicas", "values", _d(kind="reverse_kl", dp=2, seed=4545)),
    Regression("ld-per-chunk-mean", "torchtune #1885: a chunked distillation loss averaged each chunk over its own "
               "valid tokens, then the chunks", "values", _ld(kind="soft_ce")),
    Regression("ld-no-valid-label", "torchtune #2239, TRL #5885 and #6006: a batch without a valid label divided "
               "by its zero count (NaN)", "finite", _ld(kind="forward_kl", labels="empty", hard_weight=0.5,
                                                       soft_weight=0.5)),
    Regression("ld-jsd-mixture-weights", "TRL #3043: the generalized JSD's mixture weights swapped (beta on the "
               "student's side)", "values", _ld(kind="jsd", beta=0.1, temperature=2.0, teacher="logits")),
    Regression("ld-ignored-tokens-distilled", "a chunked JSD that distils the tokens labels ignore (the prompt, "
               "padding) and divides by the valid ones", "values", _ld(kind="jsd", beta=0.5, regime="peaked")),
)
