"""The oracle checks: a routine's outputs, gradients, flags and shapes against the float64 oracle,
and the same case another way (unchunked, at TP 1). They hold at every level with an oracle of
outputs (evidence "oracle"); how a level's outputs are judged is its judge's (`Level.judge`:
`harness.checks.kernel` for the token levels, `harness.checks.distill` for the distillation level),
asked of the case's level, as torch's `assert_close` asks each input's pair how to compare it."""
from __future__ import annotations

from typing import Any

from harness.checks import Evidence, Explain, check
from harness.checks.terms import each_term_alone

ORACLE = ("oracle",)


def _nonempty(c: Any, t: Any) -> bool:
    return c.T > 0


def _gradient_terms(ev: Evidence, related: dict[str, Evidence]) -> str:
    return ev.level.judge.gradient_terms(ev, related)


@check("values", evidence=ORACLE, applies=_nonempty, needs="forward", terms=True)
def values(ev: Evidence) -> list[str]:
    """log-probs and entropy match the float64 oracle of the same input values, at float32 scale.
    Distillation level: each function's output, a top-k as any valid top-k (docs/distill.md)."""
    return ev.level.judge.values(ev)


@check("gradients", evidence=ORACLE, applies=lambda c, t: c.T > 0 and c.has_backward, reads=("autograd",),
       explain=Explain(each_term_alone, _gradient_terms), terms=True)
def gradients(ev: Evidence) -> list[str]:
    """The local gradient is the local slice of the oracle's gradient of sum(w1*lp) + sum(w2*H);
    with two calls (accumulated microbatches, or two losses summed in one graph), the sum of both;
    with two calls on different inputs in one graph (two_inputs), each call's inputs get their own.
    Linear level: the weight shard's gradient is its slice of the full head's, and every rank's
    hidden-state gradient is the full one (all-reduced over the TP group); a frozen input gets None.
    In every TP group of the world, against the oracle of its DP replica's data.
    Distillation level: the student's (and a differentiable teacher's) shards (docs/distill.md)."""
    return ev.level.judge.gradients(ev)


@check("grad-flags", evidence=ORACLE, needs="forward", terms=True)
def grad_flags(ev: Evidence) -> list[str]:
    """entropy.requires_grad == with_entropy and with_entropy_grad and logits.requires_grad (linear
    level: the hidden states and weight require grad) (and
    autograd on: nothing carries a gradient under no_grad / inference_mode); entropy is None
    exactly when not requested; log_prob follows the logits.
    Distillation level: the output follows the differentiable inputs (docs/distill.md)."""
    return ev.level.judge.grad_flags(ev)


@check("shapes-dtypes", evidence=ORACLE, needs="forward", terms=True)
def shapes_dtypes(ev: Evidence) -> list[str]:
    """T elements out, float32 out, the gradient in the logits' dtype and shape (linear level: the
    weight shard's and the hidden states' gradients in their dtype and shape).
    Distillation level: each function's shape, float32 out, int64 ids (docs/distill.md)."""
    return ev.level.judge.shapes_dtypes(ev)


@check("finite", evidence=ORACLE, applies=_nonempty, needs="forward", terms=True)
def finite(ev: Evidence) -> list[str]:
    """No NaN or inf where the oracle is finite (outputs and gradient).
    Distillation level: the output and the gradients (docs/distill.md)."""
    return ev.level.judge.finite(ev)


@check("chunk-invariance", evidence=ORACLE,
       twin=lambda c: c.replace(chunk_size=-1) if c.chunk_size > 0 and c.T > 0 else None, terms=True)
def chunk_invariance(ev: Evidence) -> list[str]:
    """The same case unchunked gives the same answer within the tolerance.
    Distillation level: a top-k's log-probs, not its ids (docs/distill.md)."""
    return ev.level.judge.outputs_match(ev, ev.twins["chunk-invariance"], "chunk_size=-1")


@check("tp-invariance", evidence=ORACLE, min_ranks=2,
       twin=lambda c: c.replace(tp=1, v_local=c.vocab) if c.T > 0 else None, terms=True)
def tp_invariance(ev: Evidence) -> list[str]:
    """The same global case at TP 1 gives the same answer within the tolerance.
    Distillation level: a top-k's log-probs, not its ids (docs/distill.md)."""
    return ev.level.judge.outputs_match(ev, ev.twins["tp-invariance"], "TP 1")
