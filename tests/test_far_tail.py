"""The far tail (the `fartail` regime, docs/tolerances.md#the-far-tail): log-probs of -50 to -115 at
the target and at the gathered ids, judged against the float64 oracle. A correct float32 routine is
inside the bound there; a floor (`log(p + eps)`, float32's own underflow of a probability) or a clamp
is far outside it. One process, one rank: no pools.
"""
from __future__ import annotations

import pytest
import torch

from harness.cases.case import REGIMES, DistillCase, KernelCase, WrapperCase
from harness.checks.oracle import distill_expected, kernel_expected
from harness.checks.tolerance import value_bounds
from harness.targets.fused import ROUTINE
from harness.targets.fused_distill import DISTILL_ROUTINE
from harness.targets.mutants import catalog
from tests.controls import distill_autograd

KERNEL = KernelCase(tp=1, T=64, v_local=48, regime="fartail", with_entropy=True, seed=7)


def _ratio(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> float:
    return ((actual.double().reshape(expected.shape) - expected).abs() / bound).max().item()


def test_the_regime_reaches_minus_50_to_minus_110_at_each_level():
    assert "fartail" in REGIMES
    inp = KERNEL.inputs()
    lp = inp.logits.double().log_softmax(-1).gather(-1, inp.tokens.unsqueeze(-1)).squeeze(-1)
    assert lp.min() < -100 and ((lp < -50) & (lp > -120)).sum() >= 5
    wrapper = WrapperCase(tp=1, v_local=40, total_lengths=(9, 7), response_lengths=(5, 3), regime="fartail")
    assert wrapper.inputs().logits.double().log_softmax(-1).min() < -100
    for tp, v_local in ((1, 16), (2, 8), (4, 4)):  # the same rows at every TP size
        case = DistillCase(tp=tp, T=6, v_local=v_local, function="gather", k=3, renormalize=False,
                           regime="fartail", seed=3)
        d = case.inputs()
        at_ids = d.student.double().log_softmax(-1).gather(-1, d.topk_ids)
        assert (at_ids[:, 0] < -50).all() and at_ids.min() > -120  # the teacher's top id: the student's far tail


def test_float32_is_exact_enough_at_any_depth_and_floors_are_not():
    """x_t - lse in float32 (the built-in's, and torch's log_softmax) uses under 0.3 of the bound down to
    -115. The log of a float32 probability is not: subnormal below -87 (its relative spacing grows to 1
    at -103) and 0 below -104, so its log is off by 1e-4 and more below -95, then -inf: float32's own floor,
    outside the bound as `log(p + 1e-20)` (-46) and a clamp at -30 are."""
    inp = KERNEL.inputs()
    x64, tokens = inp.logits.double(), inp.tokens
    expected = x64.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    bound, _ = value_bounds(x64, tokens, tp=1)
    x = inp.logits.float()
    rows = torch.arange(x.shape[0])
    correct = {"lse": x[rows, tokens] - x.logsumexp(-1), "log_softmax": x.log_softmax(-1)[rows, tokens],
               "built-in": ROUTINE.calculate_log_probs_and_entropy(x, tokens, None)[0]}
    for name, lp in correct.items():
        assert _ratio(lp, expected, bound) < 0.3, name
    p32 = x.softmax(-1)[rows, tokens]
    deep = (expected < -95) & (expected > -103)  # subnormal: relative spacing 2e-4 to 1
    assert deep.sum() >= 3 and (expected < -105).any()
    floor = (p32.log().double() - expected).abs()
    assert (floor[deep] > bound[deep]).float().mean() > 0.5 and floor[deep].max() > 10 * bound.max()
    assert torch.isinf(p32.log()[expected < -105]).all()
    for wrong in ((p32.double() + 1e-20).log(), correct["lse"].clamp_min(-30.0)):
        assert _ratio(wrong, expected, bound) > 1e5


@pytest.mark.parametrize("name", ["log-prob-eps-floor", "log-prob-clamped"])
def test_kernel_floor_mutants_are_outside_the_bound_in_the_far_tail(name):
    exp = kernel_expected(KERNEL)
    inp = KERNEL.inputs()
    lp, _ = ROUTINE.calculate_log_probs_and_entropy(inp.logits, inp.tokens, None, with_entropy=True)
    assert _ratio(lp, exp.log_prob, exp.log_prob_tol) < 0.3
    lp, _ = catalog()[name].routine().calculate_log_probs_and_entropy(inp.logits, inp.tokens, None, with_entropy=True)
    assert _ratio(lp, exp.log_prob, exp.log_prob_tol) > 1e4


DISTILL_CASES = {
    "distill-gather-log-eps": DistillCase(tp=1, T=6, v_local=40, function="gather", k=6, renormalize=False,
                                          regime="fartail", seed=4),
    "distill-student-log-eps": DistillCase(tp=1, T=6, v_local=40, kind="forward_kl", teacher="topk", k=6,
                                           renormalize=False, regime="fartail", temperature=2.0, seed=5),
    "distill-logits-clamped": DistillCase(tp=1, T=6, v_local=40, function="log_softmax", regime="fartail",
                                          dtype="bf16", seed=6),
}


def _distill_output(routine, case: DistillCase) -> torch.Tensor:
    inp = case.inputs()
    if case.function == "gather":
        return routine.distill_gather(inp.student, inp.topk_ids, None, temperature=case.temperature,
                                      renormalize=case.renormalize)
    if case.function == "log_softmax":
        return routine.distill_log_softmax(inp.student, None, temperature=case.temperature)
    return routine.distill_divergence(inp.student, None, teacher_logits=inp.teacher, k=case.k, kind=case.kind,
                                      temperature=case.temperature, renormalize=case.renormalize)


@pytest.mark.parametrize("name", sorted(DISTILL_CASES))
def test_distill_floor_mutants_are_outside_the_bound_in_the_far_tail(name):
    case = DISTILL_CASES[name]
    exp = distill_expected(case)
    fin = torch.isfinite(exp.log_prob)
    for correct in (DISTILL_ROUTINE, distill_autograd):  # the built-in routine and the control
        out = _distill_output(correct, case).detach().double()
        assert torch.equal(torch.isfinite(out), fin)
        assert _ratio(out[fin], exp.log_prob[fin], exp.log_prob_tol[fin]) < 0.3
    wrong = _distill_output(catalog()[name].routine(), case).detach().double()
    assert _ratio(wrong[fin], exp.log_prob[fin], exp.log_prob_tol[fin]) > 100
