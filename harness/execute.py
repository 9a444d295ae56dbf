"""Rank-side execution of one case: build this rank's shard, run the target, record observations.

Nothing here judges the target; it records what happened (outputs, flags, gradients, input
integrity, collectives, errors) so that checks in the main process decide, against one oracle run.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cases.case import Case, KernelCase, WrapperCase
from harness import memory, trace
from harness.targets import Target


@dataclass
class RankResult:
    rank: int
    error: str | None = None
    error_kind: str | None = None  # "exception", "timeout", "died", "mismatch"
    trace: list = field(default_factory=list)
    obs: dict[str, Any] = field(default_factory=dict)


def _shard(t: torch.Tensor | None, rank: int, v_local: int, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    return t[..., rank * v_local:(rank + 1) * v_local].contiguous().to(device)


class _Integrity:
    """Snapshot of the caller's tensors: values and version counters must survive the call."""

    def __init__(self, **tensors: torch.Tensor | None):
        self.tensors = {k: v for k, v in tensors.items() if v is not None}
        self.values = {k: v.detach().clone() for k, v in self.tensors.items()}
        self.versions = {k: v._version for k, v in self.tensors.items()}

    def problems(self, stage: str) -> list[str]:
        out = []
        for k, t in self.tensors.items():
            if t._version != self.versions[k]:
                out.append(f"{k}: version counter {self.versions[k]} -> {t._version} after {stage} (in-place write)")
            if not torch.equal(t.detach(), self.values[k]) and not _same_with_nan(t.detach(), self.values[k]):
                out.append(f"{k}: values changed after {stage}")
        return out


def _same_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _detached(t: Any) -> Any:
    return t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t


