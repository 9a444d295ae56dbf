"""The TP group as peers that take it from megatron-core's `parallel_state` find it."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.cases import case as cases


def parallel_state_group(tp_group: Any, who: str) -> Any:
    """parallel_state's TP group, after making sure it is the group the harness asked for: a peer
    without a group argument can only reduce over that one."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(f"{who} takes its TP group from megatron.core.parallel_state: "
                           "call initialize_model_parallel first")
    group = parallel_state.get_tensor_model_parallel_group()
    if tp_group is not None and tp_group is not group:
        raise ValueError(f"{who} only reduces over parallel_state's TP group; a different tp_group "
                         "cannot be honoured")
    return group


class _GatherVocab(torch.autograd.Function):
    """Forward: all-gather the shards along `dim`; backward: this rank's own slice of the
    gradient. Megatron's gather-from-TP-region (which allocates on CUDA, hence this CPU-capable
    one): every rank computes the same loss from the gathered tensor, so nothing is reduced."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(group.size())]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        n = grad.shape[ctx.dim] // ctx.group.size()
        return grad.narrow(ctx.dim, ctx.group.rank() * n, n).contiguous(), None, None


def gather_vocab(t: torch.Tensor, tp_group: Any, dim: int = -1) -> torch.Tensor:
    """The full-vocab tensor from every rank's vocab shard (along `dim`: -1 for logits, 0 for an
    LM-head weight), in rank order, for a routine that is not tensor-parallel (as Megatron's
    `parallel_output=False` hands logits over)."""
    if tp_group is None or tp_group.size() == 1:
        return t
    return _GatherVocab.apply(t, tp_group, dim)


# What megatron-core hands the trainers built on it, cited in their adapters' HARNESS_USE
# (harness.checks.use), as megatron-core 0.16.1 has it.
GPT_LOGITS_CONTIGUOUS = ("megatron-core's GPTModel returns its logits as `logits.transpose(0, 1).contiguous()` "
                         "(megatron/core/models/gpt/gpt_model.py:712)")
FLOAT16_OUTPUT_FP32 = ("megatron-core's Float16Module upcasts the last pipeline stage's output to float32 "
                       "(megatron/core/transformer/module.py:495, fp32_output=True by default)")
NONCONTIGUOUS = list(cases.NONCONTIGUOUS)  # the logits layouts that are not contiguous
