"""The KL-estimator level (docs/kl.md): its float64 reference, its cases, a correct control of
another formulation drawing no finding, and each of its mutants killed by the check meant for it."""
from __future__ import annotations

import pytest
import torch

from harness.cases.kl import KL_KINDS, KLCase
from harness.reference import kl as ref

CONTROL = "tests.controls.kl_ratio"


def _pair(seed: int, T: int = 64, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = -torch.rand(T, generator=g, dtype=torch.float64) * 5
    return b + scale * torch.randn(T, generator=g, dtype=torch.float64), b


def test_reference_estimators_are_the_textbook_ones() -> None:
    a, b = _pair(0)
    x = a - b
    k1, k2, k3 = (ref.kl_estimate(a, b, kind) for kind in KL_KINDS)
    torch.testing.assert_close(k1, x, rtol=0, atol=0)
    torch.testing.assert_close(k2, 0.5 * k1 ** 2, rtol=1e-15, atol=0)
    r = torch.exp(b - a)  # pi_ref / pi
    torch.testing.assert_close(k3, r - 1 - torch.log(r), rtol=1e-12, atol=1e-12)
    assert (k3 >= 0).all() and (k2 >= 0).all()
    for kind in KL_KINDS:  # the policy is its reference: every estimate 0, k1's gradient 1, the others' 0
        assert ref.kl_estimate(b, b, kind).abs().max() == 0
        grad = ref.grad_log_probs(b, b, torch.ones_like(b), kind)
        assert torch.equal(grad, torch.ones_like(b) if kind == "k1" else torch.zeros_like(b))


def test_reference_gradient_is_autograds_with_the_clamps_zero_outside() -> None:
    a, b = _pair(1, scale=15.0)
    mask = torch.rand(a.shape[0], generator=torch.Generator().manual_seed(2)) < 0.6
    for kind in KL_KINDS:
        for reduction in ("none", "token_mean", "sum"):
            for clamp in (None, 10.0):
                w = torch.randn(a.shape if reduction == "none" else (), dtype=torch.float64)
                leaf = a.clone().requires_grad_(True)
                (ref.kl_estimate(leaf, b, kind, mask, reduction, clamp) * w).sum().backward()
                want = ref.grad_log_probs(a, b, w, kind, mask, reduction, clamp)
                torch.testing.assert_close(leaf.grad, want, rtol=1e-12, atol=1e-12)
                if clamp is not None:
                    assert (want[(a - b).abs() > clamp] == 0).all()
                assert (want[~mask] == 0).all()


def test_reductions_count_the_valid_tokens_only() -> None:
    a, b = _pair(3, T=5)
    mask = torch.tensor([True, False, True, False, False])
    per = ref.kl_estimate(a, b, "k3", mask)
    assert per[~mask].abs().max() == 0
    torch.testing.assert_close(ref.kl_estimate(a, b, "k3", mask, "sum"), per.sum())
    torch.testing.assert_close(ref.kl_estimate(a, b, "k3", mask, "token_mean"), per.sum() / 2)
    assert ref.kl_estimate(a, b, "k3", torch.zeros(5, dtype=torch.bool), "token_mean") == 0


def test_cases_parse_back_stay_off_the_clamp_and_refuse_what_the_level_is_not() -> None:
    from harness.base import levels

    case = KLCase(tp=1, T=30, kind="k2", reduction="token_mean", dtype="bf16", regime="fartail", mask="float",
                  clamp=20.0, seed=7)
    assert levels.parse(case.spec()) == case
    inp = case.inputs()
    x = inp.log_probs.double() - inp.ref_log_probs.double()
    assert ((x.abs() - 20.0).abs() > 1e-3).all() and (x.abs() > 20).any()
    assert inp.log_probs.dtype == torch.bfloat16 and inp.mask is not None and inp.mask.dtype == torch.float32
    with pytest.raises(ValueError, match="tp=1"):
        KLCase(tp=2, T=3)
    with pytest.raises(ValueError, match="T=0"):
        KLCase(tp=1, T=0, reduction="sum")


# ---------------------------------------------------------------------------- on the pools
KL_CHECKS = ("values", "gradients", "grad-flags", "shapes-dtypes", "finite", "crash", "input-integrity",
             "empty-input", "side-effects")


@pytest.mark.distributed
@pytest.mark.parametrize("target", ["harness.targets.fused", CONTROL])
def test_builtin_and_control_are_clean(harness_pools, target: str) -> None:
    from harness.driver.explorer import explore
    from harness.driver.runner import Runner

    runner = Runner(target, collective_timeout_s=10, pools=harness_pools)
    findings = explore(runner, "kl", [1], 150, seed=11, shrink=False)
    assert not findings, [f"{f.check} {f.case}: {f.message[:300]}" for f in findings]
    stats = runner.verdicts.stats
    assert {n for n in KL_CHECKS if not stats[(n, "kl")].applied} == set()
    assert max(stats[("values", "kl")].margins) < 0.5


@pytest.mark.distributed
def test_kl_mutants_killed_by_their_checks(harness_pools) -> None:
    from harness.commands.mutate import CLEAN, kill_matrix, run_catalog
    from harness.targets.mutants import catalog

    names = [n for n, m in catalog().items() if m.levels == ("kl",)]
    assert len(names) >= 6
    results = run_catalog(names, [1], harness_pools, budget=60, collective_timeout_s=6, include_clean=False)
    assert not [r.name for r in results if r.name != CLEAN and not r.ok], kill_matrix(results)
