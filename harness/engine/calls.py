"""A rank's view of a case: its vocab shard of the inputs, the upstream loss, and the TP group as
production code finds it. The one place that slices shards and weighs outputs, for the case jobs
(`executor`) and the timing and instruction-count jobs (`harness.perf.jobs`) alike."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, overload

import torch
import torch.distributed as dist

from harness.cases.case import DistillCase, KernelCase, LinearCase, WrapperCase
from harness.reference.cp import PAD, local_rows
from harness.targets import Target

_PAD = 2  # rows of other data around an "offset" slice


@overload
def shard(t: torch.Tensor, rank: int, v_local: int, device: torch.device) -> torch.Tensor: ...
@overload
def shard(t: None, rank: int, v_local: int, device: torch.device) -> None: ...
@overload
def shard(t: torch.Tensor | None, rank: int, v_local: int, device: torch.device) -> torch.Tensor | None: ...
def shard(t: torch.Tensor | None, rank: int, v_local: int, device: torch.device) -> torch.Tensor | None:
    """This rank's contiguous slice of the last (vocab) dimension; rank r owns [r*v_local, (r+1)*v_local)."""
    if t is None:
        return None
    return t[..., rank * v_local:(rank + 1) * v_local].contiguous().to(device)


def _filler(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Other data around a view: finite values unlike any logit, so a misread shows."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64).reshape(shape) % 7 * 97.0 + 1000.0).to(like.dtype).to(like.device)


def laid_out(t: torch.Tensor, layout: str, requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(source, logits)`: the caller's tensor `source` (a leaf, requiring grad when asked) and the
    `[T, V]` logits handed to the routine, laid out as `layout` says (cases.case.LAYOUTS), with the
    values of `t`. The gradient w.r.t. the logits is `grad_of(source.grad, layout)`."""
    T, V = t.shape
    if layout in ("contiguous", "nonleaf"):
        source = t  # shard() made it this rank's own tensor
    elif layout == "transposed":
        source = t.t().contiguous()
    elif layout == "row_strided":
        source = torch.stack([t, _filler((T, V), t)], dim=1).reshape(2 * T, V)
    elif layout == "col_strided":
        source = torch.stack([t, _filler((T, V), t)], dim=2).reshape(T, 2 * V)
    elif layout == "offset":
        source = torch.cat([_filler((_PAD, V), t), t, _filler((_PAD, V), t)])
    else:
        raise ValueError(f"unknown layout {layout!r}")
    source.requires_grad_(requires_grad)
    return source, view_of(source, layout)


def view_of(source: torch.Tensor, layout: str) -> torch.Tensor:
    """The logits `laid_out` hands over, from its source (or the gradient of the logits, from the
    source's gradient)."""
    if layout == "transposed":
        return source.t()
    if layout == "row_strided":
        return source[::2]
    if layout == "col_strided":
        return source[:, ::2]
    if layout == "offset":
        return source[_PAD:source.shape[0] - _PAD]
    if layout == "nonleaf" and source.requires_grad:
        return source * 1.0  # the output of an op; exact in every dtype (-0.0, inf, nan kept)
    return source


def hidden_laid_out(h: torch.Tensor, view: str, requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(source, hidden)`: the caller's buffer (a leaf, requiring grad when asked) and the [T, H] hidden
    states handed to the routine, a view of it as `view` says (cases.case.HIDDEN_VIEWS), with the
    values of `h`; the buffer's other entries are filler the routine must not read."""
    T, H = h.shape
    if view == "shifted":  # h[:, :-1] of a [1, T + 1, H] decoder output, as [T, H]
        source = torch.cat([h, _filler((1, H), h)]).unsqueeze(0)
    elif view == "seq_first":  # batch element 1 of a sequence-first [T, 2, H] activation
        source = torch.stack([_filler((T, H), h), h], dim=1)
    elif view == "contiguous":
        return h.requires_grad_(requires_grad), h
    else:
        raise ValueError(f"unknown hidden view {view!r}")
    source.requires_grad_(requires_grad)
    return source, hidden_view_of(source, T, view)


def hidden_view_of(source: torch.Tensor, T: int, view: str) -> torch.Tensor:
    """The [T, H] view `hidden_laid_out` hands over, from its buffer (or its gradient, from the buffer's).
    Named, not read off the buffer's shape: at T = 1 a seq_first buffer [1, 2, H] has a shifted one's shape."""
    if view == "shifted":  # [1, T + 1, H]
        return source[:, :T][0]
    return source.transpose(0, 1)[1]  # seq_first: [T, 2, H]


def tokens_laid_out(tokens: torch.Tensor, layout: str) -> torch.Tensor:
    """int64 tokens as a view or a slice of a larger buffer (cases.case.TOKEN_LAYOUTS)."""
    if layout == "strided":
        return torch.stack([tokens, torch.full_like(tokens, -7)], dim=1).reshape(-1)[::2]
    if layout == "offset":
        return torch.cat([tokens.new_full((3,), -7), tokens, tokens.new_full((1,), -7)])[3:3 + tokens.numel()]
    return tokens


def grad_context(context: str) -> Any:
    """The autograd mode of a call context (cases.case.CONTEXTS)."""
    if context == "no_grad":
        return torch.no_grad()
    if context == "inference_mode":
        return torch.inference_mode()
    return contextlib.nullcontext()


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


def group_coordinates() -> tuple[int, int, int, tuple[int, int]]:
    """(TP rank, CP rank, DP replica, (CP size, DP size)) of this process, where production code finds
    them; (rank, 0, 0, (1, 1)) without parallel_state (a world that is one TP group)."""
    if not dist.is_initialized():
        return 0, 0, 0, (1, 1)
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        return (mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank(), mpu.get_data_parallel_rank(),
                (mpu.get_context_parallel_world_size(), mpu.get_data_parallel_world_size()))
    return dist.get_rank(), 0, 0, (1, 1)


def cp_local(case: WrapperCase, full: torch.Tensor, cp_rank: int,
             padding: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The rows CP rank `cp_rank` holds of a whole-sequence tensor (`[T, ...]`), laid out as the
    case's CP layout says (reference.cp); `padding(n)` gives the n local rows, whose padding ones
    stay as it gave them."""
    if case.cp == 1:
        return full
    rows = torch.tensor(local_rows(list(case.total_lengths), case.cp, case.cp_layout, cp_rank), dtype=torch.int64)
    out = padding(rows.numel())
    real = rows != PAD
    out[real] = full[rows[real]]
    return out


def cp_local_logits(case: WrapperCase, logits: torch.Tensor, cp_rank: int) -> torch.Tensor:
    """The `[T_local, V]` logits rows CP rank `cp_rank` holds; padding rows get the case's finite filler."""
    return cp_local(case, logits, cp_rank, lambda n: case.cp_filler(cp_rank, n))


@dataclass(frozen=True)
class KernelShard:
    """A kernel case's inputs on one rank, laid out as the case says: `logits` is what the routine
    gets, `source` the tensor the caller owns (a leaf; the same tensor for a contiguous layout)."""
    logits: torch.Tensor
    tokens: torch.Tensor
    keep_mask: torch.Tensor | None
    w_log_prob: torch.Tensor | None
    w_entropy: torch.Tensor | None
    source: torch.Tensor | None = None
    layout: str = "contiguous"
    w_log_prob_2: torch.Tensor | None = None  # the second call's weights (two-call contexts)
    w_entropy_2: torch.Tensor | None = None

    @classmethod
    def of(cls, case: KernelCase, rank: int, device: torch.device) -> "KernelShard":
        full = case.inputs()
        source, logits = laid_out(shard(full.logits, rank, case.v_local, device), case.layout, case.requires_grad)
        tokens = tokens_laid_out(full.tokens.to(device), case.token_layout)
        return cls(logits, tokens, shard(full.keep_mask, rank, case.v_local, device),
                   full.w_log_prob, full.w_entropy, source, case.layout, full.w_log_prob_2, full.w_entropy_2)

    def call(self, target: Target, case: KernelCase, group: Any) -> tuple[Any, Any]:
        assert target.kernel is not None  # a case runs only at the levels its target has
        return target.kernel(self.logits, self.tokens, group, **target.kwargs(
            "kernel", with_entropy=case.with_entropy, chunk_size=case.chunk_size, log_prob_keep_mask=self.keep_mask,
            with_entropy_grad=case.with_entropy_grad))

    def loss(self, log_prob: Any, entropy: Any, second: bool = False) -> Any:
        device = self.logits.device
        w1, w2 = (self.w_log_prob_2, self.w_entropy_2) if second else (self.w_log_prob, self.w_entropy)
        return weighted(log_prob, w1, device) + weighted(entropy, w2, device)

    def again(self) -> "KernelShard":
        """The same inputs for another microbatch: the logits re-derived from the source (a new op
        output for a non-leaf layout, as each microbatch's forward makes one)."""
        if self.source is None:
            return self
        return dataclasses.replace(self, logits=view_of(self.source, self.layout))

    def grad(self) -> torch.Tensor | None:
        """The gradient w.r.t. the logits handed over, as accumulated in the caller's tensor."""
        src = self.source if self.source is not None else self.logits
        return None if src.grad is None else view_of(src.grad, self.layout if self.layout != "nonleaf" else "")


@dataclass(frozen=True)
class LinearShard:
    """A fused-linear case's inputs on one rank: the hidden states (replicated), this rank's rows of
    the LM head, the tokens, and the upstream loss. Both tensors are leaves the caller owns; each
    requires grad as the case says (`LinearCase.hidden_grad`, `weight_grad`: a frozen one does not)."""
    hidden: torch.Tensor  # what the routine gets: the caller's buffer `source`, or a view of it
    weight: torch.Tensor
    tokens: torch.Tensor
    w_log_prob: torch.Tensor | None
    w_entropy: torch.Tensor | None
    source: torch.Tensor | None = None  # the caller's leaf when `hidden` is a view of it (`hidden_view`)
    view: str = "contiguous"  # how `hidden` views `source` (cases.case.HIDDEN_VIEWS)

    @classmethod
    def of(cls, case: LinearCase, rank: int, device: torch.device) -> LinearShard:
        full = case.inputs()
        rows = slice(rank * case.v_local, (rank + 1) * case.v_local)
        source, hidden = hidden_laid_out(full.hidden.clone().to(device), case.hidden_view, case.hidden_grad)
        weight = full.weight[rows].contiguous().to(device).requires_grad_(case.weight_grad)
        return cls(hidden, weight, full.tokens.to(device), full.w_log_prob, full.w_entropy,
                   None if source is hidden else source, case.hidden_view)

    def hidden_grad(self) -> torch.Tensor | None:
        """The gradient w.r.t. the hidden states handed over, as accumulated in the caller's tensor."""
        if self.source is None:
            return self.hidden.grad
        return None if self.source.grad is None else hidden_view_of(self.source.grad, self.hidden.shape[0], self.view)

    def call(self, target: Target, case: LinearCase, group: Any) -> tuple[Any, Any]:
        assert target.linear is not None  # a case runs only at the levels its target has
        return target.linear(self.hidden, self.weight, self.tokens, group, **target.kwargs(
            "linear", with_entropy=case.with_entropy, chunk_size=case.chunk_size,
            with_entropy_grad=case.with_entropy_grad))

    def loss(self, log_prob: Any, entropy: Any) -> Any:
        device = self.hidden.device
        return weighted(log_prob, self.w_log_prob, device) + weighted(entropy, self.w_entropy, device)


@dataclass(frozen=True)
class DistillShard:
    """A distillation case's inputs on one rank: the student's shard laid out as the case says (the
    caller's leaf `source`), the teacher's shard (full and topk teachers), the teacher pass's top-k
    log-probs and ids (replicated), and this rank's upstream weights: the output's, or for the
    sharded log-softmax this rank's columns of them."""
    student: torch.Tensor
    source: torch.Tensor
    layout: str
    teacher: torch.Tensor | None
    topk_log_probs: torch.Tensor | None
    topk_ids: torch.Tensor | None
    weights: torch.Tensor

    @classmethod
    def of(cls, case: DistillCase, rank: int, device: torch.device) -> "DistillShard":
        full = case.inputs()
        source, student = laid_out(shard(full.student, rank, case.v_local, device), case.layout, case.requires_grad)
        teacher = topk_log_probs = topk_ids = None
        if case.function == "divergence" and case.teacher != "given":
            teacher = shard(full.teacher, rank, case.v_local, device).requires_grad_(case.teacher_grad)
        if case.function == "divergence" and case.teacher == "given":
            topk_log_probs = full.topk_log_probs.to(device)
        if case.function == "gather" or (case.function == "divergence" and case.teacher == "given"):
            topk_ids = full.topk_ids.to(device)
        weights = shard(full.weights, rank, case.v_local, device) if case.function == "log_softmax" \
            else full.weights.to(device)
        return cls(student, source, case.layout, teacher, topk_log_probs, topk_ids, weights)

    def call(self, target: Target, case: DistillCase, group: Any) -> tuple[Any, Any]:
        """The case's function: `(output, global ids)` for the top-k, `(output, None)` otherwise."""
        fn = target.distill[case.function]
        common = dict(temperature=case.temperature, chunk_size=case.chunk_size)
        if case.function == "log_softmax":
            return fn(self.student, group, **common), None
        if case.function == "topk":
            out = fn(self.student, case.k, group, **common)
            if isinstance(out, (tuple, list)) and len(out) == 2:
                return out[0], out[1]
            return out, None  # not the contract's pair: `values` says what came back
        if case.function == "gather":
            return fn(self.student, self.topk_ids, group, renormalize=case.renormalize, **common), None
        return fn(self.student, group, teacher_logits=self.teacher, teacher_topk_log_probs=self.topk_log_probs,
                  teacher_topk_indices=self.topk_ids, k=case.k if case.teacher == "topk" else 0, kind=case.kind,
                  beta=case.beta, renormalize=case.renormalize, **common), None

    def loss(self, out: Any) -> Any:
        """The upstream loss: the output weighed by this rank's weights (the same loss on every rank
        for a replicated output; this rank's part of the sum for the sharded log-softmax); 0.0 when
        the output carries no gradient or has the wrong size (`shapes-dtypes` reports it)."""
        if not isinstance(out, torch.Tensor) or not out.requires_grad or out.numel() != self.weights.numel():
            return 0.0
        w = self.weights.to(device=out.device, dtype=out.dtype).reshape(out.shape)
        # A -inf output (a masked entry) has a weight of 0: no gradient, whatever its value.
        return (out * w).nan_to_num(0.0, 0.0, 0.0).sum()

    def grad(self) -> torch.Tensor | None:
        """The gradient w.r.t. the student's logits handed over, as accumulated in the caller's tensor."""
        g = self.source.grad
        return None if g is None else view_of(g, self.layout if self.layout != "nonleaf" else "")


def prepared_call(target: Target, case: KernelCase, rank: int, device: torch.device,
                  group: Any) -> Callable[[], None]:
    """One forward+backward of the target's kernel on this rank's shard, inputs built once."""
    inputs = KernelShard.of(case, rank, device)

    def call() -> None:
        (inputs.source if inputs.source is not None else inputs.logits).grad = None
        loss = inputs.loss(*inputs.call(target, case, group))
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return call


def prepared_linear_call(target: Target, case: LinearCase, rank: int, device: torch.device,
                         group: Any) -> Callable[[], None]:
    """One forward+backward of the target's fused-linear routine on this rank's shard, inputs built once."""
    inputs = LinearShard.of(case, rank, device)

    def call() -> None:
        for leaf in (inputs.source if inputs.source is not None else inputs.hidden, inputs.weight):
            leaf.grad = None
        loss = inputs.loss(*inputs.call(target, case, group))
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return call


def prepared_distill_call(target: Target, case: DistillCase, rank: int, device: torch.device,
                          group: Any) -> Callable[[], None]:
    """One forward+backward of the case's distillation function on this rank's shard, inputs built once."""
    inputs = DistillShard.of(case, rank, device)

    def call() -> None:
        for leaf in (inputs.source, inputs.teacher):
            if leaf is not None:
                leaf.grad = None
        loss = inputs.loss(inputs.call(target, case, group)[0])
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return call
