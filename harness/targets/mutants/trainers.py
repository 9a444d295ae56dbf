"""Defects in the cases real trainers make: a frozen LM head or trunk, two calls on
different inputs in one graph, and deep accumulation over many row chunks. Each overrides one step
of the built-in routine; the check that kills it in the `ci` profile is named."""
from __future__ import annotations

from typing import Any

from harness.targets.fused import FusedLinearLogProbEntropy as Linear
from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant

LINEAR = ("linear",)

# The defect's own state: a module-level cache of what backward needs, keyed by the call's shape and
# chunk size, where a second call of the same shape overwrites the first's before either backward.
_BESIDE: dict[Any, Any] = {}


class _Ctx:
    """ctx as backward sees it, with the saved tensors replaced."""

    def __init__(self, ctx: Any, saved: tuple):
        self._ctx, self.saved_tensors = ctx, saved

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


@mutant("saved-beside-ctx", "the target ids backward needs kept in a module-level cache keyed by shape and chunk "
        "size, not on ctx", ("gradients", "wrapper-gradients"),
        "a trainer's case: invisible when both calls in a graph see the same inputs (two_calls)")
class SavedBesideCtx(Fused):
    def forward(self, ctx, logits, tokens, keep_mask, tp_group, with_entropy, chunk_size, needs_grad, entropy_grad):
        _BESIDE[("kernel", tuple(logits.shape), chunk_size)] = tokens  # the last call's, whoever calls next
        return super().forward(ctx, logits, tokens, keep_mask, tp_group, with_entropy, chunk_size, needs_grad,
                               entropy_grad)

    def backward(self, ctx, grad_log_prob, grad_entropy):
        if not ctx.saved_any:
            return None
        tokens = _BESIDE[("kernel", ctx.shape, ctx.chunk_size)]
        saved = ctx.saved_tensors
        saved = (saved[0], tokens, *saved[2:]) if ctx.entropy_grad else (tokens, *saved[1:])
        return super().backward(_Ctx(ctx, saved), grad_log_prob, grad_entropy)


@mutant("linear-saved-beside-ctx", "the hidden states backward recomputes from kept in a module-level cache keyed "
        "by shape and chunk size, not on ctx", ("gradients",),
        "a trainer's case: two microbatches (or policy and reference rows) in one graph", levels=LINEAR)
class LinearSavedBesideCtx(Linear):
    def linear_forward(self, ctx, hidden, weight, tokens, tp_group, with_entropy, chunk_size, needs_grad,
                       entropy_grad):
        _BESIDE[("linear", tuple(hidden.shape), tuple(weight.shape), chunk_size)] = hidden
        return super().linear_forward(ctx, hidden, weight, tokens, tp_group, with_entropy, chunk_size, needs_grad,
                                      entropy_grad)

    def linear_backward(self, ctx, grad_log_prob, grad_entropy):
        if not ctx.saved_any:
            return None, None
        _, weight, *rest = ctx.saved_tensors
        hidden = _BESIDE[("linear", tuple(ctx.saved_tensors[0].shape), tuple(weight.shape), ctx.chunk_size)]
        return super().linear_backward(_Ctx(ctx, (hidden, weight, *rest)), grad_log_prob, grad_entropy)


@mutant("linear-no-weight-grad-if-hidden-frozen", "no weight gradient when the hidden states require no grad",
        ("gradients",), "a trainer's case: a frozen trunk under a trained LM head", levels=LINEAR)
class NoWeightGradIfHiddenFrozen(Linear):
    def linear_backward(self, ctx, grad_log_prob, grad_entropy):
        grad_hidden, grad_weight = super().linear_backward(ctx, grad_log_prob, grad_entropy)
        return grad_hidden, grad_weight if ctx.needs_input_grad[0] else None


@mutant("linear-frozen-weight-grad-computed", "the weight gradient computed although the LM head is frozen",
        ("memory-budget", "frozen-input-work"), "a trainer's case: LoRA / adapter fine-tuning freezes the LM head",
        levels=LINEAR)
class FrozenWeightGradComputed(Linear):
    def linear_backward(self, ctx, grad_log_prob, grad_entropy):
        class AsksForBoth(_Ctx):
            needs_input_grad = (True, True) + tuple(ctx.needs_input_grad[2:])
        grad_hidden, grad_weight = super().linear_backward(AsksForBoth(ctx, ctx.saved_tensors), grad_log_prob,
                                                           grad_entropy)
        return (grad_hidden if ctx.needs_input_grad[0] else None), (grad_weight if ctx.needs_input_grad[1] else None)


@mutant("linear-weight-grad-low-precision-sum", "the weight gradient's running sum over row chunks kept in the "
        "inputs' dtype (bf16/fp16), rounded once per chunk", ("gradients",),
        "verl's FusedLinearForPPO (dvocab_weights += per chunk, in the inputs' dtype)", levels=LINEAR)
class WeightGradLowPrecisionSum(Linear):
    def linear_backward(self, ctx, grad_log_prob, grad_entropy):
        self.sum_dtype = ctx.saved_tensors[1].dtype  # the weight's
        return super().linear_backward(ctx, grad_log_prob, grad_entropy)

    def accumulate_weight_grad(self, grad_weight, g, h):
        grad_weight.copy_((grad_weight + g.T @ h).to(self.sum_dtype))
