"""Performance defects: right values, more work. Only a comparison with the clean routine's baseline
(`harness.perf.gate`) can see them, so each is registered with `needs_baseline=True`."""
from __future__ import annotations

import torch

from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant


@mutant("needless-exp-pass", "one needless full-size pass (about 20% slower)",
        ("perf-instructions", "perf-time"), needs_baseline=True)
class NeedlessExpPass(Fused):
    def sum_exp(self, x, m):
        e, s = super().sum_exp(x, m)
        torch.exp(x - m.unsqueeze(-1))  # the shifted exponentials again, thrown away
        return e, s


@mutant("extra-allreduce-per-call", "one extra all-reduce per call", ("perf-collectives",),
        needs_baseline=True, tp=(2, 4))
class ExtraAllReducePerCall(Fused):
    def group_info(self, tp_group):
        group, world, rank = super().group_info(tp_group)
        # A defensive "do all ranks agree on the group size?" on every call: one more collective
        # per step, same values.
        self.all_reduce(torch.tensor([world], dtype=torch.int64, device=self._device(group)),
                        torch.distributed.ReduceOp.MAX, group, "world_check")
        return group, world, rank

    @staticmethod
    def _device(group) -> torch.device:
        if torch.distributed.is_initialized() and torch.distributed.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