def _meta(t: Any) -> dict[str, Any] | None:
    if not isinstance(t, torch.Tensor):
        return None
    return {"shape": tuple(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "requires_grad": t.requires_grad}


def run_kernel(case: KernelCase, target: Target, rank: int, group: Any, device: torch.device,
               obs: dict[str, Any]) -> None:
    """Fills `obs` as it goes: a backward that raises leaves the forward's observations."""
    full = case.inputs()
    logits = _shard(full.logits, rank, case.v_local, device).requires_grad_(case.requires_grad)
    tokens = full.tokens.to(device)
    keep = _shard(full.keep_mask, rank, case.v_local, device)
    integrity = _Integrity(logits=logits, tokens=tokens, log_prob_keep_mask=keep)
    meter = memory.Meter((logits, tokens, keep), device)
    with meter.forward():
        log_prob, entropy = target.kernel(logits, tokens, group, with_entropy=case.with_entropy,
                                          chunk_size=case.chunk_size, log_prob_keep_mask=keep,
                                          with_entropy_grad=case.with_entropy_grad)
    meter.outputs(log_prob, entropy)
    obs.update({
        "log_prob": _detached(log_prob), "entropy": _detached(entropy),
        "log_prob_meta": _meta(log_prob), "entropy_meta": _meta(entropy),
        "integrity": integrity.problems("forward"), "stage": "forward",
    })
    loss = _weighted(log_prob, full.w_log_prob, device) + _weighted(entropy, full.w_entropy, device)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        with meter.backward():
            loss.backward()
        obs["grad"] = _detached(logits.grad)
        obs["grad_meta"] = _meta(logits.grad)
        obs["integrity"] += integrity.problems("backward")
    obs["memory"] = meter.figures
    obs["stage"] = "backward"


def _weighted(out: Any, w: torch.Tensor | None, device: torch.device) -> Any:
    if w is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
        return 0.0
    return (out.reshape(-1) * w.to(device=device, dtype=out.dtype)).sum()


def run_wrapper(case: WrapperCase, target: Target, rank: int, device: torch.device, obs: dict[str, Any]) -> None:
    full = case.inputs()
    logits = _shard(full.logits, rank, case.v_local, device).unsqueeze(0).requires_grad_(True)
    tokens = [t.to(device) for t in full.unconcat_tokens]
    integrity = _Integrity(logits=logits, **{f"tokens[{i}]": t for i, t in enumerate(tokens)})
    top_p_ids, top_p_offsets = _to(full.top_p_token_ids, device), _to(full.top_p_token_offsets, device)
    meter = memory.Meter((logits, tokens, top_p_ids, top_p_offsets), device)
    with meter.forward():
        _, res = target.wrapper(
            logits, args=case.args(), unconcat_tokens=tokens,
            total_lengths=list(case.total_lengths), response_lengths=list(case.response_lengths),
            with_entropy=case.with_entropy, top_p_token_ids=top_p_ids, top_p_token_offsets=top_p_offsets)
    meter.outputs(res)
    n_forward = trace.count()
    log_probs = list(res.get("log_probs", []))
    entropy = res.get("entropy")
    obs.update({
        "log_probs": [_detached(t) for t in log_probs],
        "entropy": None if entropy is None else [_detached(t) for t in entropy],
        "log_probs_meta": [_meta(t) for t in log_probs],
        "entropy_meta": None if entropy is None else [_meta(t) for t in entropy],
        "integrity": integrity.problems("forward"), "stage": "forward",
        "n_forward_collectives": n_forward,
    })
    if case.chunk_size > 0 and case.top_p == "none" and target.kernel is not None:
        obs["kernel_traces"] = _kernel_traces(case, target, logits[0].detach(), device)
    loss = sum((_weighted(t, w, device) for t, w in zip(log_probs, full.w_log_probs)), 0.0)
    if entropy is not None:
        loss = loss + sum((_weighted(t, w, device) for t, w in zip(entropy, full.w_entropy)), 0.0)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        with meter.backward():
            loss.backward()
        obs["grad"] = _detached(logits.grad[0]) if logits.grad is not None else None
        obs["integrity"] += integrity.problems("backward")
    obs["memory"] = meter.figures
    if memory.compares_kernel(case, target):
        obs["memory"]["kernel"] = memory.kernel_figures(case, target, logits, tp_group(), device)
    obs["stage"] = "backward"


def _kernel_traces(case: WrapperCase, target: Target, logits: torch.Tensor, device: torch.device) -> dict:
    """The target kernel's forward collectives on the wrapper's rows, chunked and unchunked: the
    design-agnostic evidence of whether the wrapper passed `log_probs_chunk_size` on."""
    import reference

    tokens = reference.shifted_targets(case.inputs().unconcat_tokens, list(case.total_lengths)).to(device)
    traces = {}
    for chunk in (case.chunk_size, -1):
        with trace.recording() as events:
            target.kernel(logits.clone().requires_grad_(True), tokens, tp_group(), with_entropy=case.with_entropy,
                          chunk_size=chunk, log_prob_keep_mask=None, with_entropy_grad=case.expects_entropy_grad)
        traces[chunk] = list(events)
    return traces


def _to(ts: list | None, device: torch.device) -> list | None:
    return None if ts is None else [None if t is None else t.to(device) for t in ts]


def tp_group() -> Any:
    """The TP group as production code finds it: megatron-core's parallel_state when initialised."""
    if not dist.is_initialized():
        return None
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return dist.group.WORLD


def execute(case: Case, target: Target, rank: int, device: torch.device) -> RankResult:
    """Run one case on this rank; never raises (an exception is an observation)."""
    result = RankResult(rank)
    group = tp_group()
    with trace.recording() as events:
        try:
            if case.level == "kernel":
                run_kernel(case, target, rank, group, device, result.obs)
            else:
                run_wrapper(case, target, rank, device, result.obs)
        except Exception as e:  # the target's failure is data
            result.error = f"{type(e).__name__}: {e}".strip()[:2000]
            result.error_kind = "exception"
            result.obs["traceback"] = traceback.format_exc(limit=8)[-4000:]
    result.trace = list(events)
    return result
