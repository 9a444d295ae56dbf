"""A rank's view of a case: its vocab shard of the inputs, the upstream loss, and the TP group as
production code finds it. The one place that slices shards and weighs outputs, for the case jobs
(`executor`) and the timing and instruction-count jobs (`perf_jobs`) alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from cases.case import KernelCase
from harness.targets import Target


def shard(t: torch.Tensor | None, rank: int, v_local: int, device: torch.device) -> torch.Tensor | None:
    """This rank's contiguous slice of the last (vocab) dimension; rank r owns [r*v_local, (r+1)*v_local)."""
    if t is None:
        return None
    return t[..., rank * v_local:(rank + 1) * v_local].contiguous().to(device)


def weighted(out: Any, w: torch.Tensor | None, device: torch.device) -> Any:
    """sum(w * out): the upstream loss term of one output; 0.0 when the output is not in the loss
    or carries no gradient (a metric-only entropy)."""
    if w is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
        return 0.0
    return (out.reshape(-1) * w.to(device=device, dtype=out.dtype)).sum()


def tp_group() -> Any:
    """The TP group as production code finds it: megatron-core's parallel_state when initialised."""
    if not dist.is_initialized():
        return None
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return dist.group.WORLD


def tp_coordinates() -> tuple[int, int]:
    """(TP rank, DP replica) of this process, where production code finds them; (rank, 0) without
    parallel_state (a world that is one TP group)."""
    if not dist.is_initialized():
        return 0, 0
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    return dist.get_rank(), 0


@dataclass(frozen=True)
class KernelShard:
    """A kernel case's inputs on one rank: the logits are a fresh leaf the caller owns."""
    logits: torch.Tensor
    tokens: torch.Tensor
    keep_mask: torch.Tensor | None
    w_log_prob: torch.Tensor | None
    w_entropy: torch.Tensor | None

    @classmethod
    def of(cls, case: KernelCase, rank: int, device: torch.device) -> "KernelShard":
        full = case.inputs()
        logits = shard(full.logits, rank, case.v_local, device).requires_grad_(case.requires_grad)
        return cls(logits, full.tokens.to(device), shard(full.keep_mask, rank, case.v_local, device),
                   full.w_log_prob, full.w_entropy)

    def call(self, target: Target, case: KernelCase, group: Any) -> tuple[Any, Any]:
        return target.kernel(self.logits, self.tokens, group, with_entropy=case.with_entropy,
                             chunk_size=case.chunk_size, log_prob_keep_mask=self.keep_mask,
                             with_entropy_grad=case.with_entropy_grad)

    def loss(self, log_prob: Any, entropy: Any) -> Any:
        device = self.logits.device
        return weighted(log_prob, self.w_log_prob, device) + weighted(entropy, self.w_entropy, device)


def prepared_call(target: Target, case: KernelCase, rank: int, device: torch.device,
                  group: Any) -> Callable[[], None]:
    """One forward+backward of the target's kernel on this rank's shard, inputs built once."""
    inputs = KernelShard.of(case, rank, device)

    def call() -> None:
        inputs.logits.grad = None
        loss = inputs.loss(*inputs.call(target, case, group))
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return call
