"""Built-in fused-linear routine: the LM head's matmul fused with the vocab-parallel log-prob and
entropy (docs/fused-linear.md), the default target of the `linear` level.

    calculate_linear_log_probs_and_entropy(hidden [T, H], weight [V_local, H], tokens [T], tp_group,
                                           with_entropy=False, chunk_size=-1, with_entropy_grad=True)

It builds on the kernel routine: the same collective and statistic steps, per row chunk, on logits
it computes itself. Forward, per chunk ``[s, e)`` (all float32):
``x = h[s:e] W^T`` (float32 accumulation whatever the inputs' dtype), then the kernel's two collectives:
one all-reduce MAX of the row maxima (stat ``"max"``), one all-reduce SUM of the stacked local sums
(``"sumexp+target_logit"``, ``+entropy_term`` with the entropy). Saved for backward: the caller's
``hidden``, ``weight`` and ``tokens`` (no copies) and the per-row ``lse`` (and ``entropy`` when it is
differentiable): O(T) beyond the inputs, never a ``[T, V_local]`` buffer. Backward recomputes each
chunk's logits and softmax, forms the logit gradient ``G``, and accumulates ``dh = G W`` (all-reduced
over the TP group afterwards: every rank holds the full gradient, as Megatron's column-parallel
backward does) and ``dW = G^T h`` for the local shard, in float32, rounded once to the inputs' dtypes;
only the gradients asked for (a frozen input, one that requires no grad, costs nothing).

Like the kernel routine, every concern is a method, so a mutant overrides exactly one
(`harness/targets/mutants/linear.py`). The steps here are a mixin: the statistics and collectives
(``reduce_stats``, ``row_max``, ``sum_exp``, ``target_logit``, ``entropy``, ...) are the kernel
routine's, and `harness.targets.fused` combines the two into ``FusedLinearLogProbEntropy`` (which
is how the default target provides all three levels without an import cycle).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # the kernel routine this mixin is combined with, whose steps it calls
    from harness.targets.fused import FusedLogProbEntropy as _KernelSteps
else:
    _KernelSteps = object

__all__ = ["FusedLinearSteps"]


class _LinearFunction(torch.autograd.Function):
    """Thin autograd shell: every step is a method of the routine passed in."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, routine, tp_group, with_entropy, chunk_size, needs_grad,
                entropy_grad):
        return routine.linear_forward(ctx, hidden, weight, tokens, tp_group, with_entropy, chunk_size, needs_grad,
                                      entropy_grad)

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        grad_hidden, grad_weight = ctx.routine.linear_backward(ctx, grad_log_prob, grad_entropy)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


