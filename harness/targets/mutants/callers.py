"""Defects that only real callers see: non-contiguous logits, calls without autograd, two calls
into one gradient, and reduction orders that are not reproducible (the last two families need
`--bitwise`). Each class overrides exactly one step of the built-in routine."""
from __future__ import annotations

import torch

from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant


@mutant("reads-as-row-major", "a kernel that reads non-contiguous logits as row-major",
        ("values", "gradients"))
class ReadsAsRowMajor(Fused):
    def upcast(self, chunk):
        # A kernel handed data_ptr() that assumes a dense row-major [rows, V_local] block: right for
        # a fresh tensor or a row slice, wrong for a transposed or strided view.
        return super().upcast(torch.as_strided(chunk, chunk.shape, (chunk.shape[-1], 1)))


@mutant("inference-drops-keep-mask", "an inference fast path that forgets the keep mask",
        ("inference-path", "values", "top-p-replay"))
class InferenceDropsKeepMask(Fused):
    def calculate_log_probs_and_entropy(self, logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                        log_prob_keep_mask=None, with_entropy_grad=True):
        if not torch.is_grad_enabled():  # "nothing to backprop": a shortcut that skips the top-p replay
            log_prob_keep_mask = None
        return super().calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy, chunk_size,
                                                       log_prob_keep_mask, with_entropy_grad)


@mutant("grad-buffer-overwritten", "a gradient that overwrites instead of accumulating",
        ("gradients", "wrapper-gradients"))
class GradBufferOverwritten(Fused):
    def backward(self, ctx, grad_log_prob, grad_entropy):
        # One persistent gradient buffer handed to autograd by every call (an allocation saved per
        # step): with two calls on the same logits, the second backward overwrites the first's
        # gradient before autograd sums them.
        grad = super().backward(ctx, grad_log_prob, grad_entropy)
        if grad is None:
            return None
        buf = getattr(self, "_grad_buf", None)
        if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype or buf.device != grad.device:
            buf = self._grad_buf = torch.empty_like(grad)
        return buf.copy_(grad)


@mutant("reduction-order-per-call", "a reduction whose order changes from call to call", ("determinism",))
class ReductionOrderPerCall(Fused):
    _calls = 0

    def sum_exp(self, x, m):
        # Like split-K partial sums finishing in a different order each run: the vocab is summed
        # starting at a column that moves with every call.
        e = torch.exp(x - m.unsqueeze(-1))
        type(self)._calls += 1
        shift = (5 * type(self)._calls) % max(e.shape[-1], 1)
        return e, torch.roll(e, shift, dims=-1).sum(dim=-1)


@mutant("reduction-order-by-rows", "a reduction whose order depends on the number of rows",
        ("batch-invariance-rows", "batch-invariance-packing", "batch-invariance-chunk"))
class ReductionOrderByRows(Fused):
    def sum_exp(self, x, m):
        # A split chosen by problem size, as autotuned kernels choose one: above 4 rows the vocab is
        # summed in two halves.
        e = torch.exp(x - m.unsqueeze(-1))
        if e.shape[0] > 4 and e.shape[-1] > 1:
            h = e.shape[-1] // 2
            s = e[:, :h].sum(dim=-1) + e[:, h:].sum(dim=-1)
        else:
            s = e.sum(dim=-1)
        return e, s
