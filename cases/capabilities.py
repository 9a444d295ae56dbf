"""What a case asks of a routine beyond the contract's core, and how to fit a case to a routine that
declares it lacks something (`HARNESS_CAPABILITIES` of a target: no entropy, no keep mask, no
metric-only entropy).

Every path that makes cases (strategies, the corpus, twins, the benchmark cases) goes through the
runner, which fits each case with `fit` before it runs: a routine is never sent an input it said it
does not take, and a finding is never about a feature the routine does not claim.
"""
from __future__ import annotations

from typing import Callable

from harness.cases.case import (
    DISTILL_FUNCTIONS,
    DIVERGENCES,
    TEACHERS,
    Case,
    DistillCase,
)

# entropy: computes one; keep_mask: takes log_prob_keep_mask; metric_only_entropy: honours
# with_entropy_grad=False (an entropy without autograd history). A routine without the last one
# (verl's, TRL's: autograd alone decides) is run with with_entropy_grad=True wherever a case asks
# for False, and `grad-flags` / `memory-metric-only` then have nothing of that kind to check.
# top_p: the wrapper takes the top-p replay arguments (slime's before PR #2102 does not); without
# it, wrapper cases run without a recorded nucleus.
# context_parallel: the wrapper takes CP > 1 (docs/context-parallel.md); a routine without it runs
# its wrapper cases at CP 1. allgather_cp: it takes the all-gather CP layout (`args.allgather_cp`);
# a routine with only the load-balanced (zigzag) one, NeMo-RL's, is given the case in that layout.
# cp_gradient: its wrapper's backward runs at CP > 1; without it (NeMo-RL's on CPU: its CP backward
# moves an index to CUDA), a CP case runs without autograd, which checks the CP forward and, through
# the training-path forward every such case also runs, that the two paths agree.
# wrapper_half_precision: the wrapper takes bf16 and fp16 logits (the contract's are float32, and slime's
# wrapper asserts it), as NeMo-RL's packed log-probs do; declared, not assumed: without it, wrapper
# cases run on float32 logits.
# chunk_size: the wrapper takes a chunk size (`args.log_probs_chunk_size`) and is held to it
# (`memory-logits-dtype`); a trainer's caller that has no such setting runs its cases unchunked.
CAPABILITIES = ("entropy", "keep_mask", "metric_only_entropy", "top_p", "context_parallel", "allgather_cp",
                "cp_gradient", "wrapper_half_precision", "chunk_size")
OPT_IN = ("wrapper_half_precision",)  # capabilities a routine has only where it declares them
# The distillation level (docs/distill.md): `distill_FUNCTION` (inferred False for a function the module
# lacks); a divergence `kind` (`forward_kl`, ...); a teacher (`full_teacher`, `topk_teacher`,
# `given_teacher`); a top-k support renormalized over itself (`renormalized`) or not (`unnormalized`),
# for the divergence and the gather; a differentiable teacher (`teacher_grad`); a temperature other
# than 1 (`temperature`). A routine without one is given the nearest case that it has.
DISTILL_CAPABILITIES = (*(f"distill_{f}" for f in DISTILL_FUNCTIONS), *DIVERGENCES,
                        *(f"{t}_teacher" for t in TEACHERS), "renormalized", "unnormalized", "teacher_grad",
                        "temperature")


def needs(case: Case) -> set[str]:
    """The capabilities this case uses."""
    out = set()
    if case.with_entropy:
        out.add("entropy")
        if not getattr(case, "with_entropy_grad", True):
            out.add("metric_only_entropy")
    if getattr(case, "mask", "none") != "none" or getattr(case, "top_p", "none") != "none":
        out.add("keep_mask")
    if getattr(case, "top_p", "none") != "none":
        out.add("top_p")
    if getattr(case, "cp", 1) > 1:
        out.add("context_parallel")
    if getattr(case, "allgather_cp", False):
        out.add("allgather_cp")
    if getattr(case, "cp", 1) > 1 and case.autograd:
        out.add("cp_gradient")
    if case.half_precision_capability and getattr(case, "dtype", "fp32") != "fp32":
        out.add(case.half_precision_capability)
    if case.chunk_capability and getattr(case, "chunk_size", -1) > 0:
        out.add(case.chunk_capability)
    return out


def fit_distill(case: DistillCase, supports: Callable[[str], bool]) -> DistillCase:
    """The nearest distillation case whose function, divergence, teacher, support and flags the routine
    has (the case itself when it has them all)."""
    changes: dict = {}
    if not supports(f"distill_{case.function}"):
        function = next((f for f in DISTILL_FUNCTIONS if supports(f"distill_{f}")), case.function)
        changes.update(function=function)
        if function == "topk":
            changes.update(requires_grad=False, teacher_grad=False)
    function = changes.get("function", case.function)
    if case.teacher_grad and (function != "divergence" or not supports("teacher_grad")):
        changes.update(teacher_grad=False)
    if function == "divergence":
        if not supports(f"{case.teacher}_teacher"):
            changes.update(teacher=next((t for t in TEACHERS if supports(f"{t}_teacher")), case.teacher))
        if not supports(case.kind):
            changes.update(kind=next((k for k in DIVERGENCES if supports(k)), case.kind))
        if case.self_teacher and changes.get("kind", case.kind) == "soft_ce":
            changes.update(self_teacher=False)
    have, other = ("renormalized", "unnormalized") if case.renormalize else ("unnormalized", "renormalized")
    if not supports(have) and supports(other):
        changes.update(renormalize=not case.renormalize)
    if case.temperature != 1.0 and (not supports("temperature") or (
            changes.get("teacher", case.teacher) == "given" and not changes.get("renormalize", case.renormalize))):
        changes.update(temperature=1.0)
    if changes.get("kind", case.kind) == "jsd" and not 0.0 < case.beta < 1.0:
        changes.update(beta=0.5)
    return case.replace(**changes) if changes else case


def fit(case: Case, supports: Callable[[str], bool]) -> Case:
    """The nearest case of a log-prob and entropy level (kernel, wrapper, fused-linear) that needs only
    what `supports` allows (the case itself when it does). Read off the fields a case has: a case
    without `with_entropy_grad` asks no metric-only entropy, one without `mask` no keep mask of its own."""
    if case.with_entropy and not getattr(case, "with_entropy_grad", True) and not supports("metric_only_entropy"):
        case = case.replace(with_entropy_grad=True)
    if case.with_entropy and not supports("entropy"):
        # An output left out of the loss is the loss's choice: with no entropy, the loss takes both.
        case = case.replace(with_entropy=False, **({"loss_terms": "both"} if hasattr(case, "loss_terms") else {}))
    if "context_parallel" in needs(case) and not supports("context_parallel"):
        case = case.replace(cp=1, cp_layout="zigzag")
    if "allgather_cp" in needs(case) and not supports("allgather_cp"):
        case = case.replace(cp_layout="zigzag")
    if "cp_gradient" in needs(case) and not supports("cp_gradient"):
        case = case.replace(context="no_grad")
    if "wrapper_half_precision" in needs(case) and not supports("wrapper_half_precision"):
        case = case.replace(dtype="fp32")
    if "chunk_size" in needs(case) and not supports("chunk_size"):
        case = case.replace(chunk_size=-1)
    wants = needs(case)
    if getattr(case, "mask", "none") != "none" and "keep_mask" in wants and not supports("keep_mask"):
        case = case.replace(mask="none")
    elif "top_p" in wants and not (supports("keep_mask") and supports("top_p")):
        case = case.replace(top_p="none")
    return case