class FusedLinearSteps(_KernelSteps):
    """Chunked fused-linear log-prob and entropy, recomputing the logits in backward; mixed into the
    kernel routine, whose steps it calls (its own names never shadow the kernel's, so the combined
    class's kernel entry points stay the kernel's)."""

    linear_function = _LinearFunction

    # ------------------------------------------------------------------ linear steps
    def chunk_logits(self, hidden_rows: torch.Tensor, weight32: torch.Tensor) -> torch.Tensor:
        """float32 logits of a row chunk: h W^T with float32 accumulation (the inputs upcast exactly)."""
        return self.upcast(hidden_rows) @ weight32.T

    def grad_targets(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The backward's shard-local target ids (global id minus this shard's first)."""
        return tokens - start

    def accumulate_weight_grad(self, grad_weight: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
        """dW += G^T h for one chunk, in float32 (the chunks' contributions summed, not replaced)."""
        grad_weight.addmm_(g.T, h)

    def reduce_grad_hidden(self, grad_hidden: torch.Tensor, group: Any) -> torch.Tensor:
        """Each shard's partial G W summed over the TP group: the full gradient on every rank."""
        return self.all_reduce(grad_hidden, dist.ReduceOp.SUM, group, "grad_hidden")

    # ------------------------------------------------------------------ orchestration
    def linear_forward(self, ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                       tp_group: Any, with_entropy: bool, chunk_size: int, needs_grad: bool,
                       entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        group, _world, rank = self.group_info(tp_group)
        num_rows, v_local = hidden.shape[0], weight.shape[0]
        start = self.shard_start(rank, v_local)
        f32 = self.compute_dtype(hidden)
        w32 = self.upcast(weight)  # a temporary for bf16/fp16 weights, freed when the forward returns
        lps, ents, lses = [], [], []
        for s, e in self.chunk_bounds(num_rows, chunk_size):
            x = self.chunk_logits(hidden[s:e], w32)
            local = tokens[s:e] - start
            own = self.owned(local, v_local)
            m = self.finite_shift(self.reduce_stats({"max": self.row_max(x)}, dist.ReduceOp.MAX, group)["max"])
            ex, local_sum = self.sum_exp(x, m)
            sums = {"sumexp": local_sum, "target_logit": self.target_logit(x, local, own)}
            if with_entropy:
                sums["entropy_term"] = self.entropy_term(x, ex, m)
            sums = self.reduce_stats(sums, dist.ReduceOp.SUM, group)
            lse = m + torch.log(sums["sumexp"])
            lps.append(sums["target_logit"] - lse)
            if with_entropy:
                ents.append(self.entropy(sums["sumexp"], sums["entropy_term"]))
            lses.append(lse)
        empty = torch.empty(0, dtype=f32, device=hidden.device)
        log_prob = self.concat(lps, empty)
        entropy = self.concat(ents, empty.clone()) if with_entropy else None

        ctx.routine = self
        ctx.saved_any = needs_grad
        ctx.entropy_grad = bool(entropy_grad)
        ctx.chunk_size = chunk_size
        ctx.group = group
        ctx.start = start
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        if needs_grad:
            lse_all = self.concat(lses, empty.clone())
            ctx.save_for_backward(hidden, weight, tokens, lse_all, *((entropy,) if entropy_grad else ()))
        return log_prob, entropy

    def linear_backward(self, ctx: Any, grad_log_prob: torch.Tensor, grad_entropy: torch.Tensor | None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not ctx.saved_any:
            return None, None
        hidden, weight, tokens, lse, *rest = ctx.saved_tensors
        ent = rest[0] if ctx.entropy_grad else None
        num_rows, v_local = hidden.shape[0], weight.shape[0]
        f32 = self.compute_dtype(hidden)
        w32 = self.upcast(weight)
        # Only the gradients asked for are computed (a frozen LM head or trunk costs nothing). Which
        # ones are asked for is the same on every rank, so the collectives still match.
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros(num_rows, hidden.shape[1], dtype=f32, device=hidden.device) if need_h else None
        grad_weight = torch.zeros(v_local, weight.shape[1], dtype=f32, device=weight.device) if need_w else None
        w1 = grad_log_prob.reshape(-1).to(f32)
        for s, e in self.chunk_bounds(num_rows, ctx.chunk_size):
            x = self.chunk_logits(hidden[s:e], w32)
            p = self.recompute_p(x, lse[s:e])
            local = self.grad_targets(tokens[s:e], ctx.start)
            g = self.logprob_grad(p, local, self.owned(local, v_local), w1[s:e])
            if ent is not None and grad_entropy is not None:
                log_p = x - lse[s:e].unsqueeze(-1)
                g = g + grad_entropy[s:e].to(f32).unsqueeze(-1) * self.entropy_grad_term(p, log_p, ent[s:e])
            if grad_hidden is not None:
                grad_hidden[s:e] = g @ w32
            if grad_weight is not None:
                self.accumulate_weight_grad(grad_weight, g, self.upcast(hidden[s:e]))
        if grad_hidden is not None:  # each rank's partial sum over its shard, reduced over the TP group
            grad_hidden = self.cast_grad(self.reduce_grad_hidden(grad_hidden, ctx.group), hidden.dtype)
        return grad_hidden, None if grad_weight is None else self.cast_grad(grad_weight, weight.dtype)

    # ------------------------------------------------------------------ the linear level's entry point
    def calculate_linear_log_probs_and_entropy(self, hidden: torch.Tensor, weight: torch.Tensor,
                                               tokens: torch.Tensor, tp_group: Any, with_entropy: bool = False,
                                               chunk_size: int = -1, with_entropy_grad: bool = True
                                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fused-linear: ``(log_prob [T] float32, entropy [T] float32 or None)`` of
        ``hidden @ W_full.T``, where this rank holds rows ``[r*V_local, (r+1)*V_local)`` of ``W_full``."""
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"hidden must be [T, H] and weight [V_local, H], got {tuple(hidden.shape)} "
                             f"and {tuple(weight.shape)}")
        tokens = tokens.reshape(-1).to(device=hidden.device, dtype=torch.long)
        needs_grad = bool((hidden.requires_grad or weight.requires_grad) and torch.is_grad_enabled())
        entropy_grad = self.entropy_differentiable(with_entropy, with_entropy_grad, needs_grad)
        return self.linear_function.apply(hidden, weight, tokens, self, tp_group, bool(with_entropy), chunk_size,
                                   needs_grad, entropy_grad)

