"""Memory defects: the values stay right, the bytes do not (slime #2144/#2152/#2153, NeMo-RL #2871).

Each is meant for one memory check (`harness/checks/memory.py`), and costs memory only where the
real defect would: the checks measure bytes, not the routine's structure.
"""
from __future__ import annotations

import torch

from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant


@mutant("metric-only-entropy-retained", "entropy tensors retained when metric-only", ("memory-metric-only",),
        "slime #2153 (a metric-only entropy paid for an entropy gradient's memory)")
class MetricOnlyEntropyRetained(Fused):
    def forward(self, ctx, logits, tokens, keep_mask, tp_group, with_entropy, chunk_size, needs_grad,
                entropy_grad):
        out = super().forward(ctx, logits, tokens, keep_mask, tp_group, with_entropy, chunk_size, needs_grad,
                              entropy_grad)
        if needs_grad and with_entropy and not entropy_grad:
            # What an entropy backward would read, kept on ctx although nothing will read it. The
            # upcast is the caller's own tensor for float32 logits; unmasked, the saved softmax
            # already is the entropy's: there it costs nothing.
            ctx.entropy_logits = self.upcast(logits.detach())
            if keep_mask is not None:
                # This shard's softmax: the same size as the entropy's, and only the size matters.
                ctx.entropy_softmax = torch.softmax(ctx.entropy_logits, dim=-1)
        return out


@mutant("metric-only-graph-detached", "metric-only entropy built differentiable, then detached",
        ("memory-coef-zero",), "slime #2153 (callers other than the policy loss paid for the entropy's graph)")
class MetricOnlyGraphDetached(Fused):
    def calculate_log_probs_and_entropy(self, logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                        log_prob_keep_mask=None, with_entropy_grad=True):
        # The flags come out right, but the graph behind them was built for an entropy gradient and
        # keeps the kernel's input alive: free for the caller's own logits, a float32 [T, V_local]
        # copy behind the wrapper's division by a temperature.
        log_prob, entropy = super().calculate_log_probs_and_entropy(
            logits, tokens, tp_group, with_entropy, chunk_size, log_prob_keep_mask, with_entropy_grad=True)
        if entropy is not None and not with_entropy_grad:
            entropy = entropy.detach()
        return log_prob, entropy


@mutant("ctx-outlives-backward", "saved tensors kept on ctx after backward", ("memory-backward-frees",))
class CtxOutlivesBackward(Fused):
    def backward(self, ctx, grad_log_prob, grad_entropy):
        grad = super().backward(ctx, grad_log_prob, grad_entropy)
        ctx.kept = ctx.saved_tensors  # "for a second backward": the softmax lives as long as the outputs
        return grad


@mutant("forward-buffers-kept", "exponentials and a float32 logits copy kept besides the softmax",
        ("memory-budget",), "slime #2144/#2152 (memory cut by not keeping what backward can recompute)")
class ForwardBuffersKept(Fused):
    def forward(self, ctx, logits, tokens, keep_mask, tp_group, with_entropy, chunk_size, needs_grad,
                entropy_grad):
        out = super().forward(ctx, logits, tokens, keep_mask, tp_group, with_entropy, chunk_size, needs_grad,
                              entropy_grad)
        if needs_grad:
            # "For a faster backward", never read: two more float32 [T, V_local] tensors in every
            # mode, so only a declared budget (or a baseline) can see them.
            x = logits.detach().to(torch.float32, copy=True)
            ctx.logits_f32, ctx.exp_logits = x, torch.exp(x)
        return out


@mutant("chunk-size-ignored", "wrapper ignores log_probs_chunk_size",
        ("memory-chunk-passthrough", "chunk-size-honoured", "memory-chunk-effect"),
        "NeMo-RL #2871/#2872 (the chunk size was ignored on the training path: 12.6 GiB OOM)")
class ChunkSizeIgnored(Fused):
    def chunk_size(self, args):
        return -1


@mutant("chunked-grad-buffer-float32", "chunked backward builds the whole gradient in float32 for bf16/fp16 logits",
        ("memory-logits-dtype",),
        "NeMo-RL #2871/#2872 (ChunkedDistributedLogprob's backward zeroed a float32 buffer of the whole logits)")
class ChunkedGradBufferFloat32(Fused):
    def backward(self, ctx, grad_log_prob, grad_entropy):
        # Every chunk's gradient lands in a float32 [T, V_local] buffer, returned as it is: autograd
        # casts it to the logits' dtype, a second full-size copy. Free for float32 logits.
        ctx.dtype = torch.float32
        return super().backward(ctx, grad_log_prob, grad_entropy)


@mutant("wrapper-logits-float32", "wrapper casts the whole logits to float32 before the chunked kernel",
        ("memory-logits-dtype",),
        "NeMo-RL #2871/#2872 (the caller's .to(torch.float32) of the whole logits in front of the chunked kernel)")
class WrapperLogitsFloat32(Fused):
    def get_log_probs_and_entropy(self, logits, **kwargs):
        # A no-op on float32 logits; on bf16 a float32 [T, V_local] copy, whose gradient the kernel
        # then returns in float32 too.
        return super().get_log_probs_and_entropy(logits.float(), **kwargs)
