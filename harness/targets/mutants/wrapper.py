"""Level-2 defects of the loss-side wrapper: each class overrides exactly one wrapper step.

Named for the level it breaks, as `reference/wrapper.py` computes that level and `checks/wrapper.py`
checks it: a level keeps one module name across the layers."""
from __future__ import annotations

import torch

from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant


@mutant("coef-ignored", "wrapper ignores entropy_coef", ("entropy-coef-rule",),
        "slime #2153 (only the policy loss passed with_entropy_grad)")
class CoefIgnored(Fused):
    def entropy_grad_flag(self, with_entropy, args):
        return bool(with_entropy)


@mutant("coef-inverted", "wrapper inverts entropy_coef", ("entropy-coef-rule",),
        "slime #1185, reverted in #1189 (no_grad when the coefficient was non-zero)")
class CoefInverted(Fused):
    def entropy_grad_flag(self, with_entropy, args):
        return bool(with_entropy and getattr(args, "entropy_coef", 0.0) == 0)


@mutant("coef-required", "wrapper requires entropy_coef", ("entropy-coef-rule",),
        "slime #2153 (callers that never set entropy_coef)")
class CoefRequired(Fused):
    def entropy_grad_flag(self, with_entropy, args):
        return bool(with_entropy and args.entropy_coef != 0)  # AttributeError when absent


@mutant("coef-positive-only", "wrapper treats a negative coefficient as none", ("entropy-coef-rule",),
        "slime #2153 (a negative coefficient is still a coefficient)")
class CoefPositiveOnly(Fused):
    def entropy_grad_flag(self, with_entropy, args):
        return bool(with_entropy and getattr(args, "entropy_coef", 0.0) > 0)


@mutant("temperature-ignored", "temperature ignored", ("temperature",))
class TemperatureIgnored(Fused):
    def temperature(self, args):
        return 1.0


@mutant("shift-off-by-one", "targets not shifted", ("wrapper-extraction",))
class ShiftOffByOne(Fused):
    def shifted_tokens(self, unconcat_tokens, total_lengths, device):
        return torch.cat([torch.as_tensor(t, device=device).reshape(-1).long() for t in unconcat_tokens])


@mutant("response-rows-off-by-one", "response rows off by one", ("wrapper-extraction",))
class ResponseRowsOffByOne(Fused):
    def response_rows(self, offset, total_length, response_length):
        a, b = super().response_rows(offset, total_length, response_length)
        return a + 1, b + 1


@mutant("top-p-ignored", "top-p replay ignored", ("top-p-replay",))
class TopPIgnored(Fused):
    def top_p_keep_mask(self, *args, **kwargs):
        return None


@mutant("empty-nucleus-unmasked", "an empty recorded nucleus leaves the row unmasked", ("top-p-replay",),
        "slime's encoding: an empty range keeps only the target (log-prob 0), not the whole row")
class EmptyNucleusUnmasked(Fused):
    def masked_rows(self, counts):
        return counts > 0


@mutant("missing-nucleus-masked", "rows past the offsets' end masked as empty nuclei", ("top-p-replay",),
        "slime's encoding: rows the offsets do not reach have no recorded nucleus and stay unmasked")
class MissingNucleusMasked(Fused):
    def recorded_rows(self, n_offsets, response_length):
        return response_length
