"""State leaks: right values, but the call leaves the trainer's process changed (a default dtype,
grad mode, thread count, a draw from the global RNG). Killed by `side-effects`, and by it alone:
the harness restores the state after each call, so no arithmetic check sees the consequences."""
from __future__ import annotations

import torch

from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant


class _LeaksAfterCall(Fused):
    """Leaks when the caller's call returns (the kernel's, or the wrapper's, which calls the kernel
    inside): its outputs are those of the clean routine, only the process is left changed."""
    depth = 0

    def leak(self) -> None:
        raise NotImplementedError

    def _entered(self, call, *args, **kwargs):
        self.depth += 1
        try:
            return call(*args, **kwargs)
        finally:
            self.depth -= 1
            if not self.depth:
                self.leak()

    def calculate_log_probs_and_entropy(self, *args, **kwargs):
        return self._entered(super().calculate_log_probs_and_entropy, *args, **kwargs)

    def get_log_probs_and_entropy(self, *args, **kwargs):
        return self._entered(super().get_log_probs_and_entropy, *args, **kwargs)


@mutant("leaks-default-dtype-float64", "torch.set_default_dtype(torch.float64) after the call (for its own "
        "float64 bookkeeping), never set back", ("side-effects",))
class LeaksDefaultDtype(_LeaksAfterCall):
    def leak(self) -> None:
        torch.set_default_dtype(torch.float64)


@mutant("leaks-grad-mode-off", "torch.set_grad_enabled(False) left on after the call (a no-grad statistic "
        "computed without a `with` block)", ("side-effects",))
class LeaksGradModeOff(_LeaksAfterCall):
    def leak(self) -> None:
        torch.set_grad_enabled(False)


@mutant("leaks-num-threads", "torch.set_num_threads changed in the backward (tuned for its own loop), "
        "never set back", ("side-effects",))
class LeaksNumThreads(Fused):
    def backward(self, ctx, grad_log_prob, grad_entropy):
        torch.set_num_threads(torch.get_num_threads() + 1)
        return super().backward(ctx, grad_log_prob, grad_entropy)


@mutant("draws-global-rng", "one draw from the global RNG when entropy is asked for (a random probe row): "
        "a trainer's dropout stream shifts with the entropy setting", ("side-effects",))
class DrawsGlobalRng(Fused):
    def calculate_log_probs_and_entropy(self, logits, tokens, tp_group, with_entropy=False, *args, **kwargs):
        if with_entropy:
            torch.randint(0, max(1, logits.shape[0]), (1,))
        return super().calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy, *args, **kwargs)
