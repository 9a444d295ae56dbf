"""What a case should produce: the float64 oracle run once per case in the main process, plus the
tolerance policy (see docs/tolerances.md).

Tolerances are float32-scale whatever the input dtype, since the contract makes the math float32:
`atol = K * 2**-24 * C` with `C = max|x| (finite entries) + ln V`. Gradients scale that by the size
of the upstream weights and, for the entropy term, by `2 + ln V` (|p (log p + H)| <= 1/e + H).
Gradients returned in bf16/fp16 add that dtype's rounding of the expected values.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

import reference
from cases.case import Case, KernelCase, WrapperCase

U32 = 2.0 ** -24
K = 8.0
_OUT_EPS = {"fp32": 0.0, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


@dataclass(frozen=True)
class Expected:
    log_prob: torch.Tensor | list[torch.Tensor]  # kernel: [T]; wrapper: per-sample [R_i]
    entropy: torch.Tensor | list[torch.Tensor] | None
    grad: torch.Tensor | None  # full [T, V] float64
    entropy_requires_grad: bool
    value_atol: float
    grad_atol: float
    grad_rtol: float


def _scale(x: torch.Tensor, vocab: int) -> float:
    finite = x[torch.isfinite(x)]
    return (finite.abs().max().item() if finite.numel() else 0.0) + math.log(max(vocab, 1))


def _grad_atol(scale: float, vocab: int, w1: list[torch.Tensor], w2: list[torch.Tensor] | None,
               dtype: str, grad: torch.Tensor | None) -> float:
    wmax = lambda ws: max((w.abs().max().item() for w in ws if w.numel()), default=0.0)  # noqa: E731
    weight = wmax(w1) + (wmax(w2) * (2.0 + math.log(vocab)) if w2 else 0.0)
    out = _OUT_EPS[dtype] * (grad.abs().max().item() if grad is not None and grad.numel() else 0.0)
    return K * U32 * scale * weight + out


@functools.lru_cache(maxsize=256)
def expected(case: Case) -> Expected:
    if isinstance(case, KernelCase):
        return _kernel(case)
    return _wrapper(case)


def _abs_sum(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The weight that bounds the error of two calls' summed gradients (one call: its own)."""
    return a if a is None or b is None else a.abs() + b.abs()


def _kernel(case: KernelCase) -> Expected:
    inp = case.inputs()
    x = inp.logits.to(torch.float64)
    grad = None
    w_lp, w_ent = inp.total_weights()  # two calls into one gradient: the gradient is linear in the weights
    if case.grad_on:
        grad = reference.logits_grad(x, inp.tokens, inp.keep_mask, w_lp, w_ent if case.expects_entropy_grad else None)
    w1 = _abs_sum(inp.w_log_prob, inp.w_log_prob_2)
    w2 = _abs_sum(inp.w_entropy, inp.w_entropy_2)
    w1s = [w1] if w1 is not None else []
    w2s = [w2] if case.expects_entropy_grad and w2 is not None else None
    scale = _scale(x, case.vocab)
    return Expected(
        log_prob=reference.log_probs(x, inp.tokens, inp.keep_mask),
        entropy=reference.entropy(x) if case.with_entropy else None,
        grad=grad,
        entropy_requires_grad=case.expects_entropy_grad,
        value_atol=K * U32 * scale,
        grad_atol=_grad_atol(scale, case.vocab, w1s, w2s, case.dtype, grad),
        grad_rtol=_OUT_EPS[case.dtype],
    )


def _wrapper(case: WrapperCase) -> Expected:
    inp = case.inputs()
    args = case.args()
    common = dict(unconcat_tokens=inp.unconcat_tokens, total_lengths=list(case.total_lengths),
                  response_lengths=list(case.response_lengths), with_entropy=case.with_entropy,
                  top_p_token_ids=inp.top_p_token_ids, top_p_token_offsets=inp.top_p_token_offsets)
    out = reference.wrapper_outputs(inp.logits, args, **common)
    w_lp, w_ent = inp.total_weights()  # two calls into one gradient: the gradient is linear in the weights
    w2 = w_ent if out["entropy_requires_grad"] else None
    grad = reference.wrapper_logits_grad(inp.logits, args, w_log_probs=w_lp, w_entropy=w2, **common) \
        if case.grad_on else None
    if inp.w_log_probs_2 is not None:  # the error bound of two summed gradients
        w_lp = [a.abs() + b.abs() for a, b in zip(inp.w_log_probs, inp.w_log_probs_2)]
        w2 = [a.abs() + b.abs() for a, b in zip(inp.w_entropy, inp.w_entropy_2)] if w2 is not None else None
    temperature = case.temperature if case.temperature is not None else 1.0
    scale = _scale(inp.logits.to(torch.float64) / temperature, case.vocab)
    # The chain rule through 1/temperature scales every gradient entry.
    return Expected(
        log_prob=out["log_probs"], entropy=out["entropy"], grad=grad,
        entropy_requires_grad=out["entropy_requires_grad"],
        value_atol=K * U32 * scale,
        grad_atol=_grad_atol(scale, case.vocab, w_lp, w2, "fp32", grad) / abs(temperature),
        grad_rtol=0.0,
    )
