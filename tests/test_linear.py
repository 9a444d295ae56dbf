"""The fused-linear level (docs/fused-linear.md): its oracle against float64 autograd, its tolerance
study, the built-in routine clean through the harness at TP 1, 2 and 4, and its mutants killed by
the checks meant to catch them."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from harness import reference
from harness.base.options import DEFAULT_TARGET
from harness.cases.case import LinearCase, parse_case
from harness.cases.strategies import linear_cases
from harness.checks import all_checks
from harness.checks.memory import linear_retained_allowance
from harness.commands.mutate import CLEAN, kill_matrix, run_catalog
from harness.driver.explorer import explore
from harness.driver.runner import Runner
from harness.meters.matmul_flops import Work
from harness.targets import load_target
from harness.targets.mutants import catalog

STUDY = Path(__file__).resolve().parent.parent / "scripts" / "studies" / "linear_tolerance_study.py"
LINEAR_CHECKS = ("values", "gradients", "grad-flags", "shapes-dtypes", "finite", "crash", "hang", "collectives",
                 "chunk-invariance", "tp-invariance", "input-integrity", "empty-input", "memory-metric-only",
                 "memory-backward-frees", "memory-linear-retained", "memory-budget", "frozen-input-work",
                 "memory-logits-dtype", "side-effects", "warning")


def _study():
    spec = importlib.util.spec_from_file_location("linear_tolerance_study", STUDY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", [
    LinearCase(tp=1, T=6, H=5, v_local=7, seed=1),
    LinearCase(tp=2, T=9, H=16, v_local=4, regime="peaked", loss_terms="log_prob", seed=2),
    LinearCase(tp=4, T=4, H=3, v_local=3, dtype="bf16", regime="wide", seed=3),
], ids=lambda c: c.spec())
def test_oracle_matches_float64_autograd(case: LinearCase) -> None:
    inp = case.inputs()
    h = inp.hidden.to(torch.float64).requires_grad_()
    w = inp.weight.to(torch.float64).requires_grad_()
    logp = (h @ w.T).log_softmax(-1)
    lp = logp[torch.arange(case.T), inp.tokens]
    ent = -(logp.exp() * logp).sum(-1)
    loss = sum((t * wt.to(torch.float64)).sum() for t, wt in ((lp, inp.w_log_prob), (ent, inp.w_entropy))
               if wt is not None)
    loss.backward()
    dh, dw, _ = reference.linear_grads(inp.hidden, inp.weight, inp.tokens, inp.w_log_prob, inp.w_entropy)
    torch.testing.assert_close(reference.linear_log_probs(inp.hidden, inp.weight, inp.tokens), lp.detach(),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference.linear_entropy(inp.hidden, inp.weight), ent.detach(), rtol=1e-12,
                               atol=1e-12)
    torch.testing.assert_close(dh, h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, w.grad, rtol=1e-10, atol=1e-12)


def test_inputs_do_not_depend_on_tp_and_specs_parse_back() -> None:
    case = LinearCase(tp=4, T=5, H=6, v_local=3, dtype="fp16", regime="peaked", chunk_size=2, seed=9)
    assert parse_case(case.spec()) == case
    a, b = case.inputs(), case.replace(tp=1, v_local=12).inputs()
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.weight, b.weight) and torch.equal(a.tokens, b.tokens)
    x = reference.linear_logits(a.hidden, a.weight)
    assert 5 < (x.max(-1).values - x.median(-1).values).min()  # a peaked row: one confident entry
    assert x.abs().max() < 60


def test_tolerance_study_separates_correct_from_defective() -> None:
    study = _study()
    cases = study.study_cases(quick=True)
    for name, variant in study.CORRECT.items():
        ratios = study.worst(variant, cases)
        assert max(ratios.values()) < 0.5, (name, ratios)  # derived, not tuned: well below 1
    assert min(study.worst(study.bf16_matmul, cases).values()) > 10
    wrong_grad = study.worst(study.bf16_logit_grad, cases, dtypes=("fp32",))
    assert wrong_grad["grad_hidden"] > 10 and wrong_grad["grad_weight"] > 10


def test_default_target_has_the_linear_level() -> None:
    assert "linear" in load_target(DEFAULT_TARGET).levels
    applied = {n for n, c in all_checks().items() if "linear" in c.levels}
    assert applied == set(LINEAR_CHECKS)


def test_work_meter_counts_in_place_products_and_sums_its_phases() -> None:
    """A gradient accumulated over chunks with `addmm_` is work too (torch's table lacks it), and a
    forward and a backward counted apart add up."""
    a, b, acc = torch.randn(4, 8), torch.randn(8, 3), torch.zeros(4, 3)
    work = Work()
    assert work.total is None
    with work.counting():
        acc.addmm_(a, b)
    with work.counting():
        torch.mm(a, b)
    assert work.total == 2 * (2 * 4 * 8 * 3)


def test_logits_budget_separates_recompute_from_saved_logits() -> None:
    """The corpus's memory case: the [T, V_local] float32 logits exceed the allowance."""
    case = LinearCase(tp=2, T=16, H=16, v_local=64, chunk_size=4, seed=17)
    assert 4 * case.T * case.v_local > linear_retained_allowance(case)


@pytest.mark.distributed
def test_builtin_is_clean_at_tp_1_2_4(harness_pools) -> None:
    runner = Runner(DEFAULT_TARGET, collective_timeout_s=10, pools=harness_pools)
    findings = explore(runner, "linear", [1, 2, 4], 45, seed=16, shrink=False)
    assert not findings, [f"{f.check} {f.case}: {f.message[:300]}" for f in findings]
    for name in LINEAR_CHECKS:
        if name not in ("hang",):
            assert runner.verdicts.stats[(name, "linear")].applied, f"{name} never applied to a linear case"
    assert max(runner.verdicts.stats[("values", "linear")].margins) < 0.5


@pytest.mark.distributed
def test_linear_mutants_killed_by_their_checks(harness_pools) -> None:
    names = [n for n, m in catalog().items() if "linear" in m.levels]
    assert len(names) >= 7
    results = run_catalog(names, [1, 2, 4], harness_pools, budget=30, collective_timeout_s=6, include_clean=False)
    survivors = [r.name for r in results if r.name != CLEAN and not r.ok]
    assert not survivors, kill_matrix(results)


def test_strategy_draws_every_tp_and_regime() -> None:
    from hypothesis import given, settings

    seen: dict[str, set] = {"tp": set(), "regime": set(), "dtype": set()}

    @settings(max_examples=60, derandomize=True, database=None)
    @given(linear_cases())
    def draw(case: LinearCase) -> None:
        assert case.H <= 64 and case.v_local <= 32 and (case.T <= 24 or case.regime == "drift")  # drift: deep
        for k, values in seen.items():
            values.add(getattr(case, k))
    draw()
    assert seen["tp"] == {1, 2, 4} and seen["dtype"] == {"fp32", "bf16", "fp16"}
    assert seen["regime"] >= {"normal", "peaked", "wide"}


@pytest.mark.parametrize("view", ["shifted", "seq_first"])
@pytest.mark.parametrize("T", [1, 3])
def test_a_hidden_view_hands_over_the_cases_rows_and_takes_back_their_gradient(view: str, T: int) -> None:
    """The strided hidden states are the case's rows at every T (at T = 1 a seq_first buffer [1, 2, H]
    has a shifted one's shape), and the gradient read back is theirs, not the filler's."""
    from harness.engine.calls import LinearShard

    case = parse_case(f"linear:tp=1,T={T},H=8,v_local=4,dtype=fp32,regime=normal,chunk_size=-1,with_entropy=0,"
                      f"with_entropy_grad=0,requires_grad=1,loss_terms=both,seed=0,hidden_view={view}")
    assert isinstance(case, LinearCase)
    shard = LinearShard.of(case, 0, torch.device("cpu"))
    assert shard.source is not None  # a view of the caller's larger buffer
    torch.testing.assert_close(shard.hidden, case.inputs().hidden, rtol=0, atol=0)
    (shard.hidden * 2.0).sum().backward()
    torch.testing.assert_close(shard.hidden_grad(), torch.full_like(shard.hidden, 2.0), rtol=0, atol=0)
